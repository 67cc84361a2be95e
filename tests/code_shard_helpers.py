"""What the pre-tokenization tests share: tiny untrained tokenizers saved as real files (configs and
safetensors), a small paired corpus of real media files (PNG, JPEG, WAV, FLAC, MP4) in a jsonl manifest
and in WebDataset tar shards, each with a few bad samples, a BPE text tokenizer (merges, so BPE-dropout
has something to drop) and a unified model that holds the tokenizers.

The tokenizers are random: codes need not be good, only the same on both paths.
"""

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

from zoo.config import to_config
from zoo.media import save_mp4
from zoo.models.backbone import UnifiedTransformer
from zoo.models.unified import UnifiedModel
from zoo.pretokenize import FrozenTokenizers, load_component
from zoo.tokenizers.audio import AudioCodec
from zoo.tokenizers.text import TextTokenizer
from zoo.tokenizers.visual import VisualTokenizer
from zoo.tokenizers.visual_quantizer import MultiScaleQuantizer
from zoo.tokenizers.vocab import UnifiedVocab
from zoo.weights import save_weights_file

SCALES = (1, 2, 4, 8)
STRIDE = 2  # clips of 1 + 2 = 3 frames
VOCAB = UnifiedVocab(text_size=320, visual_size=64, audio_size=32, audio_levels=2)


@dataclass(frozen=True)
class TokenizerFiles:
    visual_config: Path
    visual_weights: Path
    audio_config: Path
    audio_weights: Path

    def args(self) -> list[str]:
        return [
            "--visual_tokenizer", str(self.visual_config), "--visual_weights", str(self.visual_weights),
            "--audio_codec", str(self.audio_config), "--audio_weights", str(self.audio_weights),
        ]  # fmt: skip

    def load(self) -> tuple[VisualTokenizer, AudioCodec]:
        visual = load_component(str(self.visual_config), VisualTokenizer, str(self.visual_weights))
        audio = load_component(str(self.audio_config), AudioCodec, str(self.audio_weights))
        return visual, audio

    def frozen(self) -> FrozenTokenizers:
        return FrozenTokenizers(*self.load())


