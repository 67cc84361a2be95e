"""The frozen visual tokenizer and audio codec as data pipelines run them: fingerprinted, and encoding a
batch exactly as the unified model does (`NFSP.encode`, `NCP.encode`). `zoo tokenize` writes code shards
with them (`zoo.pretokenize`), and `tokenize_in_loader` runs them in the loader's workers
(`zoo.datamodules.loader_tokenizing`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch
from torch import Tensor

from zoo.datamodules.code_records import CODE_DTYPE, MAX_CODEBOOK
from zoo.datamodules.media_samples import MediaSpec
from zoo.datamodules.paired_documents import MediaSupport
from zoo.fingerprint import tokenizer_config, tokenizer_hash
from zoo.models.nfsp import flatten_scales
from zoo.tokenizers.audio import AudioCodec
from zoo.tokenizers.visual import VisualTokenizer


def _uninitialised(codec: AudioCodec) -> list[str]:
    return [name for name, buffer in codec.named_buffers() if name.endswith("initted") and not bool(buffer)]


class FrozenTokenizers:
    """A visual tokenizer and an audio codec (either may be None), frozen, with their fingerprints.

    Refused: codebooks larger than uint16 codes hold, and an audio codec whose k-means codebooks were never
    initialised (it would initialise them from the first batch it encodes, so codes and fingerprint would
    depend on which batch came first).
    """

    def __init__(self, visual: VisualTokenizer | None, audio: AudioCodec | None) -> None:
        if visual is None and audio is None:
            raise ValueError("no tokenizer: give a visual tokenizer, an audio codec, or a model with either")
        largest = {"the visual tokenizer": visual.codebook_size if visual is not None else 0,
                   "the audio codec": max(audio.codebook_sizes) if audio is not None else 0}  # fmt: skip
        for name, size in largest.items():
            if size > MAX_CODEBOOK:
                raise ValueError(f"{name} has {size} codes; code shards hold uint16 (at most {MAX_CODEBOOK})")
        if audio is not None and _uninitialised(audio):
            raise ValueError(
                f"the audio codec's codebooks were never initialised ({', '.join(_uninitialised(audio))}): "
                "an untrained codec with kmeans_init; give trained weights"
            )
        self.visual = visual.requires_grad_(False).eval() if visual is not None else None
        self.audio = audio.requires_grad_(False).eval() if audio is not None else None
        self.records = {
            name: {"hash": tokenizer_hash(m), "config": tokenizer_config(m)}
            for name, m in (("visual_tokenizer", self.visual), ("audio_codec", self.audio))
            if m is not None
        }

    @property
    def support(self) -> MediaSupport:
        """The media these tokenizers take (video: a causal 3D visual tokenizer)."""
        visual = self.visual
        return MediaSupport(
            image=visual is not None,
            video=visual is not None and bool(visual.temporal),
            audio=self.audio is not None,
            context=False,
        )

    def resolve(self, media: MediaSpec) -> MediaSpec:
        """`media` at these tokenizers' sizes, as `PairedDataModule` resolves it for a model holding them;
        a clip length that does not fit the temporal stride is refused before any work."""
        spec = media.resolved(self.visual, self.audio)
        if self.visual is not None and self.visual.temporal:
            self.visual.latent_frames(spec.video_frames)
        return spec

    def summary(self) -> dict[str, dict[str, Any] | None]:
        """Fingerprint and configuration of each tokenizer (None where there is none)."""
        return {name: self.records.get(name) for name in ("visual_tokenizer", "audio_codec")}

    @torch.no_grad()
    def encode_visual(self, pixels: list[Tensor], video: bool) -> list[tuple[np.ndarray, int]]:
        """Flat uint16 codes in (frame, scale, row, col) order and latent frames, per image or clip."""
        assert self.visual is not None
        x = torch.stack(pixels)
        if not video and self.visual.temporal:
            x = x.unsqueeze(2)  # as NFSP.encode: an image is a one-frame video
        codes = self.visual.encode(x)
        frames = codes[0].shape[1]
        flat = flatten_scales(codes).numpy().astype(CODE_DTYPE)
        return [(row, frames) for row in flat]

    @torch.no_grad()
    def encode_audio(self, waves: list[Tensor]) -> list[np.ndarray]:
        """uint16 codes [frames, levels] per wave. Waves of one length are encoded together, each other
        length alone: zero padding would reach into the last frames (NCP.encode encodes one at a time)."""
        assert self.audio is not None
        by_length: dict[int, list[int]] = defaultdict(list)
        for i, wave in enumerate(waves):
            by_length[len(wave)].append(i)
        out: list[np.ndarray | None] = [None] * len(waves)
        for indices in by_length.values():
            codes = self.audio.encode(torch.stack([waves[i] for i in indices]))
            for i, row in zip(indices, codes.numpy().astype(CODE_DTYPE), strict=True):
                out[i] = row
        return out  # type: ignore[return-value]
