"""Generated images refined by the diffusion refiner: one decode path (`zoo.models.refinement`) for the
evaluation and the gallery, `zoo predict`, the pipeline and `benchmarks/refined_generation.py`.

The models are tiny and untrained (built here): what is specified is the path, not the quality. A refined
image is the refiner's output size, differs from the bicubic-upsampled decode, repeats for the same seed,
and the unrefined figures of a refined evaluation are those of the plain evaluation of the same codes.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from zoo.datamodules.requests import MediaRequest
from zoo.datamodules.sequence import MediaLayout
from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule
from zoo.inference.pipeline import Pipeline
from zoo.models.backbone import UnifiedTransformer
from zoo.models.media_generation import generate_visual
from zoo.models.refinement import ImageRefinement, RefinerSettings, decode_visual
from zoo.models.refiner import DiffusionRefiner
from zoo.models.unified import UnifiedModel
from zoo.tasks.callbacks import GenerationWriter
from zoo.tasks.metrics import per_image_psnr
from zoo.tasks.multimodal_eval import answer_requests, evaluate, write_gallery
from zoo.tasks.pretrain import SamplingConfig, UnifiedPretraining
from zoo.tokenizers.visual import VisualTokenizer
from zoo.tokenizers.vocab import UnifiedVocab
from zoo.world.render import render_image, to_tensor

REPO = Path(__file__).resolve().parents[1]


def tiny_model() -> UnifiedModel:
    torch.manual_seed(0)
    visual = VisualTokenizer()  # 32x32 images, scales 1/2/4/8
    vocab = UnifiedVocab(text_size=320, visual_size=visual.codebook_size)
    backbone = UnifiedTransformer(
        dim=32, n_layers=1, n_heads=2, n_kv_heads=1, n_experts=2, expert_hidden=16, top_k=1, max_seq_len=160
    )
    return UnifiedModel(backbone, vocab, mtp_depth=0, visual_tokenizer=visual).eval()


def tiny_refiner(image_size: int = 64, condition_size: int | None = 32) -> DiffusionRefiner:
    torch.manual_seed(1)
    return DiffusionRefiner(
        image_size=image_size, block_out_channels=(8, 16), attention_levels=(False, False), norm_num_groups=4,
        num_inference_steps=2, condition_size=condition_size,
    )  # fmt: skip


def image_data(model: UnifiedModel) -> ShapesMultimodalDataModule:
    data = ShapesMultimodalDataModule(
        vocab=model.vocab, layout=MediaLayout.of(model), caption_weight=0.0, text_to_image_weight=1.0,
        image_to_text_weight=0.0, max_objects=1, train_size=64, val_size=16, tokenizer_size=300, seq_len=160,
        batch_size=4,
    )  # fmt: skip
    data.setup("validate")
    return data


@pytest.fixture(scope="module")
def setup() -> tuple[UnifiedModel, ShapesMultimodalDataModule]:
    model = tiny_model()
    return model, image_data(model)


def test_decode_visual_refines_to_the_refiners_size_and_repeats_for_the_same_seed(setup):
    model, data = setup
    prompts = [data.generation_prompt("text_to_image", s) for s in data.world.scenes("val", 2)]
    codes = generate_visual(model, prompts, generator=torch.Generator().manual_seed(0))
    refinement = ImageRefinement(tiny_refiner(), steps=1, seed=3)
    plain = decode_visual(model, codes)
    refined = decode_visual(model, codes, refinement)
    assert plain.shape == (2, 3, 32, 32) and refined.shape == (2, 3, 64, 64)
    bicubic = F.interpolate(plain, size=(64, 64), mode="bicubic", align_corners=False).clamp(-1, 1)
    assert (refined - bicubic).abs().mean() > 1e-3  # the refiner really ran
    assert torch.equal(refined, decode_visual(model, codes, refinement))  # seeded at every call
    assert not refinement.refiner.training and not refined.requires_grad


def test_video_frames_are_refined_one_by_one():
    refinement = ImageRefinement(tiny_refiner(), steps=1)
    video = torch.rand(2, 3, 3, 32, 32) * 2 - 1
    refined = refinement.refine(video)
    assert refined.shape == (2, 3, 3, 64, 64)
    # Each frame is its own image: frame t of the video is the refinement of frame t alone, up to its noise.
    assert (refined[:, :, 0] - refined[:, :, 1]).abs().mean() > 0


def test_a_refiner_of_another_condition_size_or_a_smaller_output_is_refused(setup):
    model, data = setup
    with pytest.raises(ValueError, match=r"refines 16x16 decodes .* decodes 32x32"):
        evaluate(model, data, 2, tasks=["text_to_image"], refinement=ImageRefinement(tiny_refiner(64, 16)))
    with pytest.raises(ValueError, match=r"outputs 16x16 images, smaller than .* 32x32"):
        Pipeline(model, data.tokenizer, refinement=ImageRefinement(tiny_refiner(16, None)))
    with pytest.raises(ValueError, match="steps=0 must be in 1..1000"):
        ImageRefinement(tiny_refiner(), steps=0)


def test_refined_evaluation_keeps_the_plain_figures_and_adds_refined_ones(setup, tmp_path):
    model, data = setup
    plain = evaluate(model, data, 4, tasks=["text_to_image"], seed=5)
    refined = evaluate(model, data, 4, tasks=["text_to_image"], seed=5,
                       refinement=ImageRefinement(tiny_refiner(), steps=1))  # fmt: skip
    for key, value in plain.metrics.items():  # same codes, same decodes, same verdicts
        assert refined.metrics[key] == value, key
    for a, b in zip(plain.samples, refined.samples, strict=True):
        assert torch.equal(a.media, b.media) and a.score == b.score and a.refined is None
    added = set(refined.metrics) - set(plain.metrics)
    assert added == {f"text_to_image/{k}" for k in (
        "refined_exact", "refined_attribute_accuracy", "psnr", "refined_psnr", "ssim", "refined_ssim"
    )}  # fmt: skip
    samples = refined.samples
    assert all(s.refined.shape == (3, 64, 64) and s.refined_score is not None for s in samples)
    # psnr: the decode, bicubic-upsampled to 64, against the 64-pixel render of the caption's own scene.
    decodes = torch.stack([s.media for s in samples])
    renders = torch.stack([to_tensor(render_image(s.scene, 64)) for s in samples])
    bicubic = F.interpolate(decodes, size=(64, 64), mode="bicubic", align_corners=False).clamp(-1, 1)
    plain_psnr = per_image_psnr(bicubic, renders).mean().item()
    assert refined.metrics["text_to_image/psnr"] == pytest.approx(plain_psnr)
    refined_images = torch.stack([s.refined for s in samples])
    psnr = per_image_psnr(refined_images, renders).mean().item()
    assert refined.metrics["text_to_image/refined_psnr"] == pytest.approx(psnr)

    page = write_gallery(refined, tmp_path / "gallery").read_text()
    assert "| prompt | decode | refined | verifier |" in page
    assert "(text_to_image_000.png)" in page and "(text_to_image_000_refined.png)" in page
    assert (tmp_path / "gallery" / "text_to_image_000_refined.png").is_file()
    assert page.count("| decode: ") == 4  # every sample's row gives both verdicts
    assert "| text_to_image refined (PSNR " in page  # and the summary table the refined figures
    metrics = json.loads((tmp_path / "gallery" / "metrics.json").read_text())
    assert "text_to_image/exact" in metrics and "text_to_image/refined_psnr" in metrics


def test_predict_refines_generated_images_from_the_sampling_refiner_folder(setup, tmp_path):
    model, data = setup
    folder = tiny_refiner().save_pretrained(tmp_path / "diffusion_refiner")
    task = UnifiedPretraining(model, sampling=SamplingConfig(refiner=RefinerSettings(str(folder), steps=1)))
    refinement = task.refinement()
    assert isinstance(refinement, ImageRefinement) and refinement.steps == 1
    assert not any(k.startswith("_refinement") or "unet" in k for k in task.state_dict())  # not a submodule
    scene = data.world.scenes("val", 1)[0]
    request = MediaRequest("text_to_image", "one", prompt=data.generation_prompt("text_to_image", scene),
                           scene=scene)  # fmt: skip
    rows = answer_requests(model, data, [request], refinement=refinement)
    assert rows[0]["media"].shape == (3, 64, 64) and "scores" in rows[0]

    # `zoo predict`'s loop: the written PNGs are the refined 64-pixel images (scaled 4x for the page).
    output = tmp_path / "predictions.jsonl"
    trainer = L.Trainer(logger=False, enable_progress_bar=False, callbacks=[GenerationWriter(str(output))])
    data.predict_scenes = 2
    trainer.predict(task, datamodule=data)
    written = [json.loads(line) for line in output.read_text().splitlines()]
    images = [Image.open(r["media"]) for r in written if r["task"] == "text_to_image"]
    assert images and all(image.size == (256, 256) for image in images)


def test_the_pipeline_draws_refined_images_unless_asked_not_to(setup):
    model, data = setup
    pipe = Pipeline(model, data.tokenizer, refinement=ImageRefinement(tiny_refiner(), steps=1))
    assert pipe("a small red circle at the top left", output="image", seed=0).size == (64, 64)
    assert pipe("a small red circle at the top left", output="image", seed=0, refine=False).size == (32, 32)


def _load_benchmark():
    path = REPO / "benchmarks" / "refined_generation.py"
    spec = importlib.util.spec_from_file_location("refined_generation_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_reports_the_plain_evaluations_figures_beside_the_refined_ones(setup, tmp_path, capsys):
    model, data = copy.deepcopy(setup[0]), setup[1]  # the training step below must not change the fixture
    task = UnifiedPretraining(model)
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, max_steps=1,
                        limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(task, datamodule=data)  # one step, for a real checkpoint with the tokenizer in it
    checkpoint = tmp_path / "last.ckpt"
    trainer.save_checkpoint(checkpoint)
    folder = tiny_refiner().save_pretrained(tmp_path / "diffusion_refiner")
    argv = [str(checkpoint), "--refiner", str(folder), "--scenes", "3", "--steps", "1", "--max-objects", "1"]
    result = _load_benchmark().main(argv)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["size"] == 64 and result["refiner_steps"] == 1
    plain = evaluate(task.model, data, 3, tasks=["text_to_image"], seed=0)
    assert result["decoded_exact"] == round(plain.metrics["text_to_image/exact"], 4)
    assert result["decoded_attribute_accuracy"] == round(plain.metrics["text_to_image/attribute_accuracy"], 4)
    # The same codes as the plain evaluation's: its decodes, bicubic-upsampled, give the benchmark's PSNR.
    decodes = torch.stack([s.media for s in plain.samples])
    bicubic = F.interpolate(decodes, size=(64, 64), mode="bicubic", align_corners=False).clamp(-1, 1)
    renders = torch.stack([to_tensor(render_image(s.scene, 64)) for s in plain.samples])
    assert result["decoded_psnr"] == round(per_image_psnr(bicubic, renders).mean().item(), 4)
    assert result["refined_psnr"] != result["decoded_psnr"]
    assert {"refined_exact", "refined_ssim", "decoded_ssim", "psnr_gain_db"} <= set(result)


def test_the_refiner_is_set_in_yaml_for_predict_and_for_the_gallery(tmp_path, monkeypatch):
    from zoo.cli import ZooCLI
    from zoo.tasks.callbacks import MultimodalGallery

    monkeypatch.chdir(tmp_path)
    folder = tiny_refiner().save_pretrained(tmp_path / "diffusion_refiner")
    overlay = tmp_path / "refined.yaml"
    overlay.write_text(
        "model:\n  init_args:\n    sampling:\n      refiner: {source: " + str(folder) + ", steps: 2}\n"
        "trainer:\n  callbacks:\n    - class_path: zoo.tasks.callbacks.MultimodalGallery\n"
        "      init_args:\n        refiner: {source: " + str(folder) + ", steps: 1, seed: 4}\n"
    )
    cli = ZooCLI(args=["--config", str(REPO / "configs" / "quickstart.yaml"), "--config", str(overlay),
                       f"--trainer.default_root_dir={tmp_path}"], run=False)  # fmt: skip
    assert cli.model.sampling.refiner == RefinerSettings(str(folder), 2, 0)
    assert cli.model.hparams["sampling"]["refiner"]["source"] == str(folder)  # saved as plain config
    gallery = next(c for c in cli.trainer.callbacks if isinstance(c, MultimodalGallery))
    assert gallery.refinement.steps == 1 and gallery.refinement.seed == 4 and gallery.refinement.size == 64
