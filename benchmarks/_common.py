"""What the benchmarks share: thread setup, a machine-noise probe, interleaved timing, checkpoint loading
and the one-JSON-line output convention (progress on stderr, the result as the last stdout line)."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout without `pip install -e` works too
from zoo.datamodules.sequence import MediaLayout  # noqa: E402
from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule  # noqa: E402
from zoo.models.unified import UnifiedModel  # noqa: E402


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def add_common_args(parser: argparse.ArgumentParser, repeats: int) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a shared 2-core machine a second OpenMP thread that has to "
        "wait for a busy core makes every small matmul 5-10x slower, which swamps what is measured)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs of every variant first")
    parser.add_argument("--repeats", type=int, default=repeats, help="timed runs per variant (median taken)")
    parser.add_argument("--seed", type=int, default=0)


def machine_info(threads: int) -> dict[str, object]:
    """Sets the thread count and records what makes timings on a shared machine readable: the load and
    how long a 16x128 @ 128x128 matmul takes (a few microseconds on an idle core; 100+ means contention)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(16, 128), torch.randn(128, 128)
    for _ in range(50):
        a @ b
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(200):
            a @ b
        times.append((time.perf_counter() - start) / 200)
    return {
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "matmul_16x128_us": round(statistics.median(times) * 1e6, 1),
        "torch": torch.__version__,
        "git": git_revision(),
    }


def git_revision() -> str:
    """The checkout's commit, `+dirty` when zoo/ has uncommitted changes (results depend on them)."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True)
        return done.stdout.strip()

    try:
        commit, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--", "zoo")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def time_interleaved(
    variants: dict[str, Callable[[], object]], warmup: int, repeats: int, label: str = ""
) -> tuple[dict[str, float], dict[str, object], float]:
    """Median seconds of each variant over `repeats` rounds; every round runs all variants once, in an
    order rotated per round, so machine noise and position in the round hit all of them alike.

    Returns (median seconds, the last result of each variant, spread): spread is the median over
    variants of (max - min) / median of its timings, i.e. how far to trust ratios of the medians.
    """
    names = list(variants)
    results: dict[str, object] = {}
    for _ in range(warmup):
        for name in names:
            results[name] = variants[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            start = time.perf_counter()
            results[name] = variants[name]()
            times[name].append(time.perf_counter() - start)
        log(f"  {label}round {r + 1}/{repeats}: " + ", ".join(f"{n} {times[n][-1]:.3f}s" for n in names))
    medians = {name: statistics.median(t) for name, t in times.items()}
    spread = statistics.median((max(t) - min(t)) / medians[name] for name, t in times.items())
    log(f"  {label}timing spread (max - min) / median: {spread:.0%}")
    return medians, results, round(spread, 3)


def load_checkpoint(path: str) -> tuple[UnifiedModel, dict, str]:
    """(model in eval mode, the raw checkpoint dict, how it was loaded), all read with `weights_only=True`:
    the model is rebuilt from the checkpoint's config by `zoo.hub.load_lightning_checkpoint` (nothing is
    unpickled); the raw dict carries the step count and the datamodule state (the tokenizer)."""
    from zoo.hub import load_lightning_checkpoint

    model, _ = load_lightning_checkpoint(path)
    raw = torch.load(path, map_location="cpu", weights_only=True)
    return model.eval(), raw, "zoo.hub.load_lightning_checkpoint (weights_only=True)"


def load_drawing_model(path: str) -> tuple[UnifiedModel, object]:
    """A `UnifiedPretraining` checkpoint's model (eval mode) and text tokenizer, refused with a clear exit
    when the model has no visual tokenizer to draw with."""
    from zoo.hub import load_lightning_checkpoint

    model, tokenizer = load_lightning_checkpoint(path)
    if model.nfsp is None:
        raise SystemExit(f"{path}: the model has no visual tokenizer, so it draws no images")
    return model.eval(), tokenizer


def shapes_world_for(
    model: UnifiedModel, tokenizer: object, max_objects: int = 2, caption_order: str = "attributes_first"
) -> ShapesMultimodalDataModule:
    """The ShapesWorld datamodule that a checkpoint's model reads, set up for validation: its vocabulary,
    layout and vision encoder, the speech tasks on where the model has an NCP head, its tokenizer and the
    order its captions were trained in."""
    speech = float(model.ncp is not None)
    data = ShapesMultimodalDataModule(
        vocab=model.vocab, layout=MediaLayout.of(model), max_objects=max_objects, text_to_audio_weight=speech,
        audio_to_text_weight=speech, image_context=model.vision_encoder is not None,
        caption_order=caption_order,
    )  # fmt: skip
    data.tokenizer = tokenizer
    data.setup("validate")
    return data


def load_shapes_checkpoint(
    path: str, drawing: bool = False
) -> tuple[UnifiedModel, ShapesMultimodalDataModule]:
    """A `UnifiedPretraining` checkpoint's model (eval mode) and the ShapesWorld datamodule it reads
    (`shapes_world_for`, in the caption order its datamodule stored); with `drawing`, a model with no visual
    tokenizer is refused (`load_drawing_model`)."""
    from zoo.hub import load_lightning_checkpoint
    from zoo.hub.checkpoints import open_checkpoint

    if drawing:
        model, tokenizer = load_drawing_model(path)
    else:
        model, tokenizer = load_lightning_checkpoint(path)
        model.eval()
    stored = open_checkpoint(Path(path)).get(ShapesMultimodalDataModule.__name__, {})
    order = stored.get("caption_order", "attributes_first")  # older checkpoints: the only order
    return model, shapes_world_for(model, tokenizer, caption_order=order)


def shapes_demo_config(path: str) -> tuple[dict, dict]:
    """A ShapesWorld unified config (`configs/demo/multimodal.yaml`) read as the benchmarks build it: the
    `ShapesMultimodalDataModule` arguments (vocabulary and layout constructed) and the model's component
    config, for `zoo.publishing.building.build_from_config`."""
    import yaml

    from zoo.tokenizers.vocab import UnifiedVocab

    config = yaml.safe_load(Path(path).read_text())
    data_args = dict(config["data"]["init_args"])
    data_args["vocab"] = UnifiedVocab(**data_args["vocab"])
    data_args["layout"] = MediaLayout(**data_args["layout"])
    return data_args, config["model"]["init_args"]["model"]


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% interval (normal approximation)."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / max(n - 1, 1)
    return round(mean, 4), round(1.96 * math.sqrt(var / n), 4)


def emit(result: dict[str, object]) -> None:
    """The result as the last stdout line."""
    print(json.dumps(result), flush=True)
