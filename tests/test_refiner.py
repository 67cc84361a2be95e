"""The diffusion refiner as a specification: full-resolution images from low-resolution decodes with
any of the diffusers samplers in a chosen number of steps, clear refusals of wrong inputs, weights that
round-trip, and a training task that logs PSNR against plain upsampling and checkpoints safely."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from torch.utils.data import DataLoader

from zoo.config import to_config
from zoo.hub import build_from_config
from zoo.models.refiner import DiffusionRefiner
from zoo.tasks.metrics import per_image_psnr as psnr
from zoo.tasks.refiner import (
    REFINER_FILE,
    DownsampleDegradation,
    RefinerTraining,
    TokenizerDegradation,
)
from zoo.tokenizers.visual import VisualTokenizer
from zoo.tokenizers.visual_quantizer import MultiScaleQuantizer
from zoo.weights import save_weights_file

TINY = dict(image_size=16, block_out_channels=(8, 16), attention_levels=(False, True), norm_num_groups=4)


def tiny(**overrides) -> DiffusionRefiner:
    torch.manual_seed(0)
    return DiffusionRefiner(**{**TINY, **overrides})


def squares(n: int, size: int = 16, seed: int = 0) -> torch.Tensor:
    """Images in [-1, 1] of one coloured square each on a dark background, written and read back as PNG."""
    rng = np.random.default_rng(seed)
    images = []
    for _ in range(n):
        array = np.full((size, size, 3), 20, dtype=np.uint8)
        side = int(rng.integers(3, size // 2))
        y, x = rng.integers(0, size - side, 2)
        array[y : y + side, x : x + side] = rng.integers(60, 256, 3)
        images.append(torch.from_numpy(array.copy()).permute(2, 0, 1).float() / 127.5 - 1)
    return torch.stack(images)


def png_batches(tmp_path: Path, n: int, size: int = 16, seed: int = 0, batch_size: int = 8) -> DataLoader:
    """A loader of {"pixels"} batches read from real PNG files in tmp_path."""
    folder = tmp_path / f"png{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    for i, image in enumerate(squares(n, size, seed)):
        array = ((image.permute(1, 2, 0) + 1) * 127.5).round().byte().numpy()
        Image.fromarray(array).save(folder / f"{i}.png")
    pixels = [
        torch.from_numpy(np.asarray(Image.open(p).convert("RGB")).copy()).permute(2, 0, 1).float() / 127.5 - 1
        for p in sorted(folder.glob("*.png"))
    ]
    return DataLoader([{"pixels": p} for p in pixels], batch_size=batch_size, shuffle=False)


# --- the model -------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheduler", ["ddpm", "ddim", "dpm"])
@pytest.mark.parametrize("prediction_type", ["epsilon", "sample", "v_prediction"])
def test_refine_turns_a_low_resolution_condition_into_a_full_resolution_image_with_every_sampler(
    scheduler, prediction_type
):
    refiner = tiny(scheduler=scheduler, prediction_type=prediction_type).eval()
    condition = squares(2)[:, :, ::4, ::4]
    out = refiner.refine(condition, steps=3, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 3, 16, 16) and out.dtype == torch.float32
    assert out.min() >= -1 and out.max() <= 1 and torch.isfinite(out).all()
    again = refiner.refine(condition, steps=3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again), "the same generator seed must give the same images"
    other = refiner.refine(condition, steps=3, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(out, other)
    loss = refiner.loss(squares(2), condition)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert refiner.unet.conv_in.weight.grad is not None
    assert refiner.unet.conv_in.in_channels == 6  # noisy image + upsampled condition


@pytest.mark.parametrize("steps", [1, 4])
def test_the_number_of_sampling_steps_is_the_number_of_unet_calls(steps):
    refiner = tiny(num_inference_steps=7).eval()
    calls = []
    refiner.unet.register_forward_hook(lambda *_: calls.append(1))
    refiner.refine(squares(1)[:, :, ::2, ::2], steps=steps)
    assert len(calls) == steps
    calls.clear()
    refiner.refine(squares(1)[:, :, ::2, ::2])
    assert len(calls) == 7, "steps=None uses num_inference_steps"


def test_a_residual_refiner_starts_near_the_plain_upsampled_condition():
    # With the residual target an untrained refiner adds a bounded correction, not a whole new image.
    refiner = tiny(residual=True, prediction_type="sample")
    with torch.no_grad():
        refiner.unet.conv_out.weight.zero_()
        refiner.unet.conv_out.bias.zero_()
    condition = squares(2)[:, :, ::2, ::2]
    out = refiner.refine(condition, steps=2, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(out, refiner.upsampled(condition), atol=1e-6)


def test_wrong_inputs_are_refused_with_what_was_expected():
    refiner = tiny()
    good = squares(2)
    with pytest.raises(ValueError, match=r"condition must be \[B, 3, H, W\].*\(2, 1, 4, 4\)"):
        refiner.refine(torch.zeros(2, 1, 4, 4))
    with pytest.raises(ValueError, match=r"condition must be \[B, 3, H, W\]"):
        refiner.refine(torch.zeros(3, 4, 4))
    with pytest.raises(TypeError, match="condition must be a float tensor.*uint8"):
        refiner.refine(torch.zeros(2, 3, 4, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="condition is 32x32, larger than the output image_size 16"):
        refiner.refine(torch.zeros(2, 3, 32, 32))
    with pytest.raises(ValueError, match="target must be 16x16 \\(image_size\\), got 8x8"):
        refiner.loss(torch.zeros(2, 3, 8, 8), good[:, :, ::4, ::4])
    with pytest.raises(ValueError, match="target has 2 images but condition has 1"):
        refiner.loss(good, good[:1, :, ::4, ::4])
    with pytest.raises(ValueError, match="steps=0 must be in 1..1000"):
        refiner.refine(good[:, :, ::4, ::4], steps=0)


def test_inconsistent_unet_settings_are_refused_at_construction():
    with pytest.raises(ValueError, match="image_size=18 must be a positive multiple of 4"):
        tiny(image_size=18, block_out_channels=(8, 16, 16), attention_levels=(False, False, False))
    with pytest.raises(ValueError, match="attention_levels has 1 entries but block_out_channels has 2"):
        tiny(attention_levels=(True,))
    with pytest.raises(ValueError, match="norm_num_groups=3 must divide"):
        tiny(norm_num_groups=3)
    with pytest.raises(ValueError, match="attention_head_dim=16 must divide the channels of every attention"):
        tiny(block_out_channels=(8, 8))
    with pytest.raises(ValueError, match="num_inference_steps=0"):
        tiny(num_inference_steps=0)


def test_weights_load_at_construction_and_the_saved_config_does_not_point_at_the_file(tmp_path):
    trained = tiny()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01)
    path = save_weights_file(trained, tmp_path / "refiner.safetensors")
    loaded = DiffusionRefiner(**TINY, weights=str(path))
    for (name, a), b in zip(trained.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert to_config(loaded)["init_args"]["weights"] is None
    assert to_config(loaded)["init_args"]["block_out_channels"] == [8, 16]
    with pytest.raises(FileNotFoundError, match="missing.safetensors does not exist"):
        DiffusionRefiner(**TINY, weights=str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match="cannot load"):
        DiffusionRefiner(**{**TINY, "block_out_channels": (8, 32)}, weights=str(path))


# --- degradations and metrics ----------------------------------------------------------------------


def test_downsample_degradation_averages_blocks_and_refuses_sizes_it_does_not_divide():
    degradation = DownsampleDegradation(factor=2)
    pixels = torch.arange(16.0).view(1, 1, 4, 4).expand(1, 3, 4, 4) / 16
    low = degradation(pixels)
    assert low.shape == (1, 3, 2, 2)
    assert torch.allclose(low[0, 0], torch.tensor([[2.5, 4.5], [10.5, 12.5]]) / 16)
    with pytest.raises(ValueError, match="factor 3 must divide the image size, got 4x4"):
        DownsampleDegradation(factor=3)(pixels)
    with pytest.raises(ValueError, match=r"pixels must be an image batch \[B, 3, H, W\]"):
        degradation(torch.zeros(1, 3, 2, 4, 4))
    degradation.train()
    assert not degradation.training, "a degradation is frozen in eval mode"


def tiny_tokenizer(temporal: bool = False) -> VisualTokenizer:
    torch.manual_seed(0)
    quantizer = MultiScaleQuantizer(dim=4, codebook_size=16, scales=(1, 2, 4))
    return VisualTokenizer(image_size=8, channels=(8, 8), quantizer=quantizer, temporal=temporal)


def test_tokenizer_degradation_is_the_frozen_round_trip_at_the_tokenizers_resolution():
    tokenizer = tiny_tokenizer()
    degradation = TokenizerDegradation(tokenizer)
    before = {k: v.clone() for k, v in tokenizer.state_dict().items()}
    degradation.train()  # what Lightning does to every submodule at the start of fit
    images = squares(2, size=16)
    condition = degradation(images)
    assert condition.shape == (2, 3, 8, 8), "16x16 images are decoded at the tokenizer's 8x8"
    assert condition.min() >= -1 and condition.max() <= 1
    small = torch.nn.functional.interpolate(images, size=(8, 8), mode="area")
    assert torch.equal(condition, tokenizer.decode(tokenizer.encode(small)).clamp(-1, 1))
    coarse = TokenizerDegradation(tokenizer, scales=1)(images)
    assert torch.equal(coarse, tokenizer.decode(tokenizer.encode(small)[:1]).clamp(-1, 1))
    assert not tokenizer.training and not any(p.requires_grad for p in tokenizer.parameters())
    after = tokenizer.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "the codebook must not move"
    with pytest.raises(ValueError, match="images are 4x4, smaller than the tokenizer's image_size 8"):
        degradation(images[:, :, ::4, ::4])
    with pytest.raises(ValueError, match=r"scales=4 must be in 1..3"):
        TokenizerDegradation(tokenizer, scales=4)
    with pytest.raises(ValueError, match="give a 2D VisualTokenizer"):
        TokenizerDegradation(tiny_tokenizer(temporal=True))


def test_the_tokenizer_refiner_config_builds_the_tokenizer_that_its_training_config_trains():
    # The refiner loads the weights that configs/tokenizers/visual_2d.yaml writes: same architecture, or
    # the strict load fails at the start of training.
    configs = Path(__file__).resolve().parent.parent / "configs"
    refiner = yaml.safe_load((configs / "refiner" / "tokenizer.yaml").read_text())
    trainer = yaml.safe_load((configs / "tokenizers" / "visual_2d.yaml").read_text())
    used = refiner["model"]["init_args"]["degradation"]["init_args"]["tokenizer"]
    trained = trainer["model"]["init_args"]["tokenizer"]
    root = Path(trainer["trainer"]["default_root_dir"])
    assert Path(used["init_args"]["weights"]) == root / "latest" / "visual_tokenizer.safetensors"
    built = [
        build_from_config({**spec, "init_args": {**spec["init_args"], "weights": None}})
        for spec in (used, trained)
    ]
    shapes = [{k: tuple(v.shape) for k, v in b.state_dict().items()} for b in built]
    assert shapes[0] == shapes[1], "configs/refiner/tokenizer.yaml must build the tokenizer of visual_2d.yaml"


def test_psnr_is_in_db_on_the_zero_one_scale():
    target = torch.zeros(1, 3, 4, 4)
    # An error of 0.2 in [-1, 1] is 0.1 on [0, 1]: MSE 0.01, PSNR 20 dB.
    assert psnr(target + 0.2, target).item() == pytest.approx(20.0, abs=1e-4)


# --- the task --------------------------------------------------------------------------------------


def test_training_on_tokenizer_decodes_logs_psnr_against_upsampling_and_checkpoints_safely(tmp_path):
    tokenizer = tiny_tokenizer()  # 8x8: the 16x16 images are restored from its decode of their 8x8 version
    frozen = {k: v.clone() for k, v in tokenizer.state_dict().items()}
    torch.manual_seed(0)
    task = RefinerTraining(
        tiny(prediction_type="sample", num_inference_steps=2),
        TokenizerDegradation(tokenizer),
        lr=3e-3,
        warmup_steps=2,
        num_samples=4,
    )
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=8,
        default_root_dir=tmp_path,
        logger=L.pytorch.loggers.TensorBoardLogger(tmp_path, name="logs"),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Record(), checkpoint],
        check_val_every_n_epoch=8,
    )
    trainer.fit(task, png_batches(tmp_path, 32), png_batches(tmp_path, 8, seed=1))
    assert np.mean(losses[-4:]) < 0.5 * np.mean(losses[:4])
    logged = trainer.logged_metrics
    for key in ("train/loss", "val/loss", "val/psnr_refined", "val/psnr_upsampled", "val/psnr_gain_db"):
        assert key in logged, f"{key} not logged; logged: {sorted(logged)}"
    gain = logged["val/psnr_refined"] - logged["val/psnr_upsampled"]
    assert logged["val/psnr_gain_db"].item() == pytest.approx(gain.item(), abs=1e-4)
    assert task.last_grid is not None and task.last_grid.shape == (3, 4 * 16, 3 * 16)
    assert (Path(trainer.log_dir) / "refiner_val.png").is_file()

    # The refiner alone, as weights for the next stage; and a checkpoint that never pickles objects.
    weights = tmp_path / REFINER_FILE
    assert weights.is_file()
    reloaded = DiffusionRefiner(**{**TINY, "prediction_type": "sample"}, weights=str(weights))
    assert torch.equal(reloaded.unet.conv_in.weight, task.refiner.unet.conv_in.weight)
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    raw = torch.load(ckpt, weights_only=True)
    assert raw["hyper_parameters"]["refiner"]["class_path"] == "zoo.models.refiner.DiffusionRefiner"
    restored = RefinerTraining.load_from_checkpoint(ckpt)
    assert isinstance(restored.degradation, TokenizerDegradation)
    assert torch.equal(restored.refiner.unet.conv_out.weight, task.refiner.unet.conv_out.weight)
    # The frozen tokenizer travels in the checkpoint, unchanged by training.
    for (name, a), b in zip(
        frozen.items(), restored.degradation.tokenizer.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    assert all(not p.requires_grad for p in restored.degradation.parameters())


def test_a_batch_without_images_is_refused_by_name():
    task = RefinerTraining(tiny(), DownsampleDegradation(factor=4))
    with pytest.raises(ValueError, match="batches must be dicts with 'pixels'.*\\['audio'\\]"):
        task.training_step({"audio": torch.zeros(2, 100)}, 0)
    with pytest.raises(ValueError, match="'pixels' must be images.*kind='image'"):
        task.training_step({"pixels": torch.zeros(2, 3, 5, 16, 16)}, 0)


def test_cascade_data_pairs_each_target_with_the_native_low_resolution_render_of_the_same_scene():
    from zoo.datamodules.media_data import ShapesMediaDataModule
    from zoo.datamodules.shapes_cascade import ShapesCascadeDataModule
    from zoo.world.render import render_image, to_tensor

    data = ShapesCascadeDataModule(size=24, condition_size=12, train_size=4, val_size=4, batch_size=4)
    batch = next(iter(data.val_dataloader()))
    assert batch["pixels"].shape == (4, 3, 24, 24) and batch["condition_pixels"].shape == (4, 3, 12, 12)
    plain = ShapesMediaDataModule(kind="image", size=24, train_size=1, val_size=4, batch_size=4)
    assert torch.equal(batch["pixels"], next(iter(plain.val_dataloader()))["pixels"]), "same val scenes"
    scene = data.world.scene(2, "val")
    assert torch.equal(batch["condition_pixels"][2], to_tensor(render_image(scene, 12)))
    # A native render is not the area-downsampled target (hard edges): why the cascade needs both.
    area = torch.nn.functional.interpolate(batch["pixels"], size=(12, 12), mode="area")
    assert not torch.allclose(area, batch["condition_pixels"])
    with pytest.raises(ValueError, match="condition_size=32 must be <= size=16"):
        ShapesCascadeDataModule(size=16, condition_size=32)


def test_the_degradation_sees_condition_pixels_when_the_batch_has_them(tmp_path):
    from zoo.datamodules.shapes_cascade import ShapesCascadeDataModule

    torch.manual_seed(0)  # a 12x12 tokenizer: ShapesWorld renders nothing smaller
    quantizer = MultiScaleQuantizer(dim=4, codebook_size=16, scales=(1, 3, 6))
    tokenizer = VisualTokenizer(image_size=12, channels=(8, 8), quantizer=quantizer)
    task = RefinerTraining(tiny(num_inference_steps=1), TokenizerDegradation(tokenizer), num_samples=2)
    data = ShapesCascadeDataModule(size=16, condition_size=12, train_size=2, val_size=2, batch_size=2)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
    )
    trainer.fit(task, data)
    batch = next(iter(data.val_dataloader()))
    expected = tokenizer.decode(tokenizer.encode(batch["condition_pixels"])).clamp(-1, 1)
    shown = torch.nn.functional.interpolate(expected, size=(16, 16), mode="nearest")
    left = task.last_grid[:, :, :16]  # the grid's first column: the condition, nearest-upsampled
    torch.testing.assert_close(left, ((torch.cat(list(shown), dim=-2).clamp(-1, 1) + 1) / 2))
    with pytest.raises(
        ValueError, match="'condition_pixels' must be \\[B, 3, h, w\\] images, one per target"
    ):
        task.training_step({"pixels": batch["pixels"], "condition_pixels": batch["condition_pixels"][:1]}, 0)
