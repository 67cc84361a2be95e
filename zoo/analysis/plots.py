"""Figures of the routing analysis (`zoo.analysis.routing`): expert-share heatmaps per modality with the
normalised entropy per layer, and the IoU of the modalities' top experts per layer. matplotlib, Agg backend
(no display needed); every function returns the figure and optionally writes a PNG."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: the analysis runs on servers and in tests
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from zoo.analysis.routing import TOP_FRACTION, RoutingCounts  # noqa: E402


def heatmap_figure(counts: RoutingCounts, title: str = "Expert activation by modality") -> Figure:
    """One panel per routed modality: layers x experts, colour = share of the modality's assignments in that
    layer (uniform routing is 1/E everywhere). Each row is labelled with the layer's NE for that modality."""
    modalities = counts.modalities()
    if not modalities:
        raise ValueError("no routed tokens were recorded: nothing to plot")
    entropy = counts.entropy()
    n = len(modalities)
    width = max(3.2, 0.28 * counts.n_experts + 1.6)
    fig, axes = plt.subplots(1, n, figsize=(width * n + 0.8, 0.45 * len(counts.layers) + 1.6), squeeze=False)
    vmax = max(float(counts.share(m).max()) for m in modalities)
    image = None
    for ax, m in zip(axes[0], modalities, strict=True):
        share = counts.share(m).numpy()
        image = ax.imshow(share, aspect="auto", cmap="viridis", vmin=0.0, vmax=vmax, interpolation="nearest")
        name = m.name.lower()
        ne_mean = _mean(entropy[name])
        ax.set_title(f"{name} ({int(counts.tokens[m]):,} tokens)\nmean NE {ne_mean:.3f}", fontsize=9)
        ax.set_xlabel("expert", fontsize=8)
        ax.set_yticks(range(len(counts.layers)))
        ax.set_yticklabels(
            [f"L{layer} NE {ne:.2f}" for layer, ne in zip(counts.layers, entropy[name], strict=True)],
            fontsize=7,
        )
        step = 1 if counts.n_experts <= 16 else max(1, counts.n_experts // 8)
        ax.set_xticks(range(0, counts.n_experts, step))
        ax.tick_params(axis="x", labelsize=7)
    fig.colorbar(image, ax=axes[0].tolist(), fraction=0.025, pad=0.02, label="share of assignments")
    ne_all = " ".join(f"{v:.2f}" for v in entropy["all"])
    fig.suptitle(f"{title}\nNE of all tokens per layer: {ne_all}", fontsize=9, y=1.12)
    return fig


def iou_figure(counts: RoutingCounts, fraction: float = TOP_FRACTION, title: str | None = None) -> Figure:
    """Pairs of modalities x layers, each cell the IoU of the two modalities' top experts by load."""
    ious = counts.iou(fraction)
    pairs = list(ious)
    fig, ax = plt.subplots(figsize=(1.1 * len(counts.layers) + 2.6, 0.7 * max(len(pairs), 1) + 1.4))
    title = title or f"IoU of top-{fraction:.0%} experts by load"
    if not pairs:
        ax.text(0.5, 0.5, "one modality only: no pair to compare", ha="center", va="center")
        ax.set_axis_off()
        ax.set_title(title, fontsize=9)
        return fig
    grid = [[(math.nan if v is None else v) for v in ious[p]] for p in pairs]
    chance = counts.iou_chance(fraction)
    ax.imshow(grid, aspect="auto", cmap="magma", vmin=0.0, vmax=1.0, interpolation="nearest")
    for r, row in enumerate(grid):
        for c, value in enumerate(row):
            base = chance[pairs[r]][c]
            text = "n/a" if math.isnan(value) else f"{value:.2f}\n(chance {base:.2f})"
            ax.text(
                c, r, text, ha="center", va="center", fontsize=8, color="white" if value < 0.6 else "black"
            )
    ax.set_xticks(range(len(counts.layers)))
    ax.set_xticklabels([f"L{layer}" for layer in counts.layers], fontsize=8)
    ax.set_yticks(range(len(pairs)))
    ax.set_yticklabels(pairs, fontsize=8)
    ax.set_xlabel("MoE layer", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def save(fig: Figure, path: str | Path, dpi: int = 110) -> Path:
    """Write `fig` as PNG (parent folders created) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return path


def _mean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan
