"""Small real paired corpora for the paired-data tests: images (PIL: a non-square JPEG, a PNG), speech-like
audio (soundfile: FLAC and WAV at other rates, stereo), an MP4 (PyAV), written as a jsonl manifest with its
files and as WebDataset tar shards (webdataset's `TarWriter`) holding the same samples."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import webdataset as wds
from PIL import Image

from zoo.media import save_mp4


@dataclass(frozen=True)
class Item:
    """One sample: its medium's field suffix and encoded bytes, and its caption."""

    suffix: str
    data: bytes
    caption: str

    @property
    def kind(self) -> str:
        return {"jpg": "image", "png": "image", "flac": "audio", "wav": "audio", "mp4": "video"}[self.suffix]


def image_bytes(seed: int, size: tuple[int, int] = (40, 24), format: str = "JPEG") -> bytes:
    """A picture of `size` (width, height): two coloured halves, so a crop or a flip shows."""
    rng = np.random.default_rng(seed)
    array = np.zeros((size[1], size[0], 3), np.uint8)
    array[:, : size[0] // 2] = rng.integers(0, 255, 3)
    array[:, size[0] // 2 :] = rng.integers(0, 255, 3)
    out = io.BytesIO()
    Image.fromarray(array).save(out, format=format)
    return out.getvalue()


def audio_bytes(
    seed: int, seconds: float = 0.4, rate: int = 22050, format: str = "FLAC", channels: int = 1
) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.3 * np.sin(2 * np.pi * (200 + 50 * seed) * t).astype(np.float32)
    out = io.BytesIO()
    sf.write(out, np.stack([wave] * channels, axis=1) if channels > 1 else wave, rate, format=format)
    return out.getvalue()


def video_bytes(folder: Path, seed: int, frames: int = 8) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.rand(3, frames, 32, 48, generator=generator) * 2 - 1
    path = save_mp4(pixels, folder / f"clip{seed}.mp4", fps=4)
    data = path.read_bytes()
    path.unlink()
    return data


def corpus(folder: Path, images: int = 4, audio: int = 3, videos: int = 1) -> list[Item]:
    """Images (JPEG 40x24, every other one a PNG), audio (FLAC 22.05 kHz, every other one stereo WAV 8 kHz)
    and MP4 clips, each with a caption that names it."""
    items = []
    for i in range(images):
        png = i % 2 == 1
        data = image_bytes(i, format="PNG" if png else "JPEG")
        items.append(Item("png" if png else "jpg", data, f"picture {i}"))
    for i in range(audio):
        wav = i % 2 == 1
        data = audio_bytes(i, rate=8000, format="WAV", channels=2) if wav else audio_bytes(i)
        items.append(Item("wav" if wav else "flac", data, f"sound {i}"))
    items += [Item("mp4", video_bytes(folder, i), f"clip {i}") for i in range(videos)]
    return items


def write_manifest(folder: Path, items: list[Item], name: str = "manifest.jsonl") -> Path:
    """The items' files under `folder/media/` and a manifest of them (paths relative to it)."""
    (folder / "media").mkdir(parents=True, exist_ok=True)
    lines = []
    for i, item in enumerate(items):
        relative = f"media/{i:06d}.{item.suffix}"
        (folder / relative).write_bytes(item.data)
        key = "text" if item.kind == "audio" else "caption"
        lines.append({item.kind: relative, key: item.caption})
    path = folder / name
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def write_tar(path: Path, items: list[Item], first: int = 0) -> Path:
    """The items as one WebDataset shard: sample `000123` holds `000123.<suffix>` and `000123.txt`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(path)) as sink:
        for i, item in enumerate(items, start=first):
            sink.write({"__key__": f"{i:06d}", item.suffix: item.data, "txt": item.caption})
    return path


def write_interleaved(folder: Path, documents: int = 2) -> tuple[Path, Path]:
    """Interleaved documents as a manifest (`segments` naming files) and as a tar (a `json` field with the
    segments, each image naming a field of its sample)."""
    (folder / "media").mkdir(parents=True, exist_ok=True)
    lines = []
    tar = folder / "interleaved.tar"
    with wds.TarWriter(str(tar)) as sink:
        for d in range(documents):
            first, second = image_bytes(10 + d), image_bytes(20 + d, format="PNG")
            (folder / f"media/doc{d}a.jpg").write_bytes(first)
            (folder / f"media/doc{d}b.png").write_bytes(second)
            texts = [f"page {d} begins", "then", "the end"]
            lines.append({"segments": [
                {"text": texts[0]}, {"image": f"media/doc{d}a.jpg"}, {"text": texts[1]},
                {"image": f"media/doc{d}b.png"}, {"text": texts[2]},
            ]})  # fmt: skip
            segments = [{"text": texts[0]}, {"image": "0.jpg"}, {"text": texts[1]}, {"image": "1.png"}]
            sink.write({
                "__key__": f"doc{d:04d}", "0.jpg": first, "1.png": second,
                "json": json.dumps({"segments": [*segments, {"text": texts[2]}]}).encode(),
            })  # fmt: skip
    manifest = folder / "interleaved.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return manifest, tar
