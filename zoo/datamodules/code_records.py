"""The code record: one pre-tokenized sample as `zoo tokenize` writes it into a WebDataset tar shard and
`CodeShardSource` reads it back (REFERENCES.md Part C, sections 1 and 5).

A record is three tar members sharing a key (keys never hold a dot: webdataset splits a name at its first):

    <key>.npy    the codes, uint16 (`numpy.save`, read back with allow_pickle=False): an image or video
                 flat in (frame, scale, row, col) order, [frames * sum(s^2)]; audio [frames, levels]
    <key>.txt    the caption, raw UTF-8 (tokenized at load time, so BPE-dropout still draws per epoch)
    <key>.json   what the codes are: {"format", "kind", "source", "key", "codes": {shape, scales, frames,
                 ...}, "tokenizer": {"name", "hash", "config"}}: the medium's kind, where the sample came
                 from (its input file and key there, which make the sample's identity: `sample_id`),
                 the scale schedule, and the fingerprint and configuration of the tokenizer that made
                 the codes (`zoo.fingerprint`)

Codes are the tokenizer's own ids, not unified-vocabulary ids: the offset into `UnifiedVocab` is applied by
the model, so one shard serves any vocabulary layout. No pickle anywhere (no .pyd / .pth members).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from zoo.datamodules.bad_samples import BadSample
from zoo.datamodules.sequence import AudioSegment, VisualSegment

FORMAT = "zoo.codes/1"
CODE_DTYPE = np.uint16
MAX_CODEBOOK = int(np.iinfo(CODE_DTYPE).max) + 1  # 65536 ids fit
TOKENIZER_OF_KIND = {"image": "visual_tokenizer", "video": "visual_tokenizer", "audio": "audio_codec"}


@dataclass(frozen=True)
class CodeRecord:
    """One pre-tokenized sample.

    kind: "image", "video" or "audio". codes: uint16, [frames * sum(s^2)] (visual) or [frames, levels].
    text: the raw caption. source, key: the input file and the sample's key in it. tokenizer_hash,
    tokenizer_config: the tokenizer that made the codes. scales: the visual scale sides (coarse to fine;
    empty for audio). frames: latent frames (visual) or codec frames (audio). info: what else the writer
    recorded (audio: sample_rate, samples; video: fps, clip frames).
    """

    kind: str
    codes: np.ndarray
    text: str
    source: str
    key: str
    tokenizer_hash: str
    tokenizer_config: dict[str, Any]
    scales: tuple[int, ...] = ()
    frames: int = 1
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def tokenizer_name(self) -> str:
        return TOKENIZER_OF_KIND[self.kind]

    def to_sample(self, key: str) -> dict[str, Any]:
        """The tar sample (`webdataset.TarWriter(encoder=False)` writes it): `__key__` and three members."""
        if "." in key:
            raise ValueError(f"a record key must not hold a dot (webdataset splits at the first): {key!r}")
        buffer = io.BytesIO()
        np.save(buffer, np.ascontiguousarray(self.codes, dtype=CODE_DTYPE), allow_pickle=False)
        codes = {"dtype": "uint16", "shape": list(self.codes.shape), "frames": self.frames}
        if self.kind == "audio":
            codes["order"] = "frame, level"
        else:
            codes.update(order="frame, scale, row, col", scales=list(self.scales))
        meta = {
            "format": FORMAT,
            "kind": self.kind,
            "source": self.source,
            "key": self.key,
            "codes": {**codes, **self.info},
            "tokenizer": {
                "name": self.tokenizer_name, "hash": self.tokenizer_hash, "config": self.tokenizer_config
            },
        }  # fmt: skip
        return {
            "__key__": key,
            "npy": buffer.getvalue(),
            "txt": self.text.encode("utf-8"),
            "json": json.dumps(meta, sort_keys=True).encode("utf-8"),
        }

    @classmethod
    def from_sample(cls, sample: dict) -> CodeRecord:
        """A record from a tar sample (`TarSamples`), or `BadSample` naming the shard and key."""
        where = f"{sample.get('__url__', '?')} [{sample.get('__key__', '?')}]"
        missing = [f for f in ("npy", "txt", "json") if f not in sample]
        if missing:
            fields = sorted(k for k in sample if not k.startswith("__"))
            raise BadSample(f"{where}: not a code record: no {', '.join(missing)} member (has {fields})")
        try:
            meta = json.loads(sample["json"])
            text = bytes(sample["txt"]).decode("utf-8")
            codes = np.load(io.BytesIO(sample["npy"]), allow_pickle=False)
        except (ValueError, OSError, EOFError) as error:  # JSON, UTF-8 and npy errors
            raise BadSample(f"{where}: unreadable code record ({error})") from None
        return cls._from_parts(meta, codes, text, where)

    @classmethod
    def _from_parts(cls, meta: Any, codes: np.ndarray, text: str, where: str) -> CodeRecord:
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
            raise BadSample(f"{where}: not a code record of format {FORMAT!r} (got {got!r})")
        kind = meta.get("kind")
        if kind not in TOKENIZER_OF_KIND:
            raise BadSample(f"{where}: unknown kind {kind!r}; expected image, video or audio")
        if codes.dtype != CODE_DTYPE:
            raise BadSample(f"{where}: codes are {codes.dtype}, expected uint16")
        if not isinstance(meta.get("codes"), dict):
            raise BadSample(f"{where}: the record's json has no 'codes' object (shape, scales, frames)")
        info = dict(meta["codes"])
        scales = tuple(int(s) for s in info.pop("scales", ()))
        frames = int(info.pop("frames", 1))
        for known in ("dtype", "shape", "order"):
            info.pop(known, None)
        if kind == "audio":
            if codes.ndim != 2 or codes.shape[0] < 1 or codes.shape[0] != frames:
                raise BadSample(
                    f"{where}: audio codes must be [frames >= 1, levels], got {list(codes.shape)}"
                )
        else:
            per_frame = sum(s * s for s in scales)
            if codes.ndim != 1 or not scales or frames < 1 or codes.shape[0] != frames * per_frame:
                raise BadSample(
                    f"{where}: visual codes {list(codes.shape)} are not {frames} frames of scales {scales}"
                )
        tokenizer = meta.get("tokenizer") or {}
        return cls(
            kind, codes, text, str(meta.get("source", "?")), str(meta.get("key", "?")),
            str(tokenizer.get("hash", "")), tokenizer.get("config") or {}, scales, frames, info,
        )  # fmt: skip

    def segment(self) -> VisualSegment | AudioSegment:
        """The codes as the sequence builder's segment (long ids; `predict` is set by the task)."""
        codes = torch.from_numpy(self.codes.astype(np.int64))
        if self.kind == "audio":
            return AudioSegment(codes=codes)
        return VisualSegment(codes=codes, video=self.kind == "video")
