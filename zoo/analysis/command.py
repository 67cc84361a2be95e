"""`zoo analyze`: the routing analysis of a trained unified checkpoint (issue 7, item 1; ERNIE 5.0's expert
routing figures at our scale).

Loads a `UnifiedPretraining` checkpoint (`zoo.hub.load_lightning_checkpoint`, weights only), draws
validation batches from the datamodule of a given config, or by default from ShapesWorld with every task
the checkpoint's tokenizers allow (captions; images with a visual tokenizer, video with a 3D one, speech with
an audio codec, context images with a vision encoder), records the router's choices per MoE layer and token
(`zoo.analysis.routing`) and writes into `--out`:

    routing.json            counts, shares, NE per layer and modality, top experts, IoU per layer and pair
    routing_heatmap.png     layers x experts per modality, NE per layer on the rows
    routing_iou.png         IoU of the modalities' top-25% experts per layer
    routing_tokens.safetensors   with --save_tokens: every token's modality and chosen experts per layer

    zoo analyze --checkpoint runs/demo/multimodal/latest/checkpoints/last.ckpt \
        --out runs/demo/analysis --batches 8
    zoo analyze --checkpoint CKPT --out DIR --config configs/pretrain/shapes_image.yaml   # that config's data
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from zoo.analysis.plots import heatmap_figure, iou_figure, save
from zoo.analysis.routing import TOP_FRACTION, RoutingRecorder

JSON_NAME = "routing.json"
HEATMAP_NAME = "routing_heatmap.png"
IOU_NAME = "routing_iou.png"
TOKENS_NAME = "routing_tokens.safetensors"


def default_datamodule(model: Any, tokenizer: Any, batch_size: int = 16, seed: int = 0) -> Any:
    """ShapesWorld documents in every task the model's tokenizers allow, equally weighted."""
    from zoo.datamodules.sequence import MediaLayout
    from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule

    visual = model.visual_tokenizer
    video = visual is not None and bool(visual.temporal)
    codec, encoder = model.audio_codec, model.vision_encoder
    layout = MediaLayout.of(model)
    image = float(visual is not None)
    data = ShapesMultimodalDataModule(
        vocab=model.vocab,
        layout=layout,
        caption_weight=1.0,
        text_to_image_weight=image,
        image_to_text_weight=float(visual is not None or encoder is not None),
        text_to_video_weight=float(video),
        video_to_text_weight=float(video),
        text_to_audio_weight=float(codec is not None),
        audio_to_text_weight=float(codec is not None),
        image_context=visual is None and encoder is not None,
        image_size=visual.image_size if visual is not None else 32,
        video_frames=1 + 2 * layout.temporal_stride if video else 5,
        seq_len=model.backbone.max_seq_len,
        batch_size=batch_size,
        seed=seed,
    )
    data.tokenizer = tokenizer
    return data


def datamodule_from_config(paths: Sequence[str | Path]) -> Any:
    """The `data` section of a LightningCLI config (later files overlay earlier ones), built as `zoo fit`
    would build it. Only classes under `zoo.` are accepted."""
    import importlib

    from jsonargparse import ArgumentParser

    merged: dict[str, Any] = {}
    for path in paths:
        text = Path(path).read_text()
        _merge(merged, yaml.safe_load(text) or {})
    data = merged.get("data")
    if not isinstance(data, dict) or "class_path" not in data:
        raise ValueError(f"{', '.join(map(str, paths))}: no `data: {{class_path, init_args}}` section")
    class_path = data["class_path"]
    if not isinstance(class_path, str) or not class_path.startswith("zoo."):
        raise ValueError(f"data.class_path {class_path!r}: expected a datamodule class under `zoo.`")
    module, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "data")
    return parser.instantiate(parser.parse_object({"data": data.get("init_args") or {}})).data


