"""Scores of refined generations (ERNIE 5.0's diffusion refiner after the visual tokenizer; docs/refiner.md).

For caption-to-image samples whose decode was refined (`zoo.models.refinement`), the gallery and
`benchmarks/refined_generation.py` report, beside the unrefined figures of `multimodal_eval`:

    {task}/refined_exact, {task}/refined_attribute_accuracy   verify_image of the refined images
    {task}/psnr, {task}/ssim                  the decode, bicubic-upsampled to the refined size, and
    {task}/refined_psnr, {task}/refined_ssim  the refined image, against the render of the caption's own
                                              scene at that size (torchmetrics, as zoo/tasks/metrics.py)

Both are compared at the same size, so the figures say what the refiner adds over plain upsampling of the
same codes' decode. PSNR is per image, then averaged; SSIM is averaged over images.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from zoo.tasks.metrics import ImageSSIM, per_image_psnr
from zoo.world.render import render_image, to_tensor, verify_image
from zoo.world.scenes import CaptionScore, Scene


def upsampled_to(images: Tensor, size: int) -> Tensor:
    """Images `[B, 3, h, w]` in [-1, 1] bicubic-upsampled to `size` x `size` (as they are when already so)."""
    if images.shape[-2:] == (size, size):
        return images
    return F.interpolate(images.float(), size=(size, size), mode="bicubic", align_corners=False).clamp(-1, 1)


def scene_renders(scenes: list[Scene], size: int) -> Tensor:
    """The scenes' own images at `size` x `size`: `[B, 3, size, size]` in [-1, 1]."""
    return torch.stack([to_tensor(render_image(scene, size)) for scene in scenes])


def fidelity(images: Tensor, scenes: list[Scene]) -> tuple[float, float]:
    """Mean PSNR (dB) and SSIM of images `[B, 3, S, S]` against the renders of their scenes at side S."""
    if images.dim() != 4 or images.shape[0] != len(scenes):
        raise ValueError(
            f"fidelity: expected one image [3, S, S] per scene ({len(scenes)}), got {tuple(images.shape)}"
        )
    size = images.shape[-1]
    target = scene_renders(scenes, size)
    images = images.float().cpu()
    ssim = ImageSSIM(size)
    ssim.update(images, target)
    return per_image_psnr(images, target).mean().item(), ssim.compute().item()


def refined_metrics(
    task: str, decoded: list[Tensor], refined: list[Tensor], scenes: list[Scene]
) -> tuple[list[CaptionScore], dict[str, float]]:
    """The refined images' verifier scores, and the refined figures of `task` (keys in the module docstring).

    decoded: the tokenizer's decodes `[3, h, w]`; refined: the refiner's outputs `[3, S, S]` of the same
    codes."""
    if not len(decoded) == len(refined) == len(scenes):
        raise ValueError(
            f"refined_metrics: {len(decoded)} decodes, {len(refined)} refined images and {len(scenes)} "
            "scenes; expected one of each per scene"
        )
    scores = [verify_image(image, scene) for image, scene in zip(refined, scenes, strict=True)]
    refined_batch = torch.stack([r.float().cpu() for r in refined])
    size = refined_batch.shape[-1]
    upsampled = upsampled_to(torch.stack([d.float().cpu() for d in decoded]), size)
    plain_psnr, plain_ssim = fidelity(upsampled, scenes)
    psnr, ssim = fidelity(refined_batch, scenes)
    n = max(len(scores), 1)
    return scores, {
        f"{task}/refined_exact": sum(float(s.exact) for s in scores) / n,
        f"{task}/refined_attribute_accuracy": sum(float(s.attribute_accuracy) for s in scores) / n,
        f"{task}/psnr": plain_psnr,
        f"{task}/refined_psnr": psnr,
        f"{task}/ssim": plain_ssim,
        f"{task}/refined_ssim": ssim,
    }
