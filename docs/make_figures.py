"""Draws the figures of the docs from the code itself:

.venv/bin/python docs/make_figures.py    # group_mask.png, img/sequence_layout.png, img/world_samples.png,
                                         # img/demo_gallery.png (after `make demo`)
"""

import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

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


def world_samples_figure(path: Path) -> None:
    """ShapesWorld in every modality: 8 rendered images (32 px) with captions, one 5-frame video (64 px)
    with its moving objects, and the log-mel spectrogram of a spoken caption with its word boundaries."""
    import torchaudio

    from zoo.world.render import render_image, render_video
    from zoo.world.scenes import ShapesWorld
    from zoo.world.speech import SAMPLE_RATE, render_speech, split_words

    world = ShapesWorld(seed=0, max_objects=4)
    moving = ShapesWorld(seed=0, max_objects=3, include_motion=True)
    fig = plt.figure(figsize=(8.0, 5.0), dpi=100)
    grid = fig.add_gridspec(3, 8, height_ratios=[1.15, 0.85, 1.0])
    for i in range(8):
        scene = world.scene(i, "val")
        ax = fig.add_subplot(grid[0, i])
        ax.imshow(render_image(scene, 32), interpolation="nearest")
        ax.set_title("\nand ".join(p.replace(" at the", "\n at the").replace(" in the", "\n in the")
                                   for p in world.caption(scene).split(" and ")), fontsize=4.5)
        ax.axis("off")
    scene = next(
        s
        for s in moving.scenes("val", 50)
        if sum(o.motion != "still" for o in s.objects) >= 2 and s.index != 0
    )
    video = render_video(scene, frames=5, size=64)
    for t in range(5):
        ax = fig.add_subplot(grid[1, t])
        ax.imshow(video[t], interpolation="nearest")
        ax.set_title(f"frame {t}", fontsize=7)
        ax.axis("off")
    ax = fig.add_subplot(grid[1, 5:])
    ax.text(0, 0.5, "video (64 px):\n" + moving.caption(scene).replace(" and ", "\nand "), fontsize=6.5,
            va="center")
    ax.axis("off")
    text = world.caption(world.scene(0, "val"))
    wave = render_speech(text, seed=0)
    mel = torchaudio.transforms.MelSpectrogram(SAMPLE_RATE, n_fft=512, hop_length=80, n_mels=64)(
        torch.from_numpy(wave)
    )
    ax = fig.add_subplot(grid[2, :])
    seconds = len(wave) / SAMPLE_RATE
    ax.imshow((mel + 1e-6).log().numpy(), origin="lower", aspect="auto", cmap="magma",
              extent=(0, seconds, 0, 64))
    for (start, end), word in zip(split_words(wave), text.split(), strict=True):
        ax.text((start + end) / 2 / SAMPLE_RATE, 60, word, color="white", fontsize=6, ha="center", va="top")
    ax.set_xlabel("seconds")
    ax.set_ylabel("mel band")
    ax.set_title(f'spoken caption "{text}" (log-mel)', fontsize=8)
    fig.tight_layout(pad=0.3, h_pad=0.2)
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=100, format="png")
    plt.close(fig)
    buffer.seek(0)
    # A 256-colour palette keeps the picture small (the docs want < 200 KB per image).
    Image.open(buffer).convert("RGB").quantize(256).save(path, optimize=True)


def demo_gallery_figure(gallery: Path, path: Path) -> None:
    """The README's picture: the gallery's own `overview.png` (every task, verdicts as coloured frames;
    `zoo.tasks.gallery_overview`), as `make demo` wrote it, in a 256-colour palette (skipped without one)."""
    overview = gallery / "overview.png"
    if not overview.is_file():
        print(f"skipped {path.name}: run `make demo` first ({overview} is missing)")
        return
    Image.open(overview).convert("RGB").quantize(256).save(path, optimize=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    group_mask_figure(Path(__file__).parent / "group_mask.png")
    images = Path(__file__).parent / "img"
    sequence_layout_figure(images / "sequence_layout.png")
    world_samples_figure(images / "world_samples.png")
    demo_gallery_figure(Path("runs/demo/multimodal/latest/gallery"), images / "demo_gallery.png")
