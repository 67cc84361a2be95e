"""ShapesMultimodalDataModule's `caption_pairs`: the training documents of the captions task (text only) may
name every colour-shape pair, held-out ones too, while no medium of a held-out pair and no caption beside a
medium is ever trained on, and validation and test documents stay what they were."""

from __future__ import annotations

import pytest

from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule
from zoo.task_names import Task
from zoo.tokenizers.vocab import UnifiedVocab
from zoo.world.scenes import parse_caption

VOCAB = UnifiedVocab()
TASKS = dict(caption_weight=1.0, text_to_image_weight=1.0, image_to_text_weight=1.0, audio_to_text_weight=1.0)


def datamodule(caption_pairs: str) -> ShapesMultimodalDataModule:
    data = ShapesMultimodalDataModule(vocab=VOCAB, caption_pairs=caption_pairs, **TASKS)
    data.tokenizer = data.make_tokenizer()
    return data


@pytest.fixture(scope="module")
def both() -> tuple[ShapesMultimodalDataModule, ShapesMultimodalDataModule]:
    return datamodule("trained"), datamodule("all")


def named_pairs(data: ShapesMultimodalDataModule, task: Task, split: str, n: int) -> set[tuple[str, str]]:
    """The (colour, shape) pairs the caption text of `n` documents of `task` names."""
    pairs = set()
    for index in range(n):
        text = " ".join(
            data.decode(s.ids) for s in data.task_document(task, split, index) if hasattr(s, "ids")
        )
        if not text.strip():
            continue  # a caption-less document (guidance's unconditional share)
        objects = parse_caption(text)
        assert objects is not None, text
        pairs |= {(o.colour, o.shape) for o in objects}
    return pairs


def test_only_all_names_held_out_pairs_and_only_in_the_captions_task(both):
    trained, every = both
    held = trained.world.heldout_pairs
    assert not named_pairs(trained, Task.CAPTION, "train", 200) & held
    assert named_pairs(every, Task.CAPTION, "train", 200) >= held  # each held-out pair named in text
    for task in (Task.TEXT_TO_IMAGE, Task.IMAGE_TO_TEXT, Task.AUDIO_TO_TEXT):
        assert not named_pairs(every, task, "train", 100) & held, task  # never beside a medium


@pytest.mark.parametrize("split", ["val", "test"])
def test_evaluation_documents_do_not_change(both, split):
    trained, every = both
    for task in (Task.CAPTION, Task.IMAGE_TO_TEXT):
        for index in range(8):
            a, b = trained.task_document(task, split, index), every.task_document(task, split, index)
            assert [s.ids for s in a if hasattr(s, "ids")] == [s.ids for s in b if hasattr(s, "ids")]


def test_an_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="caption_pairs"):
        ShapesMultimodalDataModule(vocab=VOCAB, caption_pairs="some")
