"""Learning curves in the verifiers' terms (issue 19 item 1) and the gallery's held-out split, on a tiny
text + image model trained for a few steps: every point is a real evaluation of the model being trained."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from zoo.datamodules.sequence import MediaLayout
from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule
from zoo.models.backbone import UnifiedTransformer
from zoo.models.unified import UnifiedModel
from zoo.tasks.callbacks import MultimodalGallery
from zoo.tasks.gallery_overview import curve_figure
from zoo.tasks.pretrain import UnifiedPretraining
from zoo.tasks.verifier_curve import CURVE_FILE, VerifierCurve
from zoo.tokenizers.visual import VisualTokenizer
from zoo.tokenizers.vocab import UnifiedVocab


def _fit(tmp_path, callbacks: list[L.Callback], steps: int = 4) -> L.Trainer:
    torch.manual_seed(0)
    visual = VisualTokenizer()
    vocab = UnifiedVocab(text_size=320, visual_size=visual.codebook_size, audio_size=256, audio_levels=4)
    backbone = UnifiedTransformer(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, expert_hidden=16,
                                  top_k=2, max_seq_len=256)
    task = UnifiedPretraining(UnifiedModel(backbone, vocab, mtp_depth=0, visual_tokenizer=visual), lr=1e-3,
                              warmup_steps=1)
    data = ShapesMultimodalDataModule(vocab=vocab, layout=MediaLayout(visual.scales), train_size=8,
                                      val_size=4,
                                      batch_size=4, seq_len=256)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, default_root_dir=tmp_path, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, enable_checkpointing=False, callbacks=callbacks)
    trainer.fit(task, datamodule=data)
    return trainer


def test_the_curve_scores_every_task_every_n_steps_and_at_the_end(tmp_path):
    _fit(tmp_path, [VerifierCurve(every_n_steps=2, scenes=2)], steps=3)
    points = [json.loads(line) for line in (tmp_path / CURVE_FILE).read_text().splitlines()]
    assert [p["step"] for p in points] == [2, 3]
    for point in points:
        assert point["scenes"] == 2
        for task in ("text_to_image", "image_to_text"):  # captions alone have no verifier
            assert 0.0 <= point[f"{task}/exact"] <= 1.0
            assert 0.0 <= point[f"{task}/attribute_accuracy"] <= 1.0
        assert not any("baseline" in key for key in point)  # the curve is the model's
    picture = curve_figure(tmp_path / CURVE_FILE, tmp_path / "curve.png")
    assert picture is not None and picture.stat().st_size > 1000
    assert curve_figure(tmp_path / "missing.jsonl", tmp_path / "none.png") is None


def test_the_gallery_scores_the_held_out_split_under_its_own_keys(tmp_path):
    _fit(tmp_path, [MultimodalGallery(num_samples=2, score_splits=["test"], best_of=2)], steps=1)
    metrics = json.loads((tmp_path / "gallery" / "metrics.json").read_text())
    assert metrics["text_to_image/best_of"] == metrics["test/text_to_image/best_of"] == 2.0
    assert "test/text_to_image/one_sample_exact" in metrics
    for task in ("text_to_image", "image_to_text"):
        for key in ("exact", "attribute_accuracy"):
            assert f"{task}/{key}" in metrics and f"test/{task}/{key}" in metrics
            low, high = metrics[f"{task}/{key}_ci95_low"], metrics[f"{task}/{key}_ci95_high"]
            assert low <= metrics[f"{task}/{key}"] <= high
    assert (tmp_path / "gallery" / "overview.png").is_file()


def test_a_curve_needs_a_positive_interval():
    with pytest.raises(ValueError, match="every_n_steps"):
        VerifierCurve(every_n_steps=0)
