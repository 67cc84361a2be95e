"""Diffusion refiner: restores full-resolution detail in the visual tokenizer's decoded images.

ERNIE 5.0 generates images as discrete multi-scale codes; the tokenizer's decode of those codes is
smooth and often lower-resolution than the target. A small conditional diffusion model, trained after
the tokenizer, turns that decode into a sharp full-resolution image (the cascaded-refiner design of
SR3, HART's residual diffusion and GLM-Image's diffusion decoder; REFERENCES.md section 2.4).

Built on diffusers: a `UNet2DModel` whose input is the noisy image concatenated with the condition
(the decode, upsampled to full resolution: 6 input channels), trained with `DDPMScheduler.add_noise`,
sampled with DDPM, DDIM or DPM-Solver++ in a configurable number of steps. With `residual=True` the
diffusion runs on `target - upsample(condition)`, so an untrained or under-trained refiner degrades
gracefully towards the plain upsampled decode instead of towards noise.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler, UNet2DModel
from torch import Tensor, nn

from zoo.publishing.component import PretrainedComponent
from zoo.weights import load_weights_file

SchedulerName = Literal["ddpm", "ddim", "dpm"]
Prediction = Literal["epsilon", "sample", "v_prediction"]
_SAMPLERS = {"ddpm": DDPMScheduler, "ddim": DDIMScheduler, "dpm": DPMSolverMultistepScheduler}


class DiffusionRefiner(PretrainedComponent, nn.Module):
    """A conditional pixel-space diffusion model: low-resolution decode in, full-resolution image out.

    Args:
        image_size: side of the (square) full-resolution images, a multiple of
            `2 ** (len(block_out_channels) - 1)`.
        block_out_channels: UNet channels per resolution level (one level per entry).
        attention_levels: per level, whether its blocks carry self-attention (same length as
            `block_out_channels`); attention is cheap only at the coarse levels.
        layers_per_block: ResNet layers per UNet block.
        norm_num_groups: GroupNorm groups; must divide every entry of `block_out_channels`.
        attention_head_dim: channels per attention head.
        num_train_timesteps: length of the training noise schedule.
        beta_schedule: the noise schedule ("squaredcos_cap_v2" is the cosine schedule of improved DDPM).
        prediction_type: what the UNet predicts: the noise ("epsilon"), the clean sample ("sample") or
            the velocity ("v_prediction").
        scheduler: the sampler of `refine`: "ddpm" (ancestral), "ddim" (deterministic with eta 0) or
            "dpm" (DPM-Solver++ multistep).
        num_inference_steps: default number of sampling steps of `refine`.
        eta: DDIM's noise weight (0: deterministic); ignored by the other samplers.
        residual: diffuse `target - upsample(condition)` instead of the target itself.
        upsample: interpolation used to bring the condition to full resolution.
        condition_size: side of the condition the refiner is trained on and refines (e.g. the visual
            tokenizer's image size); `loss` and `refine` refuse another. None: any side up to `image_size`.
        weights: a `.safetensors` file (or a folder with `model.safetensors`) to load after building;
            construction-only (saved configs record None).
    """

    hub_title = "Diffusion refiner"
    hub_tags = ("diffusion", "super-resolution", "refiner")
    hub_usage = "image = model.refine(decoded)  # a tokenizer's decode [B, 3, h, w] in [-1, 1] -> full size"
    hub_pipeline_tag = "image-to-image"

    def card_facts(self) -> list[str]:
        return [
            f"- output {self.image_size} x {self.image_size}; sampler {self.scheduler}, "
            f"{self.init_args['num_inference_steps']} steps; residual {self.residual}",
            *([f"- condition {self.condition_size} x {self.condition_size}"] if self.condition_size else []),
        ]

    construction_only = ("weights",)

    def __init__(
        self,
        image_size: int = 32,
        block_out_channels: tuple[int, ...] = (32, 64, 64),
        attention_levels: tuple[bool, ...] = (False, False, True),
        layers_per_block: int = 1,
        norm_num_groups: int = 8,
        attention_head_dim: int = 16,
        num_train_timesteps: int = 1000,
        beta_schedule: Literal["linear", "scaled_linear", "squaredcos_cap_v2"] = "squaredcos_cap_v2",
        prediction_type: Prediction = "epsilon",
        scheduler: SchedulerName = "ddim",
        num_inference_steps: int = 20,
        eta: float = 0.0,
        residual: bool = True,
        upsample: Literal["nearest", "bilinear", "bicubic"] = "bilinear",
        condition_size: int | None = None,
        weights: str | None = None,
    ) -> None:
        super().__init__()
        block_out_channels, attention_levels = tuple(block_out_channels), tuple(attention_levels)
        if not block_out_channels or any(c <= 0 for c in block_out_channels):
            raise ValueError(f"block_out_channels must be positive channel counts, got {block_out_channels}")
        if len(attention_levels) != len(block_out_channels):
            raise ValueError(
                f"attention_levels has {len(attention_levels)} entries but block_out_channels has "
                f"{len(block_out_channels)}: give one flag per UNet level"
            )
        if any(c % norm_num_groups for c in block_out_channels):
            raise ValueError(
                f"norm_num_groups={norm_num_groups} must divide every entry of block_out_channels "
                f"{block_out_channels}"
            )
        attended = [c for c, a in zip(block_out_channels, attention_levels, strict=True) if a]
        if any(c % attention_head_dim for c in attended):
            raise ValueError(
                f"attention_head_dim={attention_head_dim} must divide the channels of every attention level "
                f"{tuple(attended)}"
            )
        factor = 2 ** (len(block_out_channels) - 1)
        if image_size <= 0 or image_size % factor:
            raise ValueError(
                f"image_size={image_size} must be a positive multiple of {factor} "
                f"(the UNet halves the resolution {len(block_out_channels) - 1} times)"
            )
        if scheduler not in _SAMPLERS:
            raise ValueError(f"scheduler must be one of {sorted(_SAMPLERS)}, got {scheduler!r}")
        if num_inference_steps < 1 or num_inference_steps > num_train_timesteps:
            raise ValueError(
                f"num_inference_steps={num_inference_steps} must be in 1..num_train_timesteps "
                f"({num_train_timesteps})"
            )
        if condition_size is not None and not 1 <= condition_size <= image_size:
            raise ValueError(
                f"condition_size={condition_size} must be in 1..image_size ({image_size}): the condition is "
                "the low-resolution decode"
            )
        self.image_size = image_size
        self.condition_size = condition_size
        self.prediction_type = prediction_type
        self.scheduler = scheduler
        self.num_inference_steps = num_inference_steps
        self.eta = eta
        self.residual = residual
        self.upsample = upsample
        # The last level has no downsampler in diffusers, so "Attn" on it puts attention at the coarsest grid.
        down = tuple("AttnDownBlock2D" if a else "DownBlock2D" for a in attention_levels)
        up = tuple("AttnUpBlock2D" if a else "UpBlock2D" for a in reversed(attention_levels))
        self.unet = UNet2DModel(
            sample_size=image_size,
            in_channels=6,  # the noisy image and the upsampled condition, concatenated
            out_channels=3,
            down_block_types=down,
            up_block_types=up,
            block_out_channels=block_out_channels,
            layers_per_block=layers_per_block,
            norm_num_groups=norm_num_groups,
            attention_head_dim=attention_head_dim,
        )
        # A residual lies in [-2, 2]; clipping the predicted x0 to [-1, 1] would cut real detail off.
        clip_range = 2.0 if residual else 1.0
        self._schedule = dict(
            num_train_timesteps=num_train_timesteps,
            beta_schedule=beta_schedule,
            prediction_type=prediction_type,
            # "trailing" makes a few-step sampler start at the last training timestep (pure noise), as
            # "Common Diffusion Noise Schedules and Sample Steps are Flawed" (Lin et al., 2024) shows it must.
            timestep_spacing="trailing",
        )
        self.noise_scheduler = DDPMScheduler(**self._schedule, clip_sample=True, clip_sample_range=clip_range)
        self._clip_range = clip_range
        if weights is not None:
            load_weights_file(self, weights, what="DiffusionRefiner weights")

    # --- shapes -------------------------------------------------------------------------------------

    def _check(self, name: str, x: Tensor, full: bool) -> None:
        if not isinstance(x, Tensor) or not x.is_floating_point():
            kind = x.dtype if isinstance(x, Tensor) else type(x).__name__
            raise TypeError(f"DiffusionRefiner: {name} must be a float tensor in [-1, 1], got {kind}")
        if x.dim() != 4 or x.shape[1] != 3:
            raise ValueError(f"DiffusionRefiner: {name} must be [B, 3, H, W] RGB, got shape {tuple(x.shape)}")
        h, w = x.shape[-2:]
        s = self.image_size
        if full and (h, w) != (s, s):
            raise ValueError(f"DiffusionRefiner: {name} must be {s}x{s} (image_size), got {h}x{w}")
        if not full and (h > s or w > s):
            raise ValueError(
                f"DiffusionRefiner: {name} is {h}x{w}, larger than the output image_size {s}; "
                "the condition is the low-resolution decode"
            )
        c = self.condition_size
        if not full and c is not None and (h, w) != (c, c):
            raise ValueError(
                f"DiffusionRefiner: {name} is {h}x{w}, but this refiner refines {c}x{c} conditions "
                "(condition_size)"
            )

    def upsampled(self, condition: Tensor) -> Tensor:
        """The condition brought to full resolution: the plain-upsampling baseline and the UNet's context."""
        self._check("condition", condition, full=False)
        if condition.shape[-1] == self.image_size and condition.shape[-2] == self.image_size:
            return condition
        kwargs = {} if self.upsample == "nearest" else {"align_corners": False}
        size = (self.image_size, self.image_size)
        return F.interpolate(condition, size=size, mode=self.upsample, **kwargs).clamp(-1, 1)

    def _denoise(self, noisy: Tensor, timesteps: Tensor, context: Tensor) -> Tensor:
        return self.unet(torch.cat([noisy, context], dim=1), timesteps).sample

    # --- training -----------------------------------------------------------------------------------

    def loss(self, target: Tensor, condition: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Mean squared error of the UNet's prediction at a uniformly drawn timestep per image.

        Args:
            target: the full-resolution images, [B, 3, image_size, image_size] in [-1, 1].
            condition: the degraded images (e.g. the tokenizer's decode), [B, 3, h, w], h, w <= image_size.
            generator: seeds the timesteps and the noise (None: the global RNG).
        """
        self._check("target", target, full=True)
        context = self.upsampled(condition)
        if context.shape[0] != target.shape[0]:
            raise ValueError(
                f"DiffusionRefiner: target has {target.shape[0]} images but condition has {context.shape[0]}"
            )
        clean = target - context if self.residual else target
        b = clean.shape[0]
        n = self.noise_scheduler.config.num_train_timesteps
        # Drawn on the CPU, so that a seeded CPU generator gives the same draws whatever the device.
        timesteps = torch.randint(0, n, (b,), generator=generator).to(clean.device)
        noise = torch.randn(clean.shape, generator=generator, dtype=clean.dtype).to(clean.device)
        noisy = self.noise_scheduler.add_noise(clean, noise, timesteps)
        prediction = self._denoise(noisy, timesteps, context)
        if self.prediction_type == "epsilon":
            wanted = noise
        elif self.prediction_type == "sample":
            wanted = clean
        else:
            wanted = self.noise_scheduler.get_velocity(clean, noise, timesteps)
        return F.mse_loss(prediction, wanted)

    # --- sampling -----------------------------------------------------------------------------------

    def sampler(self) -> DDPMScheduler | DDIMScheduler | DPMSolverMultistepScheduler:
        """A fresh scheduler of the configured kind (schedulers keep per-run state, so one per call)."""
        if self.scheduler == "ddim":
            return DDIMScheduler(**self._schedule, clip_sample=True, clip_sample_range=self._clip_range)
        if self.scheduler == "ddpm":
            return DDPMScheduler(**self._schedule, clip_sample=True, clip_sample_range=self._clip_range)
        return DPMSolverMultistepScheduler(**self._schedule, algorithm_type="dpmsolver++")

    @torch.no_grad()
    def refine(
        self, condition: Tensor, steps: int | None = None, generator: torch.Generator | None = None
    ) -> Tensor:
        """Full-resolution images restored from their low-resolution decodes.

        Args:
            condition: [B, 3, h, w] in [-1, 1], h, w <= image_size (the tokenizer's decode).
            steps: sampling steps (None: `num_inference_steps`).
            generator: seeds the initial noise and any sampler noise; the same seed gives the same images.

        Returns:
            [B, 3, image_size, image_size] in [-1, 1].
        """
        steps = self.num_inference_steps if steps is None else steps
        n = self.noise_scheduler.config.num_train_timesteps
        if not 1 <= steps <= n:
            raise ValueError(f"DiffusionRefiner.refine: steps={steps} must be in 1..{n}")
        context = self.upsampled(condition)
        sampler = self.sampler()
        sampler.set_timesteps(steps, device=context.device)
        x = torch.randn(context.shape, generator=generator, dtype=context.dtype).to(context.device)
        x = x * sampler.init_noise_sigma
        for t in sampler.timesteps:
            batch_t = t.expand(x.shape[0]).to(context.device)
            prediction = self._denoise(sampler.scale_model_input(x, t), batch_t, context)
            extra = {"eta": self.eta} if self.scheduler == "ddim" else {}
            x = sampler.step(prediction, t, x, generator=generator, **extra).prev_sample
        image = context + x if self.residual else x
        return image.clamp(-1, 1)

    def forward(self, condition: Tensor) -> Tensor:
        return self.refine(condition)
