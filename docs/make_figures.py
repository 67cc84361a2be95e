"""Draws the figures of the docs from the code itself:

.venv/bin/python docs/make_figures.py    # writes docs/group_mask.png
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from zoo.batch import PAD_DOC, group_attention_mask  # noqa: E402


def group_mask_figure(path: Path) -> None:
    """One packed row: a caption (1 token per group), an image as two scales (1x1, then 2x2 = 4 positions
    in one group), two audio frames, then a second document and padding."""
    labels = ["t", "t", "t", "s1", "s2", "s2", "s2", "s2", "a", "a", "t", "t", "t", "pad", "pad"]
    group = [0, 1, 2, 3, 4, 4, 4, 4, 5, 6, 0, 1, 2, 0, 0]
    doc = [0] * 10 + [1, 1, 1] + [PAD_DOC, PAD_DOC]
    g, d = torch.tensor([group]), torch.tensor([doc])
    mask = group_attention_mask(d, g, d, g, query_offset=0)[0, 0].float()
    ticks = [f"{lab} g{gi} d{di}" for lab, gi, di in zip(labels, group, doc, strict=True)]
    fig, ax = plt.subplots(figsize=(6.4, 6.0), dpi=120)
    ax.imshow(mask, cmap="Blues", vmin=0, vmax=1.3)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_yticks(range(len(labels)), ticks, fontsize=7)
    ax.set_xlabel("key position")
    ax.set_ylabel("query position (label, group id, document id)")
    ax.set_title(
        "Group attention mask: same document, key group <= query group\n"
        "t text token, s1/s2 image scales (1x1, 2x2), a audio frame",
        fontsize=9,
    )
    for i in range(len(labels) + 1):
        ax.axhline(i - 0.5, color="white", lw=0.5)
        ax.axvline(i - 0.5, color="white", lw=0.5)
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    group_mask_figure(Path(__file__).parent / "group_mask.png")
