"""The routing analysis (issue 7 item 1): NE and top-expert IoU on hand-made loads with known answers,
counts by modality from router decisions, `zoo analyze` end to end on a tiny checkpoint made here, and the
`RoutingMonitor` callback during a short fit."""

from __future__ import annotations

import json
import math

import lightning as L
import matplotlib.image
import pytest
import torch
from safetensors.torch import load_file

from zoo.analysis.routing import (
    RoutingCounts,
    RoutingRecorder,
    chance_iou,
    iou,
    load_entropy,
    normalised_entropy,
    top_experts,
)
from zoo.batch import Modality
from zoo.cli import main as cli_main
from zoo.datamodules.sequence import MediaLayout, SequenceBuilder, TextSegment, VisualSegment
from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule
from zoo.models.backbone import UnifiedTransformer
from zoo.models.moe import ModalityPools
from zoo.models.unified import UnifiedModel
from zoo.tasks.pretrain import UnifiedPretraining
from zoo.tasks.routing_monitor import RoutingMonitor
from zoo.tokenizers.audio import AudioCodec
from zoo.tokenizers.visual import VisualTokenizer
from zoo.tokenizers.vocab import UnifiedVocab

TEXT, IMAGE, AUDIO = Modality.TEXT, Modality.IMAGE, Modality.AUDIO


# --- the measures on hand-made loads ------------------------------------------------------------------


def test_normalised_entropy_is_one_for_even_load_zero_for_one_expert_and_half_for_two_of_four():
    assert normalised_entropy([5, 5, 5, 5]) == pytest.approx(1.0)
    assert normalised_entropy([0, 9, 0, 0]) == pytest.approx(0.0)
    assert normalised_entropy([3, 3, 0, 0]) == pytest.approx(0.5)  # log 2 / log 4
    # p = (1/2, 1/4, 1/4): H = 1.5 log 2, over log 3
    assert normalised_entropy([2, 1, 1]) == pytest.approx(1.5 * math.log(2) / math.log(3))
    assert math.isnan(normalised_entropy([0, 0, 0]))
    # The tensor form used in training steps agrees, per row, without leaving the tensor's device.
    loads = torch.tensor([[5.0, 5, 5, 5], [0, 9, 0, 0], [3, 3, 0, 0]])
    assert load_entropy(loads).tolist() == pytest.approx([1.0, 0.0, 0.5])


def test_normalised_entropy_refuses_negative_or_empty_loads():
    with pytest.raises(ValueError, match="negative"):
        normalised_entropy([1, -1])
    with pytest.raises(ValueError, match="non-empty"):
        normalised_entropy([])


def test_top_quarter_is_the_ceil_of_a_quarter_of_the_experts_by_load_without_unused_ones():
    assert top_experts([5, 1, 4, 3, 0, 0, 2, 9]) == {7, 0}  # ceil(8 / 4) = 2
    assert top_experts([1, 1, 1, 1, 1]) == {0, 1}  # ceil(5 / 4) = 2, ties to the lower index
    assert top_experts([0, 0, 3, 0, 0, 0, 0, 0]) == {2}  # unused experts are never "top"
    assert top_experts([0, 0, 0, 0]) == set()
    with pytest.raises(ValueError, match="fraction"):
        top_experts([1, 2], fraction=0.0)


def test_iou_of_sets_and_the_chance_level_of_random_top_sets():
    assert iou({0, 1}, {1, 2}) == pytest.approx(1 / 3)
    assert iou({0, 1}, {0, 1}) == 1.0 and iou({0}, {3}) == 0.0
    assert math.isnan(iou(set(), set()))
    assert chance_iou(4, 4, 4) == 1.0  # every expert is in both sets
    assert chance_iou(16, 4, 4) == pytest.approx(0.1580, abs=1e-4)  # hypergeometric overlap
    assert chance_iou(8, 4, 4) == pytest.approx(
        sum(  # brute force over all pairs of 4-sets of 8
            len(set(a) & set(b)) / len(set(a) | set(b)) for a in _subsets(8, 4) for b in _subsets(8, 4)
        )
        / len(_subsets(8, 4)) ** 2
    )


def _subsets(n: int, k: int) -> list[tuple[int, ...]]:
    from itertools import combinations

    return list(combinations(range(n), k))


