"""Benchmark of the diffusion refiner (zoo/models/refiner.py): PSNR of refined vs plainly upsampled decodes.

Loads a trained `RefinerTraining` checkpoint (refiner + its degradation: the tokenizer's decode or a
plain down-sampling), degrades held-out ShapesWorld images (the datamodule's "val" split, never trained
on) exactly as in training, and compares against the clean images:
  - the baseline: the condition plainly upsampled (the refiner's own `upsample` mode; bicubic too);
  - the refiner's output at each requested number of sampling steps (same seed for every count).
Also images/s of `refine` at each step count. Progress goes to stderr; the last stdout line is one JSON.

    zoo fit --config configs/refiner/shapes.yaml   # trains runs/refiner/latest/checkpoints/last.ckpt
    .venv/bin/python benchmarks/refiner.py --checkpoint runs/refiner/latest/checkpoints/last.ckpt \
        [--images 256 --steps 1 5 10 --png docs/img/refiner_samples.png]
    .venv/bin/python benchmarks/refiner.py --checkpoint runs/refiner_tokenizer/latest/checkpoints/last.ckpt \
        --steps 1 5 10 --scales 3 2     # a tokenizer-conditioned refiner, also on decodes of fewer scales
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, log, machine_info  # noqa: E402

from zoo.datamodules.shapes_cascade import ShapesCascadeDataModule  # noqa: E402
from zoo.tasks.metrics import per_image_psnr as psnr  # noqa: E402
from zoo.tasks.refiner import (  # noqa: E402
    RefinerTraining,
    TokenizerDegradation,
    comparison_grid,
    save_grid_png,
)  # noqa: E402


def held_out_images(size: int, count: int, seed: int) -> torch.Tensor:
    """`count` images of the ShapesWorld validation split, [count, 3, size, size] in [-1, 1]."""
    from zoo.datamodules.media_data import ShapesMediaDataModule

    data = ShapesMediaDataModule(
        kind="image", size=size, train_size=1, val_size=count, batch_size=count, seed=seed
    )
    data.setup("validate")
    return next(iter(data.val_dataloader()))["pixels"][:count]


def held_out_pairs(
    size: int, condition_size: int, count: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same validation scenes rendered at `size` and natively at `condition_size`."""
    data = ShapesCascadeDataModule(
        size, condition_size, train_size=1, val_size=count, batch_size=count, seed=seed
    )
    batch = next(iter(data.val_dataloader()))
    return batch["pixels"][:count], batch["condition_pixels"][:count]


