"""Draws the figures of the docs from the code itself:

.venv/bin/python docs/make_figures.py    # writes docs/group_mask.png and docs/img/sequence_layout.png
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from zoo.batch import PAD_DOC, Modality, group_attention_mask  # noqa: E402
from zoo.datamodules.sequence import (  # noqa: E402
    AudioSegment,
    MediaLayout,
    SequenceBuilder,
    TextSegment,
    VisualSegment,
)
from zoo.tokenizers.vocab import UnifiedVocab  # noqa: E402


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


def sequence_layout_figure(path: Path) -> None:
    """What `SequenceBuilder` makes of one document: caption, image (scales 1, 2, 4), speech (5 frames),
    caption. Rows: modality, group id, and the (t, h, w) Uni-RoPE coordinates of every position."""
    vocab = UnifiedVocab(text_size=64)
    builder = SequenceBuilder(vocab, 40, layout=MediaLayout(visual_scales=(1, 2, 4), audio_hop=4))
    text = [vocab.text_offset + i for i in range(3)]
    document = [
        TextSegment([vocab.bos_id, *text], predict=False),
        VisualSegment(torch.zeros(3, 16, 16)),
        AudioSegment(torch.zeros(20)),
        TextSegment([*text, vocab.eos_id]),
    ]
    batch = builder.collate([document])
    n = int(batch.valid.sum())
    modality = batch.modality[0, :n]
    rows = {
        "group id": batch.group_id[0, :n],
        "t": batch.positions[0, 0, :n],
        "h": batch.positions[1, 0, :n],
        "w": batch.positions[2, 0, :n],
    }
    colours = {Modality.TEXT: "tab:blue", Modality.IMAGE: "tab:orange", Modality.AUDIO: "tab:green"}
    fig, axes = plt.subplots(len(rows) + 1, 1, figsize=(9, 5.2), dpi=120, sharex=True)
    axes[0].bar(range(n), 1, color=[colours[Modality(int(m))] for m in modality], width=1.0)
    axes[0].set_yticks([])
    axes[0].set_title(
        "One document through SequenceBuilder: text (blue), image scales 1x1, 2x2, 4x4 (orange), "
        "audio frames (green)",
        fontsize=9,
    )
    for ax, (name, values) in zip(axes[1:], rows.items(), strict=True):
        ax.step(range(n), values, where="mid", color="black", lw=1)
        ax.scatter(range(n), values, c=[colours[Modality(int(m))] for m in modality], s=8, zorder=3)
        ax.set_ylabel(name, rotation=0, ha="right", va="center")
    axes[-1].set_xlabel("position in the row")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    group_mask_figure(Path(__file__).parent / "group_mask.png")
    sequence_layout_figure(Path(__file__).parent / "img" / "sequence_layout.png")