def _merge(base: dict, overlay: dict) -> None:
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def analyze_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    batches: int = 8,
    config: Sequence[str | Path] = (),
    split: str = "val",
    batch_size: int = 16,
    fraction: float = TOP_FRACTION,
    progress: bool = True,
    save_tokens: bool = False,
) -> dict[str, Any]:
    """Run the routing analysis of `checkpoint` over `batches` batches of `split`; write the JSON and the
    PNGs into `out` (and each token's choices with `save_tokens`) and return the JSON's content."""
    from zoo.hub import load_lightning_checkpoint

    if batches < 1:
        raise ValueError(f"batches={batches}: expected at least one batch")
    if split not in ("val", "test"):
        raise ValueError(f"split={split!r}: expected 'val' or 'test'")
    model, tokenizer = load_lightning_checkpoint(checkpoint)
    if config:
        data = datamodule_from_config(config)
        if getattr(data, "tokenizer", None) is None and tokenizer is not None:
            data.tokenizer = tokenizer  # decode and encode with the tokenizer the model was trained with
        vocab = getattr(data, "vocab", None)
        if vocab is not None and vocab != model.vocab:
            raise ValueError(
                f"{', '.join(map(str, config))}: the data's vocabulary {vocab} differs from the checkpoint "
                f"model's {model.vocab}"
            )
    else:
        if tokenizer is None:
            raise ValueError(
                f"{checkpoint} stores no tokenizer (a datamodule state): give --config with the data section"
            )
        data = default_datamodule(model, tokenizer, batch_size)
    data.setup("validate")
    loader = data.val_dataloader() if split == "val" else data.test_dataloader()
    recorder = RoutingRecorder(model, keep_tokens=save_tokens)
    total = min(batches, len(loader))
    for i, batch in enumerate(_progress(loader, total, progress)):
        if i >= total:
            break
        recorder.record(batch)
    counts = recorder.counts
    result = {
        "checkpoint": str(checkpoint),
        "split": split,
        "batches": total,
        "loss": sum(recorder.losses) / len(recorder.losses),
        "head_losses": {k: sum(v) / len(v) for k, v in recorder.head_losses.items()},
        "modality_pools": _pools(model),
        **counts.summary(fraction),
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / JSON_NAME).write_text(json.dumps(result, indent=1) + "\n")
    name = Path(checkpoint).name
    save(heatmap_figure(counts, f"Expert activation by modality, {name}"), out / HEATMAP_NAME)
    save(iou_figure(counts, fraction, f"IoU of top-{fraction:.0%} experts by load, {name}"), out / IOU_NAME)
    if save_tokens:
        from safetensors.torch import save_file

        save_file(recorder.tokens(), out / TOKENS_NAME)
    return result


def _pools(model: Any) -> dict[str, list[int]] | None:
    pools = getattr(model.backbone, "modality_pools", None)
    if pools is None:
        return None
    return {k: list(v) for k, v in vars(pools).items()}


def _progress(loader: Any, total: int, enabled: bool) -> Any:
    if not enabled:
        return loader
    from rich.progress import track

    return track(loader, total=total, description="routing batches", transient=False)


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The short stdout summary: tokens per modality, mean NE, mean IoU per pair, isolation if any."""
    lines = [
        f"routing analysis of {result['checkpoint']}: {result['batches']} {result['split']} batches, "
        f"MoE layers {result['layers']}, {result['n_experts']} experts, mean loss {result['loss']:.3f} ("
        + ", ".join(f"{k} {v:.3f}" for k, v in result["head_losses"].items())
        + ")",
        "tokens: " + ", ".join(f"{k} {v:,}" for k, v in result["tokens"].items()),
        "normalised entropy (mean over layers): "
        + ", ".join(f"{k} {_fmt(v)}" for k, v in result["normalised_entropy_mean"].items()),
    ]
    if result["iou_mean"]:
        lines.append(
            f"IoU of top-{result['top_fraction']:.0%} experts (mean over layers): "
            + ", ".join(
                f"{k} {_fmt(v)} (chance {_fmt(_mean(result['iou_chance'][k]))})"
                for k, v in result["iou_mean"].items()
            )
        )
    if result.get("modality_pools"):
        lines.append(
            "modality-isolated routing: disjoint pools give IoU 0 between text and the other modalities"
        )
    return lines


def _mean(values: list[float | None]) -> float:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else math.nan


def _fmt(value: float | None) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


def analyze_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="zoo analyze",
        description="routing analysis of a unified checkpoint: heatmaps, IoU, entropy",
        epilog="Unlike the other extra commands, `zoo analyze` takes no file of its own options and has no "
        "--print_config: its --config is the training config whose data section it probes with (as `zoo fit "
        "--config` reads it).",
    )
    parser.add_argument("--checkpoint", required=True, help="a Lightning checkpoint of UnifiedPretraining")
    parser.add_argument("--out", required=True, help="directory for routing.json and the PNG figures")
    parser.add_argument("--batches", type=int, default=8, help="validation batches to run (default 8)")
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        help="take the data section of this config "
        "(repeat for overlays); default: ShapesWorld in every task the checkpoint allows",
    )
    parser.add_argument(
        "--split", choices=("val", "test"), default="val", help="val, or test (held-out pairs)"
    )
    parser.add_argument("--batch_size", type=int, default=16, help="documents per batch (default data only)")
    parser.add_argument("--top_fraction", type=float, default=TOP_FRACTION, help="top experts for the IoU")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--save_tokens", action="store_true", help=f"also write every token's choices ({TOKENS_NAME})"
    )
    args = parser.parse_args(argv)
    with torch.no_grad():  # not set_grad_enabled(False): a caller in the same process keeps its gradients
        result = analyze_checkpoint(
            args.checkpoint,
            args.out,
            args.batches,
            args.config,
            args.split,
            args.batch_size,
            args.top_fraction,
            progress=not args.no_progress,
            save_tokens=args.save_tokens,
        )
    for line in summary_lines(result):
        print(line)
    out = Path(args.out)
    written = [JSON_NAME, HEATMAP_NAME, IOU_NAME, *([TOKENS_NAME] if args.save_tokens else [])]
    print("wrote " + ", ".join(str(out / name) for name in written))


if __name__ == "__main__":
    analyze_main(sys.argv[1:])
