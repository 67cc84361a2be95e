"""ShapesMultimodalDataModule's `caption_order`: every task's captions in the order asked (places first,
or shapes before colours), about the same scenes; a checkpoint keeps the order, so a resume cannot mix
orders and a benchmark prompts it as it was trained."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from zoo.datamodules.sequence import MediaLayout
from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule
from zoo.models.backbone import UnifiedTransformer
from zoo.models.unified import UnifiedModel
from zoo.task_names import Task
from zoo.tasks.pretrain import UnifiedPretraining
from zoo.tokenizers.visual import VisualTokenizer
from zoo.tokenizers.vocab import UnifiedVocab
from zoo.world.scenes import COLOURS, SHAPES, parse_caption

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # where it finds _common
TASKS = dict(caption_weight=1.0, text_to_image_weight=1.0, image_to_text_weight=1.0, audio_to_text_weight=1.0)


def datamodule(order: str, vocab: UnifiedVocab = UnifiedVocab(), **kwargs) -> ShapesMultimodalDataModule:
    data = ShapesMultimodalDataModule(vocab=vocab, caption_order=order, **kwargs)
    data.tokenizer = data.make_tokenizer()
    return data


def opens_with_a_place(words: list[str]) -> bool:
    return words[0] in ("at", "in")


def names_the_shape_before_the_colour(words: list[str]) -> bool:
    return words[2] in SHAPES and words[3] in COLOURS


@pytest.mark.parametrize(
    ("order", "written_in_order"),
    [("place_first", opens_with_a_place), ("shape_first", names_the_shape_before_the_colour)],
)
def test_an_order_writes_every_task_s_captions_in_that_order_about_the_same_scenes(order, written_in_order):
    first, default = datamodule(order, **TASKS), datamodule("attributes_first", **TASKS)
    for task in (Task.CAPTION, Task.TEXT_TO_IMAGE, Task.IMAGE_TO_TEXT, Task.AUDIO_TO_TEXT):
        for index in range(20):
            texts = [
                " ".join(d.decode(s.ids) for s in d.task_document(task, "val", index) if hasattr(s, "ids"))
                for d in (first, default)
            ]
            if not texts[0].strip():
                continue  # a caption-less document (guidance's unconditional share)
            assert written_in_order(texts[0].split()) and not written_in_order(texts[1].split()), texts
            assert parse_caption(texts[0]) == parse_caption(texts[1]) is not None


def test_the_order_travels_in_the_datamodule_state_and_a_resume_in_another_is_refused():
    first = datamodule("place_first")
    state = first.state_dict()
    assert state["caption_order"] == "place_first" and "tokenizer" in state
    datamodule("place_first").load_state_dict(state)
    with pytest.raises(ValueError, match="set data.init_args.caption_order to 'place_first'"):
        datamodule("attributes_first").load_state_dict(state)
    older = {"tokenizer": state["tokenizer"]}  # a checkpoint from before the option: attributes first
    datamodule("attributes_first").load_state_dict(older)
    with pytest.raises(ValueError, match="caption_order"):
        datamodule("place_first").load_state_dict(older)


def test_a_benchmark_prompts_a_checkpoint_in_the_order_it_was_trained_in(tmp_path):
    torch.manual_seed(0)
    visual = VisualTokenizer()
    vocab = UnifiedVocab(text_size=320, visual_size=visual.codebook_size)
    backbone = UnifiedTransformer(
        dim=32, n_layers=1, n_heads=2, n_kv_heads=1, n_experts=2, expert_hidden=16, top_k=1, max_seq_len=160
    )
    model = UnifiedModel(backbone, vocab, mtp_depth=0, visual_tokenizer=visual)
    data = datamodule(
        "place_first", vocab, layout=MediaLayout.of(model), caption_weight=0.0, text_to_image_weight=1.0,
        image_to_text_weight=0.0, max_objects=1, train_size=16, val_size=4, tokenizer_size=300, seq_len=160,
        batch_size=2,
    )  # fmt: skip
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, max_steps=1,
                        limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(UnifiedPretraining(model), datamodule=data)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    _, loaded = importlib.import_module("_common").load_shapes_checkpoint(str(tmp_path / "last.ckpt"))
    assert loaded.world.caption_order == "place_first"
    scene = loaded.world.scene(0, "val")
    assert loaded.world.caption(scene) == data.world.caption(scene)
