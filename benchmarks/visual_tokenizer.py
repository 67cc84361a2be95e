"""Benchmark of the visual tokenizer (zoo/tokenizers/visual.py) on held-out ShapesWorld images and videos.

Reports, in one JSON line:
- PSNR of reconstructions per number of scales decoded (1..K) on held-out ("val") 32x32 images, and the
  codebook usage (share of entries used by those images, all scales together, and per scale);
- against baselines in the same run: plain bicubic down/up-sampling through the latent grid (the same
  number of "pixels" as the finest scale, in continuous colour) and, when given, a single-scale VQ
  tokenizer with the same codebook trained with the same budget (`--single_scale_weights`);
- video: PSNR on held-out 5-frame videos of the causal 3D tokenizer (`--video_weights`, e.g. inflated
  from the 2D one and fine-tuned), per number of scales decoded, against the 2D tokenizer applied frame
  by frame and against the 3D tokenizer as inflated from `--weights` before any training; a check that
  inflation with stride 1 reproduces the 2D codes; `--video_figure` draws frames (original, 3D, 2D);
- encode+decode images/s of the tokenizer, timed interleaved with the bicubic baseline.

It loads trained weights (the `visual_tokenizer.safetensors` that `zoo fit` writes) and rebuilds the
tokenizers from the YAML configs; it does not train.

    .venv/bin/python benchmarks/visual_tokenizer.py \
        --weights runs/visual_2d/latest/visual_tokenizer.safetensors \
        [--single_scale_weights runs/visual_2d_single/latest/visual_tokenizer.safetensors] \
        [--video_weights runs/visual_3d/latest/visual_tokenizer.safetensors \
         --video_figure docs/img/visual_tokenizer_video.png]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, emit, log, machine_info, time_interleaved  # noqa: E402

from zoo.tasks.metrics import per_image_psnr as psnr  # noqa: E402
from zoo.tokenizers.visual import VisualTokenizer  # noqa: E402
from zoo.tokenizers.visual_quantizer import MultiScaleQuantizer, usage_statistics  # noqa: E402
from zoo.world.render import render_image, render_video, to_tensor  # noqa: E402
from zoo.world.scenes import ShapesWorld  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "tokenizers"


def build(config: Path, weights: str, **quantizer_overrides) -> VisualTokenizer:
    """The tokenizer of a task YAML (model.init_args.tokenizer) with trained weights."""
    spec = yaml.safe_load(config.read_text())["model"]["init_args"]["tokenizer"]["init_args"]
    q = {**spec.pop("quantizer")["init_args"], **quantizer_overrides}
    q["scales"] = tuple(q["scales"])
    spec["channels"] = tuple(spec["channels"])
    return VisualTokenizer(**spec, quantizer=MultiScaleQuantizer(**q), weights=weights).eval()


def bicubic(images: torch.Tensor, side: int) -> torch.Tensor:
    small = F.interpolate(images, size=(side, side), mode="area")
    return F.interpolate(small, size=images.shape[-2:], mode="bicubic", align_corners=False).clamp(-1, 1)


def mean_psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(float(psnr(a, b).mean()), 2)


def write_figure(path: Path, tok: VisualTokenizer, images: torch.Tensor) -> None:
    """Rows: the originals, then their decodes from the first 1, 2, .., K scales."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    codes = tok.encode(images)
    rows = [("original", images)] + [
        (
            f"{m} scale{'s' if m > 1 else ''} (to {tok.scales[m - 1]}x{tok.scales[m - 1]})",
            tok.decode(codes[:m]),
        )
        for m in range(1, len(codes) + 1)
    ]
    fig, axes = plt.subplots(len(rows), len(images), figsize=(1.1 * len(images), 1.15 * len(rows)))
    for r, (label, pixels) in enumerate(rows):
        for c in range(len(images)):
            ax = axes[r, c]
            ax.imshow(((pixels[c].clamp(-1, 1) + 1) / 2).permute(1, 2, 0).numpy(), interpolation="nearest")
            ax.set_xticks([]), ax.set_yticks([])
            if c == 0:
                ax.set_ylabel(label, fontsize=7)
        if r:
            p = psnr(pixels, images).mean()
            axes[r, -1].set_title(f"{p:.1f} dB", fontsize=7, loc="right")
    fig.tight_layout(pad=0.2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def per_frame(tok: VisualTokenizer, videos: torch.Tensor, m: int) -> torch.Tensor:
    """The 2D tokenizer applied to every frame of [B, 3, T, H, W] videos, decoded from the first m scales."""
    frames = videos.transpose(1, 2).flatten(0, 1)
    decoded = tok.decode(tok.encode(frames)[:m])
    return decoded.unflatten(0, videos.shape[:1] + videos.shape[2:3]).transpose(1, 2)


def video_psnr_per_scales(video_tok: VisualTokenizer, videos: torch.Tensor) -> dict[str, float]:
    codes = video_tok.encode(videos)
    return {
        str(m): mean_psnr(video_tok.decode(codes[:m]).flatten(1), videos.flatten(1))
        for m in range(1, len(codes) + 1)
    }


def video_results(tok: VisualTokenizer, args: argparse.Namespace, size: int) -> dict[str, object]:
    """The causal 3D tokenizer on held-out videos, per number of scales decoded, against the 2D tokenizer
    frame by frame and against the 3D tokenizer as inflated from it before any training (all same run)."""
    video_tok = build(Path(args.video_config), args.video_weights)
    moving = ShapesWorld(seed=0, include_motion=True)
    scenes = moving.scenes("val", args.videos)
    videos = torch.stack([to_tensor(render_video(s, args.frames, size)) for s in scenes])
    log(f"{len(videos)} held-out {args.frames}-frame videos; 3D stride {video_tok.temporal_stride}")
    out: dict[str, object] = {"videos": len(videos), "video_frames": videos.shape[2]}
    out["video_latent_frames"] = video_tok.encode(videos[:1])[0].shape[1]
    out["video_psnr_per_scales_decoded"] = video_psnr_per_scales(video_tok, videos)
    out["video_psnr"] = out["video_psnr_per_scales_decoded"][str(len(tok.scales))]
    out["baseline_2d_per_frame_video_psnr_per_scales"] = {
        str(m): mean_psnr(per_frame(tok, videos, m).flatten(1), videos.flatten(1))
        for m in range(1, len(tok.scales) + 1)
    }
    out["baseline_2d_per_frame_video_psnr"] = out["baseline_2d_per_frame_video_psnr_per_scales"][
        str(len(tok.scales))
    ]
    inflated = VisualTokenizer.from_2d(
        tok, temporal_stride=video_tok.temporal_stride, temporal_kernel=video_tok.temporal_kernel
    ).eval()
    out["baseline_inflated_untrained_video_psnr_per_scales"] = video_psnr_per_scales(inflated, videos)
    # Inflation with stride 1 must reproduce the 2D tokenizer frame by frame (codes equal, decodes close).
    same = VisualTokenizer.from_2d(tok, temporal_stride=1, temporal_kernel=video_tok.temporal_kernel).eval()
    codes_3d = same.encode(videos)
    frames = videos.transpose(1, 2).flatten(0, 1)
    codes_2d = tok.encode(frames)
    out["inflated_stride1_codes_equal_2d"] = all(
        torch.equal(a.flatten(0, 1), b.flatten(0, 1)) for a, b in zip(codes_3d, codes_2d, strict=True)
    )
    decoded = same.decode(codes_3d).transpose(1, 2).flatten(0, 1)
    out["inflated_stride1_max_abs_decode_diff"] = float((decoded - tok.decode(codes_2d)).abs().max())
    out["video_gain_over_2d_per_frame_db"] = round(
        out["video_psnr"] - out["baseline_2d_per_frame_video_psnr"], 2
    )
    out["video_codes_per_frame_vs_2d"] = round(out["video_latent_frames"] / videos.shape[2], 3)
    if args.video_figure:
        with torch.no_grad():
            shown = videos[:2]
            rows = [
                ("original", shown),
                ("3D", video_tok.decode(video_tok.encode(shown))),
                ("2D per frame", per_frame(tok, shown, len(tok.scales))),
            ]
        write_video_figure(Path(args.video_figure), rows)
        log(f"wrote {args.video_figure}")
    return out


def write_video_figure(path: Path, rows: list[tuple[str, torch.Tensor]]) -> None:
    """Per video, one row per entry of `rows` (label, [B, 3, T, H, W]); columns are the frames."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b, t = rows[0][1].shape[0], rows[0][1].shape[2]
    fig, axes = plt.subplots(b * len(rows), t, figsize=(1.0 * t, 1.05 * b * len(rows)))
    for v in range(b):
        for r, (label, pixels) in enumerate(rows):
            for f in range(t):
                ax = axes[v * len(rows) + r, f]
                ax.imshow(
                    ((pixels[v, :, f].clamp(-1, 1) + 1) / 2).permute(1, 2, 0).numpy(), interpolation="nearest"
                )
                ax.set_xticks([]), ax.set_yticks([])
                if f == 0:
                    ax.set_ylabel(label, fontsize=7)
                if v == 0 and r == 0:
                    ax.set_title(f"frame {f}", fontsize=7)
            if r:
                p = psnr(pixels[v : v + 1].flatten(1), rows[0][1][v : v + 1].flatten(1)).item()
                axes[v * len(rows) + r, -1].set_title(f"{p:.1f} dB", fontsize=7, loc="right")
    fig.tight_layout(pad=0.2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--weights", required=True, help="2D tokenizer safetensors (zoo fit visual_2d.yaml)")
    parser.add_argument("--config", default=str(CONFIGS / "visual_2d.yaml"))
    parser.add_argument(
        "--single_scale_weights",
        default=None,
        help="baseline: the same config trained with scales [8] (one scale)",
    )
    parser.add_argument("--video_weights", default=None, help="3D tokenizer safetensors (visual_3d.yaml)")
    parser.add_argument("--video_config", default=str(CONFIGS / "visual_3d.yaml"))
    parser.add_argument("--images", type=int, default=256, help="held-out images")
    parser.add_argument("--videos", type=int, default=32, help="held-out videos")
    parser.add_argument("--frames", type=int, default=5, help="frames per held-out video (1 + stride * k)")
    parser.add_argument(
        "--video_figure", default=None, help="write a PNG of 2 videos' frames: original, 3D, 2D per frame"
    )
    parser.add_argument("--batch", type=int, default=64, help="batch size of the throughput timing")
    parser.add_argument(
        "--figure",
        default=None,
        help="write a PNG of originals over decodes from 1..K scales (and the video row)",
    )
    add_common_args(parser, repeats=5)
    args = parser.parse_args()
    info = machine_info(args.threads)
    torch.manual_seed(args.seed)

    tok = build(Path(args.config), args.weights)
    size, grid = tok.image_size, tok.scales[-1]
    world = ShapesWorld(seed=0)
    images = torch.stack([to_tensor(render_image(s, size)) for s in world.scenes("val", args.images)])
    log(f"{len(images)} held-out images of {size}x{size}; latent grid {grid}x{grid}, scales {tok.scales}")

    codes = tok.encode(images)
    psnr_per_scales = {str(m): mean_psnr(tok.decode(codes[:m]), images) for m in range(1, len(codes) + 1)}
    usage, perplexity = usage_statistics(torch.cat([c.flatten() for c in codes]), tok.codebook_size)
    per_scale_usage = [round(usage_statistics(c, tok.codebook_size)[0], 4) for c in codes]
    result: dict[str, object] = {
        "benchmark": "visual_tokenizer",
        "images": len(images),
        "image_size": size,
        "scales": list(tok.scales),
        "codebook_size": tok.codebook_size,
        "latent_dim": tok.latent_dim,
        "psnr_per_scales_decoded": psnr_per_scales,
        "psnr": psnr_per_scales[str(len(codes))],
        "codebook_usage": round(usage, 4),
        "codebook_perplexity": round(perplexity, 1),
        "codebook_usage_per_scale": per_scale_usage,
        "baseline_bicubic_psnr": mean_psnr(bicubic(images, grid), images),
        "baseline_bicubic_per_scale_psnr": {
            str(s): mean_psnr(bicubic(images, s), images) for s in tok.scales
        },
    }
    result["psnr_gain_over_bicubic_db"] = round(result["psnr"] - result["baseline_bicubic_psnr"], 2)

    if args.single_scale_weights:
        single = build(Path(args.config), args.single_scale_weights, scales=(grid,))
        c1 = single.encode(images)
        result["baseline_single_scale_vq_psnr"] = mean_psnr(single.decode(c1), images)
        result["baseline_single_scale_vq_usage"] = round(usage_statistics(c1[0], single.codebook_size)[0], 4)
        result["psnr_gain_over_single_scale_db"] = round(
            result["psnr"] - result["baseline_single_scale_vq_psnr"], 2
        )

    if args.video_weights:
        result.update(video_results(tok, args, size))

    if args.figure:
        write_figure(Path(args.figure), tok, images[:8])
        log(f"wrote {args.figure}")

    batch = images[: args.batch]

    def tokenizer_round_trip() -> torch.Tensor:
        return tok.decode(tok.encode(batch))

    def bicubic_round_trip() -> torch.Tensor:
        return bicubic(batch, grid)

    medians, _, spread = time_interleaved(
        {"tokenizer": tokenizer_round_trip, "bicubic": bicubic_round_trip}, args.warmup, args.repeats
    )
    result["encode_decode_images_per_s"] = round(len(batch) / medians["tokenizer"], 1)
    result["bicubic_images_per_s"] = round(len(batch) / medians["bicubic"], 1)
    result["timing_spread"] = spread
    result["weights"] = args.weights
    result["machine"] = info
    emit(result)


if __name__ == "__main__":
    main()
