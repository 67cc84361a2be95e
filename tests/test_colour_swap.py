"""ShapesWorld's `colour_swap_prob`: in training understanding documents an object's colour word may be fed
as another colour (one whose pair with the object's shape is trained), as context without a target, while
the rest of the caption, the shape after it included, stays the target."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from zoo.batch import IGNORE_INDEX
from zoo.datamodules.sequence import TextSegment
from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule
from zoo.task_names import Task
from zoo.tokenizers.vocab import UnifiedVocab
from zoo.world.scenes import COLOURS, ShapesWorld, caption

VOCAB = UnifiedVocab()


@pytest.fixture(scope="module")
def world() -> ShapesMultimodalDataModule:
    data = ShapesMultimodalDataModule(vocab=VOCAB, colour_swap_prob=1.0, audio_to_text_weight=1.0)
    data.tokenizer = data.make_tokenizer()  # the BPE the demo trains: words are several ids each
    return data


def caption_segments(document: list) -> list[TextSegment]:
    return [s for s in document[1:] if isinstance(s, TextSegment)]


@pytest.mark.parametrize("task", [Task.IMAGE_TO_TEXT, Task.AUDIO_TO_TEXT])
def test_every_colour_is_fed_untargeted_as_a_colour_whose_pair_with_the_shape_was_trained(world, task):
    held, swaps = world.world.heldout_pairs, set()
    for index in range(16):
        scene = world.world.scene(index, "train")
        segments = caption_segments(world.task_document(task, "train", index))
        fed = [world.decode(s.ids).strip() for s in segments if not s.predict]
        assert len(fed) == len(scene.objects)  # p = 1: every object's colour, nothing else
        for colour, obj in zip(fed, scene.objects, strict=True):
            assert colour in COLOURS and colour != obj.colour and (colour, obj.shape) not in held
            swaps.add((obj.shape, colour))
        # The targets read as the caption with each colour left out, the shape right after the fed colour.
        words = [w for w in world.world.caption(scene).split() if w not in COLOURS]
        targets = " ".join(
            world.decode([i for i in s.ids if i != VOCAB.eos_id]) for s in segments if s.predict
        )
        assert targets.split() == words
        assert segments[-1].predict and segments[-1].ids[-1] == VOCAB.eos_id
    assert len(swaps) > 10  # drawn among the trained colours, not one fixed substitute


def test_nothing_predicts_a_swapped_colour_and_its_last_id_predicts_the_shape(world):
    document = world.task_document(Task.IMAGE_TO_TEXT, "train", 0)
    fed = next(s for s in caption_segments(document) if not s.predict)
    batch = world.builder.collate([document])
    ids, targets = batch.input_ids[0].tolist(), batch.targets["text"][0].tolist()
    start = next(p for p in range(len(ids)) if ids[p : p + len(fed)] == fed.ids)
    end = start + len(fed)  # the fed colour is ids[start:end]
    assert targets[start - 1 : end - 1] == [IGNORE_INDEX] * len(fed)
    shape = world.caption_ids(f" {world.world.scene(0, 'train').objects[0].shape}")
    assert targets[end - 1 : end - 1 + len(shape)] == shape


def test_unswapped_segments_are_the_caption_ids_themselves(world):
    off = ShapesMultimodalDataModule(vocab=VOCAB, audio_to_text_weight=1.0)
    off.tokenizer = world.tokenizer
    for index in range(8):
        for data, split in ((off, "train"), (world, "val")):
            caption = world.caption_ids(world.world.caption(world.world.scene(index, split)))
            segments = caption_segments(data.task_document(Task.IMAGE_TO_TEXT, split, index))
            assert [s.ids for s in segments] == [[*caption, VOCAB.eos_id]] and segments[0].predict


def test_a_swap_probability_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match="colour_swap_prob"):
        ShapesMultimodalDataModule(vocab=VOCAB, colour_swap_prob=1.5)


def test_any_colour_may_be_fed_when_asked_held_out_pairs_included(world):
    probe = ShapesMultimodalDataModule(vocab=VOCAB, colour_swap_prob=1.0, colour_swap_pairs="any")
    probe.tokenizer = world.tokenizer
    fed_pairs = set()
    for index in range(64):
        scene = probe.world.scene(index, "train")
        fed = [
            probe.decode(s.ids).strip()
            for s in caption_segments(probe.task_document(Task.IMAGE_TO_TEXT, "train", index))
            if not s.predict
        ]
        fed_pairs |= {(c, o.shape) for c, o in zip(fed, scene.objects, strict=True)}
    assert fed_pairs & probe.world.heldout_pairs
    with pytest.raises(ValueError, match="colour_swap_pairs"):
        ShapesMultimodalDataModule(vocab=VOCAB, colour_swap_pairs="some")


def test_the_benchmark_feeds_each_object_s_caption_up_to_its_colour_the_written_one_or_a_swap():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # where it finds _common
    prefixes = importlib.import_module("colour_swap").object_prefixes
    scene = next(s for s in (ShapesWorld(seed=0).scene(i, "train") for i in range(64)) if len(s.objects) == 2)
    words = caption(scene).split()
    second = words.index("a", 1)
    (first_prefix, first_shape), (second_prefix, second_shape) = prefixes(scene)
    assert first_prefix == " ".join(words[:3]) and first_shape == words[3]
    assert second_prefix == " ".join(words[: second + 3]) and second_shape == words[second + 3]
    swapped = prefixes(scene, "cyan")
    assert [p.split()[-1] for p, _ in swapped] == ["cyan", "cyan"]
    assert swapped[1][0].split()[:-1] == second_prefix.split()[:-1]  # the first object keeps its own colour
    with pytest.raises(ValueError, match="shape_first"):
        prefixes(scene, order="shape_first")  # its shape comes before any colour that could be swapped