def evaluate(refiner, degradation, images, sources, steps_list, batch_size, seed):
    """PSNR of the condition's plain upsamplings and of the refined images (per step count) vs `images`;
    the degradation is applied to `sources` (the images themselves, or their native low-resolution renders).

    Returns (results, condition, upsampled, refined at the first step count)."""
    conditions, upsampled, bicubic = [], [], []
    size = (refiner.image_size, refiner.image_size)
    with torch.no_grad():
        for batch in sources.split(batch_size):
            c = degradation(batch)
            conditions.append(c)
            upsampled.append(refiner.upsampled(c))
            bicubic.append(F.interpolate(c, size=size, mode="bicubic", align_corners=False).clamp(-1, 1))
    condition, upsampled = torch.cat(conditions), torch.cat(upsampled)
    # How faithful the condition is at its own resolution (for a tokenizer: its reconstruction PSNR).
    low = sources if sources.shape[-2:] == condition.shape[-2:] else None
    if low is None:
        low = F.interpolate(images, size=tuple(condition.shape[-2:]), mode="area")
    result = {
        "psnr_condition_vs_downsampled_target": round(psnr(condition, low).mean().item(), 3),
        "psnr_upsampled": round(psnr(upsampled, images).mean().item(), 3),
        "psnr_bicubic": round(psnr(torch.cat(bicubic), images).mean().item(), 3),
    }
    log(
        f"condition {result['psnr_condition_vs_downsampled_target']:.2f} dB at its size; plain upsampling "
        f"({refiner.upsample}) {result['psnr_upsampled']:.2f} dB, bicubic {result['psnr_bicubic']:.2f} dB"
    )
    by_steps: dict[str, dict[str, float]] = {}
    first_refined = None
    for steps in steps_list:
        generator = torch.Generator().manual_seed(seed)
        refined = []
        start = time.perf_counter()
        for c in condition.split(batch_size):
            refined.append(refiner.refine(c, steps=steps, generator=generator))
        seconds = time.perf_counter() - start
        out = torch.cat(refined)
        first_refined = out if first_refined is None else first_refined
        by_steps[str(steps)] = {
            "psnr": round(psnr(out, images).mean().item(), 3),
            "images_per_s": round(len(images) / seconds, 2),
        }
        log(f"{steps} steps: {by_steps[str(steps)]['psnr']:.2f} dB, {len(images) / seconds:.1f} images/s")
    main = by_steps[str(steps_list[0])]["psnr"]
    result["psnr_refined"] = main
    result["psnr_gain_db"] = round(main - result["psnr_upsampled"], 3)
    result["psnr_gain_vs_bicubic_db"] = round(main - result["psnr_bicubic"], 3)
    result["by_steps"] = by_steps
    return result, condition, upsampled, first_refined


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", default="runs/refiner/latest/checkpoints/last.ckpt")
    parser.add_argument("--images", type=int, default=256, help="held-out images evaluated")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--steps", type=int, nargs="+", default=None, help="sampling steps (default: the refiner's)"
    )
    parser.add_argument(
        "--scales",
        type=int,
        nargs="+",
        default=None,
        help="tokenizer conditions only: also decode from the first N scales for each N given (a coarser, "
        "partly wrong decode, as when generation goes astray); the refiner is the same",
    )
    parser.add_argument(
        "--condition-size",
        type=int,
        default=None,
        help="degrade native renders of this side (ShapesCascadeDataModule, as configs/refiner/"
        "tokenizer_native.yaml trains) instead of the full-size images",
    )
    parser.add_argument("--data-seed", type=int, default=0, help="ShapesMediaDataModule seed (its val split)")
    parser.add_argument(
        "--png", default=None, help="write condition | upsampled | refined | target of 8 images here"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="sampling noise seed")
    args = parser.parse_args()
    machine = machine_info(args.threads)
    if not Path(args.checkpoint).is_file():
        raise SystemExit(
            f"{args.checkpoint} does not exist: train one with `zoo fit --config configs/refiner/shapes.yaml`"
        )
    task = RefinerTraining.load_from_checkpoint(args.checkpoint, map_location="cpu").eval()
    refiner, degradation = task.refiner, task.degradation
    if args.scales and not isinstance(degradation, TokenizerDegradation):
        raise SystemExit(
            f"--scales needs a TokenizerDegradation checkpoint, {args.checkpoint} has "
            f"{type(degradation).__name__}"
        )
    steps_list = args.steps or [refiner.num_inference_steps]
    if args.condition_size:
        images, sources = held_out_pairs(refiner.image_size, args.condition_size, args.images, args.data_seed)
    else:
        images = sources = held_out_images(refiner.image_size, args.images, args.data_seed)
    what = type(degradation).__name__
    log(f"{len(images)} held-out {refiner.image_size}px images; degradation {what}; {machine}")

    result, condition, upsampled, first_refined = evaluate(
        refiner, degradation, images, sources, steps_list, args.batch_size, args.seed
    )
    if args.png:
        shown = (condition[:8], upsampled[:8], first_refined[:8], images[:8])
        save_grid_png(comparison_grid(*shown), args.png, scale=3)
        log(f"wrote {args.png}")
    by_scales = {}
    if args.scales:
        trained_scales = degradation.scales
        for m in args.scales:
            log(f"decoding from the first {m} scales:")
            degradation.scales = m
            by_scales[str(m)], *_ = evaluate(
                refiner, degradation, images, sources, steps_list, args.batch_size, args.seed
            )
        degradation.scales = trained_scales

    main_steps = str(steps_list[0])
    emit(
        {
            "benchmark": "refiner",
            **{k: v for k, v in result.items() if k != "by_steps"},
            "sampling_steps": steps_list[0],
            "images_per_s": result["by_steps"][main_steps]["images_per_s"],
            "by_steps": result["by_steps"],
            **({"by_scales_decoded": by_scales} if by_scales else {}),
            "scheduler": refiner.scheduler,
            "prediction_type": refiner.prediction_type,
            "degradation": type(degradation).__name__,
            "condition_size": list(condition.shape[-2:]),
            "condition_source": f"native {args.condition_size}px render" if args.condition_size else "target",
            "image_size": refiner.image_size,
            "images": len(images),
            "refiner_params": sum(p.numel() for p in refiner.parameters()),
            "checkpoint": args.checkpoint,
            **machine,
        }
    )


if __name__ == "__main__":
    main()