def test_counts_by_modality_give_the_known_shares_entropies_and_ious():
    counts = RoutingCounts(layers=[1, 2], n_experts=8)
    # layer 1: text on experts 0/1 and image on 2/3, disjoint; layer 2: both on 0/1
    modality = torch.tensor([TEXT, TEXT, IMAGE, IMAGE])
    counts.add(1, torch.tensor([[0, 1], [0, 1], [2, 3], [2, 3]]), modality)
    counts.add(2, torch.tensor([[0, 1], [1, 0], [0, 1], [0, 1]]), modality)
    counts.tokens[TEXT], counts.tokens[IMAGE] = 2, 2
    assert counts.modalities() == [TEXT, IMAGE]
    assert counts.share(TEXT)[0].tolist() == [0.5, 0.5, 0, 0, 0, 0, 0, 0]
    assert counts.iou() == {"text-image": [0.0, 1.0]}
    ne = counts.entropy()
    assert ne["all"] == pytest.approx([2 / 3, 1 / 3])  # log 4 / log 8, log 2 / log 8
    assert ne["text"] == pytest.approx([1 / 3, 1 / 3])
    summary = counts.summary()
    assert summary["tokens"] == {"text": 2, "image": 2}
    assert summary["iou_mean"] == {"text-image": 0.5}
    assert summary["iou_chance"]["text-image"] == [pytest.approx(chance_iou(8, 2, 2), abs=1e-6)] * 2
    assert counts.scalars()["iou/text-image"] == 0.5


def test_counts_refuse_router_outputs_that_do_not_fit():
    counts = RoutingCounts(layers=[1], n_experts=4)
    with pytest.raises(ValueError, match="not one of the MoE layers"):
        counts.add(0, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"expected \[N, k\] and \[N\]"):
        counts.add(1, torch.zeros(2, 1, dtype=torch.long), torch.ones(3, dtype=torch.long))


# --- recorded from a model ----------------------------------------------------------------------------


def tiny_multimodal(modality_pools: ModalityPools | None = None, audio: bool = True) -> UnifiedModel:
    torch.manual_seed(0)
    visual = VisualTokenizer()
    vocab = UnifiedVocab(text_size=320, visual_size=visual.codebook_size, audio_size=256, audio_levels=4)
    backbone = UnifiedTransformer(
        dim=32,
        n_layers=3,
        n_heads=2,
        n_kv_heads=1,
        n_dense_layers=1,
        n_experts=8,
        expert_hidden=16,
        top_k=2,
        max_seq_len=256,
        modality_pools=modality_pools,
    )
    codec = AudioCodec() if audio else None
    return UnifiedModel(backbone, vocab, mtp_depth=0, visual_tokenizer=visual, audio_codec=codec)


def test_recorder_counts_every_valid_token_k_times_per_layer_and_isolation_gives_iou_zero():
    pools = ModalityPools(text=(0, 1, 2, 3), image=(4, 5, 6, 7))
    model = tiny_multimodal(pools, audio=False)
    builder = SequenceBuilder(model.vocab, 128, layout=MediaLayout(model.nfsp.scales))
    bos = model.vocab.bos_id
    image = torch.rand(3, 32, 32) * 2 - 1
    batch = builder.collate(
        [
            [TextSegment([bos, *(model.vocab.text_offset + i for i in range(1, 9))]), VisualSegment(image)],
            [TextSegment([bos, model.vocab.text_offset + 3])],
        ]
    )
    recorder = RoutingRecorder(model.train())
    recorder.record(batch)
    counts = recorder.counts
    assert model.training  # put back as it was
    n_text, n_image = int((batch.modality == TEXT).sum()), int((batch.modality == IMAGE).sum())
    assert counts.tokens[TEXT] == n_text and counts.tokens[IMAGE] == n_image
    assert counts.counts[:, TEXT].sum(-1).tolist() == [2 * n_text] * 2  # top-2, two MoE layers
    assert counts.counts[:, TEXT, 4:].sum() == 0 and counts.counts[:, IMAGE, :4].sum() == 0
    assert counts.iou() == {"text-image": [0.0, 0.0]}


