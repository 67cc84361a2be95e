"""The gallery at a glance: one picture with a row per task, each sample framed by its verifier's verdict.

`write_gallery` saves it as `overview.png` beside `gallery.md`; the README's picture is this file after
`make demo` (`docs/make_figures.py`). Green frame: exact; amber: at least half the attributes right; red:
fewer, or nothing the verifier could read. Understanding rows show the given medium with the model's caption;
generation rows show what the model drew or said (speech as a spectrogram) under the caption it was given.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import torch

from zoo.world.scenes import CaptionScore

EXACT, PARTIAL, WRONG = "#1a9850", "#f0a30a", "#d73027"
CURVE_FILE = "verifier_curve.jsonl"  # what `VerifierCurve` appends to in the run folder; `curve_figure` draws


def verdict_colour(score: CaptionScore | None) -> str:
    if score is None or not score.parsed:
        return WRONG
    if score.exact:
        return EXACT
    return PARTIAL if score.attribute_accuracy >= 0.5 else WRONG


def verdict_text(score: CaptionScore | None) -> str:
    if score is None or not score.parsed:
        return "unreadable"
    return "exact" if score.exact else f"attributes {score.attribute_accuracy:.2f}"


def _picture(media: torch.Tensor | None) -> np.ndarray:
    """An image [3, H, W] or video [3, T, H, W] in [-1, 1] (frames in two rows), or a wave [N] as a
    spectrogram, as an HxWx3 float array in [0, 1]."""
    if media is None:
        return np.zeros((8, 8, 3))
    x = media.detach().float().cpu()
    if x.ndim == 1:
        from zoo.media.writing import spectrogram_rgb

        return spectrogram_rgb(x)
    if x.ndim == 4:  # video: its frames in two rows, left to right (a blank fills an odd count)
        frames = list(x.unbind(1))
        frames += [torch.full_like(frames[0], -1)] * (len(frames) % 2)
        half = len(frames) // 2
        x = torch.cat([torch.cat(frames[:half], dim=-1), torch.cat(frames[half:], dim=-1)], dim=-2)
    return ((x.clamp(-1, 1) + 1) / 2).permute(1, 2, 0).numpy()


def overview_figure(
    samples: list, metrics: dict[str, float], path: str | Path, per_task: int = 8, title: str = ""
) -> Path:
    """Draw `per_task` samples of every task (`multimodal_eval.Sample`s) in one PNG at `path`: a row per
    task under its heading, each cell the medium in a frame of its verdict's colour, the words above it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(s.task for s in samples))
    if not tasks:
        raise ValueError("overview_figure needs at least one sample")
    cell_w, cell_h, heading_h, top_h = 1.5, 1.95, 0.3, 0.55  # inches
    width, height = cell_w * per_task, top_h + len(tasks) * (heading_h + cell_h)
    fig = plt.figure(figsize=(width, height), dpi=80)
    fig.text(0.5, 1 - 0.2 / height, (title + "\n" if title else "")
             + "frames: green exact, amber at least half the attributes, red fewer or unreadable",
             ha="center", va="top", fontsize=8)
    for r, task in enumerate(tasks):
        row_top = height - top_h - r * (heading_h + cell_h)
        exact = metrics.get(f"{task}/exact")
        heading = task + (f"   exact {exact:.2f} over all scenes scored" if exact is not None else "")
        if f"{task}/best_of" in metrics:  # the samples shown were chosen: from how many, and one draw's score
            heading += (f" (the best of {metrics[f'{task}/best_of']:.0f} by its own reading; one sample "
                        f"{metrics[f'{task}/one_sample_exact']:.2f})")
        fig.text(0.1 / width, (row_top - 0.05) / height, heading, fontsize=8, fontweight="bold", va="top")
        for c, sample in enumerate([s for s in samples if s.task == task][:per_task]):
            side = cell_w - 0.25
            ax = fig.add_axes(((c * cell_w + 0.125) / width, (row_top - heading_h - cell_h + 0.08) / height,
                               side / width, side / height))
            speech = sample.media is not None and sample.media.ndim == 1
            ax.imshow(_picture(sample.media), aspect="auto" if speech else "equal", interpolation="nearest")
            understood = task.endswith("_to_text")  # the model wrote the caption; else it was given one
            words = (sample.output or "(empty)") if understood else sample.prompt
            ax.set_title(f"{textwrap.fill(words, 30)}\n{verdict_text(sample.score)}", fontsize=5, pad=2)
            ax.set_xticks([])
            ax.set_yticks([])
            for spine in ax.spines.values():
                spine.set_edgecolor(verdict_colour(sample.score))
                spine.set_linewidth(3)
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def curve_figure(curve: str | Path, path: str | Path) -> Path | None:
    """The verifiers' learning curves (`VerifierCurve`'s JSON lines): per task, exact and attributes (or words
    in place, for speech) against training steps, one panel per task; None when there is no curve file."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = Path(curve)
    if not curve.is_file():
        return None
    points = [json.loads(line) for line in curve.read_text().splitlines() if line.strip()]
    tasks = sorted({k.split("/")[0] for p in points for k in p if k.endswith("/exact")})
    if not points or not tasks:
        return None
    fig, axes = plt.subplots(1, len(tasks), figsize=(2.6 * len(tasks), 2.4), dpi=80, squeeze=False)
    steps = [p["step"] for p in points]
    for ax, task in zip(axes[0], tasks, strict=True):
        for metric, style in (("exact", "-o"), ("attribute_accuracy", "--s"), ("word_accuracy", ":^")):
            values = [p.get(f"{task}/{metric}") for p in points]
            if all(v is not None for v in values):
                ax.plot(steps, values, style, markersize=3, label=metric.replace("_accuracy", ""))
        ax.set_title(task, fontsize=8)
        ax.set_ylim(0, 1)
        ax.set_xlabel("step", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="upper left")
    scenes = points[0].get("scenes", "?")
    fig.suptitle(f"verifiers while training ({scenes} val scenes per point)", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