def write_tokenizers(folder: Path, seed: int = 0) -> TokenizerFiles:
    """A causal 3D visual tokenizer (images and 3-frame clips) and a 2-level codec, as config + weights."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    quantizer = MultiScaleQuantizer(dim=8, codebook_size=64, scales=SCALES)
    visual = VisualTokenizer(32, (8, 16, 16), 1, quantizer, temporal=True, temporal_stride=STRIDE)
    audio = AudioCodec(
        channels=4, max_channels=16, latent_dim=16, codebook_sizes=(32, 32), codebook_dim=8, kmeans_init=False
    )
    files = TokenizerFiles(folder / "visual.json", folder / "visual.safetensors",
                           folder / "audio.yaml", folder / "audio.safetensors")  # fmt: skip
    files.visual_config.write_text(json.dumps(to_config(visual)))
    files.audio_config.write_text(json.dumps({"model": {"init_args": {"codec": to_config(audio)}}}))
    save_weights_file(visual, files.visual_weights)
    save_weights_file(audio, files.audio_weights)
    return files


def write_text_tokenizer(path: Path, texts: list[str]) -> Path:
    """A BPE tokenizer JSON trained on `texts` (repeated, so that their pairs merge)."""
    TextTokenizer.train(texts * 4, vocab_size=VOCAB.text_size).save(path)
    return path


def unified_model(files: TokenizerFiles) -> UnifiedModel:
    torch.manual_seed(1)
    visual, audio = files.load()
    backbone = UnifiedTransformer(
        dim=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, expert_hidden=16, top_k=2, max_seq_len=512
    )
    return UnifiedModel(backbone, VOCAB, mtp_depth=0, visual_tokenizer=visual, audio_codec=audio)


# --- media files ------------------------------------------------------------------------------------


def image_bytes(seed: int, fmt: str = "PNG", size: tuple[int, int] = (40, 48), mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, format=fmt)
    return buffer.getvalue()


def audio_bytes(seed: int, fmt: str = "WAV", rate: int = 22050, seconds: float = 0.5) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    wave = 0.3 * np.sin(2 * np.pi * (220 + 40 * seed) * t) + 0.05 * np.random.default_rng(
        seed
    ).standard_normal(len(t))
    buffer = io.BytesIO()
    sf.write(buffer, wave.astype(np.float32), rate, format=fmt)
    return buffer.getvalue()


def video_bytes(folder: Path, seed: int, frames: int = 6) -> bytes:
    clip = torch.rand(3, frames, 32, 32, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    path = save_mp4(clip, folder / f"clip-{seed}.mp4", fps=4.0)
    data = path.read_bytes()
    path.unlink()
    return data


@dataclass(frozen=True)
class Corpus:
    """A manifest and tar shards of the same kinds of samples; `good`/`bad`: how many of each."""

    manifest: Path
    shards: list[Path]
    manifest_good: int
    manifest_bad: tuple[str, ...]  # what each bad manifest line's failure names
    shard_good: int
    shard_bad: tuple[str, ...]


def write_corpus(folder: Path) -> Corpus:
    media = folder / "media"
    media.mkdir(parents=True, exist_ok=True)
    files = {
        "a.png": image_bytes(0),
        "b.jpg": image_bytes(1, "JPEG", (64, 40)),
        "c.png": image_bytes(2, mode="L"),
        "s.wav": audio_bytes(0),
        "t.flac": audio_bytes(1, "FLAC", rate=16000, seconds=0.4),
        "v.mp4": video_bytes(media, 0),
        "broken.png": image_bytes(3)[:60],  # truncated
    }
    for name, data in files.items():
        (media / name).write_bytes(data)
    lines = [
        {"image": "media/a.png", "caption": "a red square"},
        {"image": "media/b.jpg", "text": "a photo"},
        {"audio": "media/s.wav", "text": "hello there"},
        {"video": "media/v.mp4", "caption": "it moves"},
        {"image": "media/broken.png", "caption": "cut off"},
        {"audio": "media/t.flac", "caption": "a tone"},
        {"image": "media/missing.png", "caption": "never written"},
        {"image": "media/c.png", "caption": ""},
        {"image": str((media / "c.png").resolve()), "caption": "grey, by absolute path"},
    ]
    manifest = folder / "pairs.jsonl"
    text = "".join(json.dumps(line) + "\n" for line in lines) + "{not json\n"
    manifest.write_text(text)
    shards = [folder / "shards" / "train-000.tar", folder / "shards" / "train-001.tar"]
    shards[0].parent.mkdir(exist_ok=True)
    with wds.TarWriter(str(shards[0])) as sink:
        sink.write({"__key__": "p0", "jpg": image_bytes(4, "JPEG"), "txt": "a jpeg in a shard"})
        sink.write(
            {"__key__": "p1", "wav": audio_bytes(2), "json": json.dumps({"caption": "speech"}).encode()}
        )
        sink.write({"__key__": "p2", "png": b"\x89PNG not really", "txt": "corrupt"})
        sink.write({"__key__": "p3", "mp4": files["v.mp4"], "txt": "a clip"})
    with wds.TarWriter(str(shards[1])) as sink:
        sink.write({"__key__": "q0", "flac": audio_bytes(3, "FLAC", rate=16000), "txt": "more speech"})
        sink.write({"__key__": "q1", "txt": "no media at all"})
        sink.write({"__key__": "q2", "png": image_bytes(5), "txt": "last"})
    return Corpus(
        manifest, shards, 6, ("broken.png", "missing.png", "empty caption", "invalid JSON"),
        5, ("p2", "q1"),
    )  # fmt: skip