def test_zoo_analyze_writes_json_and_figures_for_a_tiny_text_image_audio_checkpoint(tmp_path, capsys):
    model = tiny_multimodal()
    task = UnifiedPretraining(model, lr=1e-3, warmup_steps=1)
    data = ShapesMultimodalDataModule(
        vocab=model.vocab,
        layout=MediaLayout(model.nfsp.scales, audio_hop=model.audio_codec.hop),
        text_to_audio_weight=1.0,
        audio_to_text_weight=1.0,
        train_size=8,
        val_size=8,
        batch_size=4,
        seq_len=256,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        enable_checkpointing=False,
    )
    trainer.fit(task, datamodule=data)
    ckpt = tmp_path / "tiny.ckpt"
    trainer.save_checkpoint(ckpt)

    out = tmp_path / "analysis"
    cli_main(
        [
            "analyze",
            "--checkpoint",
            str(ckpt),
            "--out",
            str(out),
            "--batches",
            "2",
            "--batch_size",
            "4",
            "--save_tokens",
        ]
    )
    printed = capsys.readouterr().out
    assert "IoU of top-25% experts" in printed and "normalised entropy" in printed
    result = json.loads((out / "routing.json").read_text())
    assert result["batches"] == 2 and result["layers"] == [1, 2] and result["n_experts"] == 8
    assert set(result["tokens"]) == {"text", "image", "audio"}  # every modality the tokenizers allow
    assert set(result["iou"]) == {"text-image", "text-audio", "image-audio"}
    for name, tokens in result["tokens"].items():
        assert [sum(row) for row in result["counts"][name]] == [2 * tokens] * 2
    for values in result["normalised_entropy"].values():
        assert all(0.0 <= v <= 1.0 for v in values)
    assert result["modality_pools"] is None
    # every token's choices, consistent with the counts
    tokens = load_file(out / "routing_tokens.safetensors")
    assert tokens["modality"].shape[0] == sum(result["tokens"].values())
    assert tokens["layer1"].shape == (tokens["modality"].shape[0], 2)
    text_choices = tokens["layer2"][tokens["modality"] == int(TEXT)].flatten()
    assert torch.bincount(text_choices, minlength=8).tolist() == result["counts"]["text"][1]
    for name in ("routing_heatmap.png", "routing_iou.png"):
        pixels = matplotlib.image.imread(out / name)
        assert pixels.shape[0] > 100 and pixels.shape[1] > 200


def test_zoo_analyze_names_a_missing_checkpoint_and_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="nothing.ckpt"):
        cli_main(["analyze", "--checkpoint", str(tmp_path / "nothing.ckpt"), "--out", str(tmp_path)])
    assert torch.is_grad_enabled()  # a failed analysis leaves the process's autograd on (later tests train)
    from zoo.analysis.command import datamodule_from_config

    config = tmp_path / "model_only.yaml"
    config.write_text("model:\n  class_path: zoo.tasks.pretrain.UnifiedPretraining\n")
    with pytest.raises(ValueError, match="model_only.yaml: no `data"):
        datamodule_from_config([config])


# --- during training ----------------------------------------------------------------------------------


class QuietTensorBoard(L.pytorch.loggers.TensorBoardLogger):
    """Leaves out the hparams.yaml (the model's config as YAML takes most of this test's time)."""

    def log_hyperparams(self, params, metrics=None) -> None:  # noqa: ANN001
        pass


def test_routing_monitor_logs_entropy_and_iou_in_training_and_validation(tmp_path):
    model = tiny_multimodal(audio=False)
    task = UnifiedPretraining(model, lr=1e-3, warmup_steps=1)
    data = ShapesMultimodalDataModule(
        vocab=model.vocab,
        layout=MediaLayout(model.nfsp.scales),
        train_size=8,
        val_size=4,
        batch_size=4,
        seq_len=256,
    )
    logger = QuietTensorBoard(tmp_path, name="logs")
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        default_root_dir=tmp_path,
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        val_check_interval=2,
        enable_checkpointing=False,
        log_every_n_steps=1,
        callbacks=[RoutingMonitor(every_n_steps=1)],
    )
    trainer.fit(task, datamodule=data)
    logged = trainer.logged_metrics
    assert 0.0 <= float(logged["routing/val/ne/all"]) <= 1.0
    assert 0.0 <= float(logged["routing/val/iou/text-image"]) <= 1.0
    assert "routing/train/ne/text" in logged and "routing/train/ne/all/layer1" in logged
    # the heatmap went to TensorBoard beside the scalars
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(logger.log_dir)
    events.Reload()
    assert "routing/val/heatmap" in events.Tags()["images"]
    # nothing stays attached to the model after a record
    assert not any(block.ffn._forward_hooks for block in model.backbone.layers if block.is_moe)
