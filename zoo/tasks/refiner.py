"""Training the diffusion refiner (ERNIE 5.0's cascaded image refiner; REFERENCES.md section 2.4).

The refiner learns to restore full-resolution images from a degraded version of them. What degrades
them is a swappable component: `TokenizerDegradation` is the real thing (the frozen visual tokenizer's
decode, optionally at a lower resolution and from a prefix of its scales: exactly what the unified model's
generated codes become), `DownsampleDegradation` a plain down-sampling for tests and as a baseline.
A batch may carry `condition_pixels` (the native low-resolution render of the same scene, from
`zoo.datamodules.shapes_cascade.ShapesCascadeDataModule`): the degradation then sees those instead of the
full-resolution target.
Validation and test (`val/...`, `test/...`) report PSNR and SSIM (torchmetrics, zoo/tasks/metrics.py) of the
refined images beside the PSNR of the plainly upsampled condition and the gain; validation also writes a
comparison grid (condition | refined | target) to the logger and as a PNG beside the logs.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import ClassVar, Literal

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn
from torchmetrics import MeanMetric

from zoo.config import Configurable, save_config_hyperparameters
from zoo.models.refiner import DiffusionRefiner
from zoo.parallel import Parallelism
from zoo.tasks.component_folders import write_component_folder
from zoo.tasks.metrics import ImageSSIM, per_image_psnr, split_metrics
from zoo.tasks.optim import (
    LRSchedulerCallable,
    OptimizerCallable,
    build_optimizer,
    lightning_optimizers,
    refuse_replaced_arguments,
)
from zoo.tasks.sharding import ShardedStage, ShardingPlan, plain_component, with_parameters
from zoo.tokenizers.visual import VisualTokenizer
from zoo.weights import save_weights_file

warnings.filterwarnings("ignore", message="Attribute 'refiner' is an instance of `nn.Module`")
warnings.filterwarnings("ignore", message="Attribute 'degradation' is an instance of `nn.Module`")

REFINER_FILE = "diffusion_refiner.safetensors"


# --- what the refiner learns to undo -----------------------------------------------------------------


class Degradation(nn.Module):
    """Base of the condition sources: `forward(pixels [B, 3, H, W]) -> condition [B, 3, h, w]`, h, w <= H.

    Degradations are frozen: they have no trainable parameters and always run in eval mode without
    gradients, so that the refiner's optimiser and the training mode never reach them.
    """

    def train(self, mode: bool = True) -> Degradation:
        return super().train(False)

    def _check(self, pixels: Tensor) -> None:
        if not isinstance(pixels, Tensor) or not pixels.is_floating_point():
            kind = pixels.dtype if isinstance(pixels, Tensor) else type(pixels).__name__
            raise TypeError(f"{type(self).__name__}: pixels must be a float tensor in [-1, 1], got {kind}")
        if pixels.dim() != 4 or pixels.shape[1] != 3:
            raise ValueError(
                f"{type(self).__name__}: pixels must be an image batch [B, 3, H, W], "
                f"got {tuple(pixels.shape)}"
            )


class DownsampleDegradation(Configurable, Degradation):
    """Plain down-sampling by an integer factor: the baseline condition, and a tokenizer-free stand-in.

    Args:
        factor: the condition is `H / factor` x `W / factor`; must divide the image side.
        mode: "area" averages each factor x factor block; "nearest" and "bilinear" resample.
    """

    def __init__(self, factor: int = 4, mode: Literal["area", "nearest", "bilinear"] = "area") -> None:
        super().__init__()
        if factor < 1:
            raise ValueError(f"DownsampleDegradation: factor must be >= 1, got {factor}")
        self.factor, self.mode = factor, mode

    @torch.no_grad()
    def forward(self, pixels: Tensor) -> Tensor:
        self._check(pixels)
        h, w = pixels.shape[-2:]
        if h % self.factor or w % self.factor:
            raise ValueError(
                f"DownsampleDegradation: factor {self.factor} must divide the image size, got {h}x{w}"
            )
        if self.factor == 1:
            return pixels
        size = (h // self.factor, w // self.factor)
        kwargs = {"align_corners": False, "antialias": True} if self.mode == "bilinear" else {}
        return F.interpolate(pixels, size=size, mode=self.mode, **kwargs)


class TokenizerDegradation(Configurable, Degradation):
    """The frozen visual tokenizer's round trip, `decode(encode(x))`: what generated codes look like.

    Images larger than the tokenizer's `image_size` are area-downsampled to it first, so a refiner at
    full resolution learns to upsample the tokenizer's low-resolution decode (ERNIE 5.0's cascade); with
    `scales` the decode uses only the first scales, i.e. a coarser image (as when generation stops early).

    Args:
        tokenizer: a trained 2D `VisualTokenizer` (give its `weights`); frozen, always in eval mode so
            that its codebook EMA never updates.
        scales: decode from the first `scales` scales (None: all of them).
    """

    def __init__(self, tokenizer: VisualTokenizer, scales: int | None = None) -> None:
        super().__init__()
        if tokenizer.temporal:
            raise ValueError("TokenizerDegradation: the refiner works on images; give a 2D VisualTokenizer")
        if scales is not None and not 1 <= scales <= len(tokenizer.scales):
            raise ValueError(
                f"TokenizerDegradation: scales={scales} must be in 1..{len(tokenizer.scales)} "
                f"(the tokenizer's scales are {tokenizer.scales})"
            )
        self.tokenizer = tokenizer.requires_grad_(False).eval()
        self.scales = scales

    @torch.no_grad()
    def forward(self, pixels: Tensor) -> Tensor:
        self._check(pixels)
        size = self.tokenizer.image_size
        h, w = pixels.shape[-2:]
        if h < size or w < size:
            raise ValueError(
                f"TokenizerDegradation: images are {h}x{w}, smaller than the tokenizer's image_size {size}"
            )
        if (h, w) != (size, size):
            pixels = F.interpolate(pixels, size=(size, size), mode="area")
        codes = self.tokenizer.encode(pixels)
        if self.scales is not None:
            codes = codes[: self.scales]
        return self.tokenizer.decode(codes).clamp(-1, 1)


def comparison_grid(condition: Tensor, *images: Tensor) -> Tensor:
    """One row per image: the condition (nearest-upsampled, so its pixels show) | each of `images`
    (e.g. refined | target), all [B, 3, H, W] in [-1, 1].

    Returns [3, B * H, (1 + len(images)) * W] in [0, 1] (TensorBoard's `add_image` layout).
    """
    size = images[0].shape[-2:]
    shown = F.interpolate(condition.float(), size=size, mode="nearest")
    rows = torch.cat([shown, *(x.float() for x in images)], dim=-1)  # [B, 3, H, k W]
    grid = torch.cat(list(rows), dim=-2)  # [3, B H, k W]
    return ((grid.clamp(-1, 1) + 1) / 2).cpu()


def save_grid_png(grid: Tensor, path: str | Path, scale: int = 2) -> Path:
    """Write a [3, H, W] image in [0, 1] as PNG, each pixel a `scale` x `scale` block (small images)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    array = (grid.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    image = Image.fromarray(array)
    if scale > 1:
        image = image.resize((array.shape[1] * scale, array.shape[0] * scale), Image.NEAREST)
    image.save(path)
    return path


class RefinerTraining(ShardedStage, L.LightningModule):
    """Trains a `DiffusionRefiner` to undo a `Degradation` of the batch's images (`batch["pixels"]`).

    Args:
        refiner: the diffusion refiner being trained.
        degradation: what produces its condition from the clean images (frozen).
        lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warm-up, then cosine decay to `min_lr_ratio * lr`.
        min_lr_ratio: the final learning rate as a fraction of `lr`.
        val_steps: sampling steps of the validation refinements (None: the refiner's default).
        psnr_batches: validation (and test) batches that are refined for PSNR and SSIM (sampling costs
            `val_steps` UNet calls).
        num_samples: images in the validation comparison grid.
        seed: seeds the validation noise, so that validations are comparable.
        optimizer: builds the optimizer from the refiner's parameters (one group, decayed by
            `weight_decay`); None: AdamW with `lr` (zoo/tasks/optim.py).
        lr_scheduler: builds the schedule from the optimizer, stepped every step; None: warm-up-cosine with
            `warmup_steps` and `min_lr_ratio`.
        parallel: FSDP2, FP8, activation checkpointing and compile, applied in `configure_model` along
            `sharding_plan` (zoo.tasks.sharding).
    """

    # Built on `meta` under parallel.fsdp (zoo.meta_init): its construction replays bit for bit
    # (tests/test_sharding_plans.py).
    meta_init_with_fsdp: ClassVar[bool] = True

    def __init__(
        self,
        refiner: DiffusionRefiner,
        degradation: Degradation,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 50,
        min_lr_ratio: float = 0.1,
        val_steps: int | None = None,
        psnr_batches: int = 1,
        num_samples: int = 8,
        seed: int = 0,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        parallel: Parallelism = Parallelism(),
    ) -> None:
        super().__init__()
        save_config_hyperparameters(self)  # configs, never pickled modules (zoo.config)
        self.parallel = parallel
        refuse_replaced_arguments(RefinerTraining, "optimizer", optimizer, {"lr": lr})
        schedule = {"warmup_steps": warmup_steps, "min_lr_ratio": min_lr_ratio}
        refuse_replaced_arguments(RefinerTraining, "lr_scheduler", lr_scheduler, schedule)
        self.optimizer_callable, self.lr_scheduler_callable = optimizer, lr_scheduler
        self.refiner = refiner
        self.degradation = degradation.requires_grad_(False)
        self.lr, self.weight_decay = lr, weight_decay
        self.warmup_steps, self.min_lr_ratio = warmup_steps, min_lr_ratio
        self.val_steps, self.psnr_batches = val_steps, psnr_batches
        self.num_samples, self.seed = num_samples, seed
        self.last_grid: Tensor | None = None
        self.eval_metrics = split_metrics(["psnr_refined", "psnr_upsampled", "psnr_gain_db"], MeanMetric)
        ssim = lambda: ImageSSIM(refiner.image_size)
        self.eval_metrics.update(split_metrics(["ssim_refined"], ssim))

    def sharding_plan(self) -> ShardingPlan:
        """The UNet's blocks are its down, mid and up blocks (resnets, attention, resamplers); the UNet itself
        is the group of the rest (input conv, timestep embedding, output norm and conv). FP8 takes the linears
        of the timestep embedding, the resnets' time projections and the attention projections (dims multiples
        of 16); convolutions stay as they are. The degradation (a frozen tokenizer, or none) is replicated."""
        unet = self.refiner.unet
        blocks = [*unet.down_blocks, unet.mid_block, *unet.up_blocks]
        return ShardingPlan(
            blocks=with_parameters(m for m in blocks if m is not None),
            groups=with_parameters([unet]),
            frozen=(self.degradation,),
        )

    def _pixels(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """(target images, what the degradation sees: `batch["condition_pixels"]` when given, else the
        targets themselves)."""
        if not isinstance(batch, dict) or "pixels" not in batch:
            keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
            raise ValueError(f"RefinerTraining: batches must be dicts with 'pixels' [B, 3, H, W], got {keys}")
        pixels = batch["pixels"]
        if pixels.dim() != 4:
            raise ValueError(
                f"RefinerTraining: 'pixels' must be images [B, 3, H, W], got {tuple(pixels.shape)} "
                "(the refiner works on images; use ShapesMediaDataModule(kind='image'))"
            )
        source = batch.get("condition_pixels", pixels)
        if source.dim() != 4 or source.shape[0] != pixels.shape[0]:
            raise ValueError(
                f"RefinerTraining: 'condition_pixels' must be [B, 3, h, w] images, one per target, got "
                f"{tuple(source.shape)} for targets {tuple(pixels.shape)}"
            )
        return pixels, source

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        pixels, source = self._pixels(batch)
        loss = self.refiner.loss(pixels, self.degradation(source))
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"non-finite refiner loss ({loss.item()}) at global step {self.global_step}; "
                "training stopped before updating the weights"
            )
        self.log("train/loss", loss.detach(), on_step=True, prog_bar=True, batch_size=pixels.shape[0])
        return loss

    def _evaluate(self, batch: dict[str, Tensor], batch_idx: int, split: str) -> Tensor:
        pixels, source = self._pixels(batch)
        condition = self.degradation(source)
        generator = torch.Generator().manual_seed(self.seed + batch_idx)
        loss = self.refiner.loss(pixels, condition, generator=generator)
        b = pixels.shape[0]
        self.log(f"{split}/loss", loss, on_epoch=True, batch_size=b, sync_dist=True)
        if batch_idx < self.psnr_batches:
            refined = self.refiner.refine(condition, self.val_steps, generator=generator)
            upsampled = self.refiner.upsampled(condition)
            gained, baseline = per_image_psnr(refined, pixels), per_image_psnr(upsampled, pixels)
            # Means over every refined image of the split, on every rank; the gain is the mean per-image gain,
            # which equals the difference of the two means.
            for name, values in (("psnr_refined", gained), ("psnr_upsampled", baseline),
                                 ("psnr_gain_db", gained - baseline)):  # fmt: skip
                metric = self.eval_metrics[f"{split}__{name}"]
                metric.update(values)
                self.log(f"{split}/{name}", metric, on_epoch=True, batch_size=b)
            ssim = self.eval_metrics[f"{split}__ssim_refined"]
            ssim.update(refined, pixels)
            self.log(f"{split}/ssim_refined", ssim, on_epoch=True, batch_size=b)
            if batch_idx == 0 and split == "val":
                n = self.num_samples
                self.last_grid = comparison_grid(condition[:n], refined[:n], pixels[:n])
                self._write_grid(self.last_grid)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self._evaluate(batch, batch_idx, "val")
        b = batch["pixels"].shape[0]
        self.log("val_loss", loss, prog_bar=True, logger=False, batch_size=b, sync_dist=True)
        return loss

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._evaluate(batch, batch_idx, "test")

    def _write_grid(self, grid: Tensor) -> None:
        if self._trainer is None or self.trainer.sanity_checking or not self.trainer.is_global_zero:
            return
        experiment = getattr(self.logger, "experiment", None)
        if hasattr(experiment, "add_image"):
            experiment.add_image("val/condition|refined|target", grid, self.global_step)
        folder = Path(self.trainer.log_dir or self.trainer.default_root_dir)
        save_grid_png(grid, folder / "refiner_val.png")

    def on_fit_end(self) -> None:
        """Write the refiner alone as `<default_root_dir>/diffusion_refiner.safetensors` (its `weights`)."""
        refiner = plain_component(self.refiner)  # gathers FSDP2 shards: every rank calls
        if self.trainer.is_global_zero:
            weights = save_weights_file(refiner, Path(self.trainer.default_root_dir) / REFINER_FILE)
            write_component_folder(self.trainer, refiner, weights)

    def configure_optimizers(self):  # noqa: ANN201 (Lightning's union of return types)
        groups = [{"params": list(self.refiner.parameters()), "weight_decay": self.weight_decay}]
        adamw = lambda g: torch.optim.AdamW(g, lr=self.lr)
        optimizer = build_optimizer(groups, self.optimizer_callable, adamw, type(self).__name__)
        total = lambda: self.trainer.estimated_stepping_batches  # lazily: Lightning#20550, see schedules.py
        schedule = self.lr_scheduler_callable
        return lightning_optimizers(optimizer, schedule, self.warmup_steps, total, self.min_lr_ratio)
