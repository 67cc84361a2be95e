"""Training the visual tokenizer (ERNIE 5.0 tokenizer stage; VAR's VQVAE recipe, MAGVIT-v2 for video).

Loss = reconstruction (L1 + L2) + vq_weight * VAR's multi-scale VQ loss (commitment + phi), plus two
optional, swappable terms, each a component chosen by `class_path` in YAML (null turns it off):

- `PerceptualLoss`: distances between features of a FROZEN, randomly initialised conv net (no download;
  random conv features are a usable LPIPS stand-in at this scale, and nothing pretrained is assumed).
- `AdversarialLoss`: a PatchGAN discriminator with the hinge loss (VQGAN), switched on after
  `start_step` so the autoencoder first learns to reconstruct. Generator and discriminator train in one
  optimiser step: the generator's term sees the discriminator through detached parameters, so it cannot
  move them, and the discriminator's term sees detached reconstructions.

Videos are handled frame by frame by both optional terms. Validation and test (`zoo validate`, `zoo test`:
`val/...`, `test/...`) log PSNR per number of scales decoded and SSIM (torchmetrics, zoo/tasks/metrics.py),
codebook usage and perplexity per scale, and rFID and LPIPS when their weights are given; validation also
logs a grid of originals over reconstructions from 1..K scales (TensorBoard `add_image`). At the end of fit
the tokenizer is written to `<default_root_dir>/visual_tokenizer.safetensors`; a 3D tokenizer can start from
a 2D one by inflation (`init_from_2d`, read at the start of fit).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import ClassVar

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from zoo.config import Configurable, save_config_hyperparameters
from zoo.parallel import Parallelism
from zoo.tasks.component_folders import write_component_folder
from zoo.tasks.metrics import (
    ImagePSNR,
    ImageSSIM,
    lpips_metric,
    per_image_psnr,
    rfid_metric,
    split_metrics,
    update_rfid,
)
from zoo.tasks.optim import (
    LRSchedulerCallable,
    OptimizerCallable,
    build_optimizer,
    decay_groups,
    lightning_optimizers,
    refuse_replaced_arguments,
)
from zoo.tasks.sharding import ShardedStage, ShardingPlan, plain_component, with_parameters
from zoo.tokenizers.visual import VisualTokenizer, per_frame
from zoo.tokenizers.visual_quantizer import MultiScaleQuantizer, usage_statistics
from zoo.weights import save_weights_file

warnings.filterwarnings("ignore", message="Attribute '(tokenizer|reconstruction|perceptual|adversarial)'")

WEIGHTS_NAME = "visual_tokenizer.safetensors"


def first_frames(pixels: Tensor) -> Tensor:
    """Images [B, 3, H, W] as they are; of clips [B, 3, T, H, W], the first frame of each."""
    return pixels[:, :, 0] if pixels.dim() == 5 else pixels


class ReconstructionLoss(Configurable, nn.Module):
    """Pixel loss l1 * |x - y| + l2 * |x - y|^2 (means over all pixels).

    Args:
        l1: weight of the mean absolute error.
        l2: weight of the mean squared error (what PSNR measures).
    """

    def __init__(self, l1: float = 1.0, l2: float = 1.0) -> None:
        super().__init__()
        self.l1, self.l2 = l1, l2

    def forward(self, reconstruction: Tensor, target: Tensor) -> Tensor:
        diff = reconstruction - target
        return self.l1 * diff.abs().mean() + self.l2 * diff.pow(2).mean()


class PerceptualLoss(Configurable, nn.Module):
    """Feature distance under a frozen random conv net (an LPIPS-like term that needs no download).

    Args:
        weight: multiplier of the loss.
        channels: widths of the conv stages (each stride 2 after the first), features taken after each.
        seed: seed of the random, frozen weights (part of the config, so the loss is reproducible).
    """

    def __init__(self, weight: float = 0.1, channels: tuple[int, ...] = (32, 64, 64), seed: int = 0) -> None:
        super().__init__()
        self.weight, self.channels, self.seed = weight, tuple(channels), seed
        generator = torch.Generator().manual_seed(seed)
        layers, cin = [], 3
        for i, c in enumerate(self.channels):
            conv = nn.Conv2d(cin, c, 3, stride=1 if i == 0 else 2, padding=1)
            with torch.no_grad():
                conv.weight.normal_(0, math.sqrt(2 / (cin * 9)), generator=generator)
                conv.bias.zero_()
            layers.append(conv)
            cin = c
        self.stages = nn.ModuleList(layers)
        self.requires_grad_(False)

    def features(self, x: Tensor) -> list[Tensor]:
        feats = []
        for conv in self.stages:
            x = F.relu(conv(x))
            feats.append(x / (x.pow(2).mean(1, keepdim=True).sqrt() + 1e-6))  # unit scale per position
        return feats

    def forward(self, reconstruction: Tensor, target: Tensor) -> Tensor:
        def one(x: Tensor, y: Tensor) -> Tensor:
            return sum(F.mse_loss(a, b) for a, b in zip(self.features(x), self.features(y), strict=True))

        if reconstruction.dim() == 5:
            reconstruction, target = (v.transpose(1, 2).flatten(0, 1) for v in (reconstruction, target))
        return self.weight * one(reconstruction, target)


class PatchDiscriminator(Configurable, nn.Module):
    """PatchGAN discriminator (pix2pix / VQGAN): strided convs to a map of real/fake logits.

    Args:
        channels: widths of the conv stages; every stage but the last halves the resolution.
    """

    def __init__(self, channels: tuple[int, ...] = (32, 64, 128)) -> None:
        super().__init__()
        self.channels = tuple(channels)
        layers: list[nn.Module] = []
        cin = 3
        for i, c in enumerate(self.channels):
            stride = 2 if i + 1 < len(self.channels) else 1
            layers += [nn.Conv2d(cin, c, 4, stride=stride, padding=1)]
            if i > 0:
                layers.append(nn.GroupNorm(min(8, c), c))
            layers.append(nn.LeakyReLU(0.2))
            cin = c
        layers.append(nn.Conv2d(cin, 1, 4, stride=1, padding=1))
        self.net = nn.Sequential(*layers)

    def forward(self, pixels: Tensor) -> Tensor:
        return per_frame(self.net, pixels)


class AdversarialLoss(Configurable, nn.Module):
    """Hinge GAN loss with a patch discriminator, active from `start_step` on.

    Args:
        discriminator: the discriminator network.
        weight: multiplier of the generator's term.
        start_step: global step from which both terms are used.
        lr: learning rate of the discriminator (its own parameter group, whatever the optimizer).
    """

    def __init__(
        self,
        discriminator: PatchDiscriminator | None = None,
        weight: float = 0.1,
        start_step: int = 500,
        lr: float = 1e-4,
    ) -> None:
        super().__init__()
        self.discriminator = discriminator if discriminator is not None else PatchDiscriminator()
        self.weight, self.start_step, self.lr = weight, start_step, lr

    def generator_loss(self, reconstruction: Tensor) -> Tensor:
        # The discriminator's parameters enter detached: this term must not train them.
        params = {k: v.detach() for k, v in self.discriminator.named_parameters()}
        logits = functional_call(self.discriminator, params, (reconstruction,))
        return -self.weight * logits.mean()

    def discriminator_loss(self, reconstruction: Tensor, target: Tensor) -> Tensor:
        real = self.discriminator(target)
        fake = self.discriminator(reconstruction.detach())
        return F.relu(1 - real).mean() + F.relu(1 + fake).mean()


class VisualTokenizerTraining(ShardedStage, L.LightningModule):
    """Trains a `VisualTokenizer` on batches {"pixels": [B, 3, H, W] or [B, 3, T, H, W]}.

    Args:
        tokenizer: the 2D or causal 3D tokenizer.
        reconstruction: pixel loss (None: L1 + L2, weight 1 each).
        vq_weight: weight of the quantiser's VQ loss.
        perceptual: optional frozen-feature loss (None: off).
        adversarial: optional hinge GAN loss (None: off).
        lr: peak AdamW learning rate of the tokenizer.
        betas: AdamW betas.
        weight_decay: decoupled weight decay of conv kernels.
        warmup_steps: linear warm-up, then cosine decay to `min_lr_ratio * lr`.
        min_lr_ratio: the final learning rate as a fraction of `lr`.
        init_from_2d: a 2D tokenizer's .safetensors (same channels and quantiser) to inflate into this 3D
            tokenizer when fit starts (not at construction, so configs parse without the file).
        image_log_every_n_epochs: how often the validation image grid is logged (0: never).
        rfid_weights: a local copy of the FID Inception weights (`pt_inception-2015-12-05-6726825d.pth`):
            validation and test then log `rfid` of the (first frames of the) reconstructions. None (default):
            no rFID; nothing is ever downloaded.
        lpips_torch_home: a torch hub folder already holding torchvision's AlexNet weights
            (`hub/checkpoints/alexnet-owt-7be5be79.pth`): validation and test then log `lpips` (torchmetrics'
            LPIPS) of the (first frames of the) reconstructions. None (default): no LPIPS.
        optimizer: builds the optimizer from the parameter groups (decayed kernels, undecayed vectors, the
            discriminator at its own lr); None: AdamW with `lr` and `betas` (zoo/tasks/optim.py).
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
        tokenizer: VisualTokenizer,
        reconstruction: ReconstructionLoss | None = None,
        vq_weight: float = 1.0,
        perceptual: PerceptualLoss | None = None,
        adversarial: AdversarialLoss | None = None,
        lr: float = 2e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.0,
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.05,
        init_from_2d: str | None = None,
        image_log_every_n_epochs: int = 1,
        rfid_weights: str | None = None,
        lpips_torch_home: str | None = None,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        parallel: Parallelism = Parallelism(),
    ) -> None:
        super().__init__()
        save_config_hyperparameters(self)  # configs, never pickled modules (zoo.config)
        self.parallel = parallel
        cls = VisualTokenizerTraining
        refuse_replaced_arguments(cls, "optimizer", optimizer, {"lr": lr, "betas": betas})
        schedule = {"warmup_steps": warmup_steps, "min_lr_ratio": min_lr_ratio}
        refuse_replaced_arguments(cls, "lr_scheduler", lr_scheduler, schedule)
        self.optimizer_callable, self.lr_scheduler_callable = optimizer, lr_scheduler
        self.tokenizer = tokenizer
        self.reconstruction = reconstruction if reconstruction is not None else ReconstructionLoss()
        self.perceptual = perceptual
        self.adversarial = adversarial
        self.vq_weight, self.lr, self.betas = vq_weight, lr, tuple(betas)
        self.weight_decay, self.warmup_steps, self.min_lr_ratio = weight_decay, warmup_steps, min_lr_ratio
        self.init_from_2d = init_from_2d
        self.image_log_every_n_epochs = image_log_every_n_epochs
        self._val_codes: list[list[Tensor]] = []
        self._val_images: Tensor | None = None
        names = ["psnr", *(f"psnr_scales_{m}" for m in range(1, len(tokenizer.scales) + 1))]
        self.eval_metrics = split_metrics(names, ImagePSNR)
        self.eval_metrics.update(split_metrics(["ssim"], lambda: ImageSSIM(tokenizer.image_size)))
        # Off by default: the Inception weights are never downloaded (zoo/tasks/metrics.py).
        # Plain attributes, not submodules: the metrics' pretrained networks stay out of the checkpoint (a
        # run with the metric and one without save the same state); they follow the task's device on use.
        object.__setattr__(self, "rfid", None if rfid_weights is None else rfid_metric(rfid_weights))
        lpips = None if lpips_torch_home is None else lpips_metric(lpips_torch_home)
        object.__setattr__(self, "lpips", lpips)

    def sharding_plan(self) -> ShardingPlan:
        """A conv tokenizer's blocks are the layers of its encoder and decoder (residual blocks, strided and
        upsampling convs, the stem, the output conv and norm): each sharded on its own. The temporal down- and
        upsamplers, each quantiser phi and the discriminator are groups; the perceptual network is frozen
        (replicated). No linear layer: FP8 changes nothing here."""
        tok = self.tokenizer
        groups = [tok.encoder, tok.decoder, tok.time_down, tok.time_up, *tok.quantizer.phis]
        if self.adversarial is not None:
            groups.append(self.adversarial.discriminator)
        frozen = (self.perceptual,) if self.perceptual is not None else ()
        blocks = with_parameters([*tok.encoder, *tok.decoder])
        return ShardingPlan(blocks=blocks, groups=with_parameters(groups), frozen=frozen)

    # --- setup ---------------------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        if stage != "fit" or self.init_from_2d is None:
            return
        if not self.tokenizer.temporal:
            raise ValueError(
                "init_from_2d inflates a 2D tokenizer into a 3D one, but `tokenizer` is 2D "
                "(set temporal: true)"
            )
        path = Path(self.init_from_2d)
        tok = self.tokenizer
        twin = VisualTokenizer(
            image_size=tok.image_size,
            channels=tok.channels,
            num_res_blocks=tok.init_args["num_res_blocks"],
            quantizer=MultiScaleQuantizer(**tok.quantizer.init_args),
            weights=str(path),
        )
        tok.inflate(twin)

    # --- losses --------------------------------------------------------------------------------------

    def _pixels(self, batch: dict[str, Tensor]) -> Tensor:
        if not isinstance(batch, dict) or "pixels" not in batch:
            got = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
            raise ValueError(
                f"batches must be dicts with 'pixels' (ShapesMediaDataModule kind image/video); got {got}"
            )
        return batch["pixels"]

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        pixels = self._pixels(batch)
        rec, _, vq_loss = self.tokenizer(pixels)
        logs = {"train/reconstruction": self.reconstruction(rec, pixels), "train/vq": vq_loss}
        loss = logs["train/reconstruction"] + self.vq_weight * vq_loss
        if self.perceptual is not None:
            logs["train/perceptual"] = self.perceptual(rec, pixels)
            loss = loss + logs["train/perceptual"]
        if self.adversarial is not None and self.global_step >= self.adversarial.start_step:
            logs["train/generator_adv"] = self.adversarial.generator_loss(rec)
            logs["train/discriminator"] = self.adversarial.discriminator_loss(rec, pixels)
            loss = loss + logs["train/generator_adv"] + logs["train/discriminator"]
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"non-finite tokenizer loss ({loss.item()}) at global step {self.global_step}; "
                "training stopped before updating the weights"
            )
        logs["train/psnr"] = per_image_psnr(rec.detach(), pixels).mean()
        self.log_dict({k: v.detach() for k, v in logs.items()}, on_step=True, batch_size=pixels.shape[0])
        self.log("loss", loss.detach(), prog_bar=True, logger=False, batch_size=pixels.shape[0])
        return loss

    # --- validation and test: PSNR per scales decoded, SSIM, codebook usage, images ------------------

    def _evaluate(self, batch: dict[str, Tensor], batch_idx: int, split: str) -> None:
        pixels = self._pixels(batch)
        tok = self.tokenizer
        codes = tok.encode(pixels)
        b = pixels.shape[0]
        decodes = []
        for m in range(1, len(tok.scales) + 1):
            rec = tok.decode(codes[:m])
            metric = self.eval_metrics[f"{split}__psnr_scales_{m}"]
            metric.update(rec, pixels)
            self.log(f"{split}/psnr_scales_{m}", metric, batch_size=b)
            decodes.append(rec)
        full = self.eval_metrics[f"{split}__psnr"]
        full.update(decodes[-1], pixels)
        self.log(f"{split}/psnr", full, prog_bar=True, batch_size=b)
        ssim = self.eval_metrics[f"{split}__ssim"]
        ssim.update(decodes[-1], pixels)
        self.log(f"{split}/ssim", ssim, batch_size=b)
        if self.rfid is not None:
            update_rfid(self.rfid.to(self.device), first_frames(decodes[-1]), first_frames(pixels))
        if self.lpips is not None:
            self.lpips.to(self.device).update(first_frames(decodes[-1]).clamp(-1, 1), first_frames(pixels))
        self._val_codes.append([c.cpu() for c in codes])
        if batch_idx == 0 and split == "val":
            n = min(8, b)
            shown = [first_frames(v)[:n] for v in (pixels, *decodes)]
            self._val_images = torch.cat(shown).cpu()

    def on_validation_epoch_start(self) -> None:
        self._val_codes, self._val_images = [], None

    def on_test_epoch_start(self) -> None:
        self._val_codes, self._val_images = [], None

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, "val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, "test")

    def on_validation_epoch_end(self) -> None:
        self._log_codebook("val")
        self._log_images()

    def on_test_epoch_end(self) -> None:
        self._log_codebook("test")

    def _log_codebook(self, split: str) -> None:
        for name in ("rfid", "lpips"):
            metric = getattr(self, name)
            if metric is not None:
                self.log(f"{split}/{name}", metric.compute())  # torchmetrics syncs the ranks' states first
                metric.reset()
        if not self._val_codes:
            return
        size = self.tokenizer.codebook_size
        per_scale = [torch.cat(c) for c in zip(*self._val_codes, strict=True)]
        for k, codes in enumerate(per_scale):
            usage, perplexity = usage_statistics(codes, size)
            self.log(f"{split}/codebook_usage_scale_{k + 1}", usage)
            self.log(f"{split}/perplexity_scale_{k + 1}", perplexity)
        usage, perplexity = usage_statistics(torch.cat([c.flatten() for c in per_scale]), size)
        self.log(f"{split}/codebook_usage", usage, prog_bar=True)
        self.log(f"{split}/perplexity", perplexity)

    def _log_images(self) -> None:
        every = self.image_log_every_n_epochs
        experiment = getattr(self.logger, "experiment", None) if self._trainer is not None else None
        if self._val_images is None or not every or self.current_epoch % every or experiment is None:
            return
        if not hasattr(experiment, "add_image"):
            return
        import torchvision.utils

        rows = len(self.tokenizer.scales) + 1
        n = self._val_images.shape[0] // rows
        grid = torchvision.utils.make_grid(
            (self._val_images.clamp(-1, 1) + 1) / 2, nrow=n, padding=1, pad_value=0.5
        )
        experiment.add_image("val/originals_then_1_to_K_scales", grid, self.global_step)

    # --- optimiser, output -----------------------------------------------------------------------------

    def configure_optimizers(self):  # noqa: ANN201 (Lightning's union of return types)
        groups = decay_groups(self.tokenizer.parameters(), self.weight_decay)
        if self.adversarial is not None:
            groups.append(
                {
                    "params": list(self.adversarial.parameters()),
                    "weight_decay": 0.0,
                    "lr": self.adversarial.lr,
                }
            )
        adamw = lambda g: torch.optim.AdamW(g, lr=self.lr, betas=self.betas)
        optimizer = build_optimizer(groups, self.optimizer_callable, adamw, type(self).__name__)
        total = lambda: self.trainer.estimated_stepping_batches  # lazily: Lightning#20550, see schedules.py
        schedule = self.lr_scheduler_callable
        return lightning_optimizers(optimizer, schedule, self.warmup_steps, total, self.min_lr_ratio)

    def on_fit_end(self) -> None:
        tokenizer = plain_component(self.tokenizer)  # gathers FSDP2 shards: every rank calls
        if self.trainer.is_global_zero:
            weights = save_weights_file(tokenizer, Path(self.trainer.default_root_dir) / WEIGHTS_NAME)
            write_component_folder(self.trainer, tokenizer, weights)
