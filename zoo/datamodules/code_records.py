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

An interleaved document (texts and media in any order) is one record too (`InterleavedRecord`):

    <key>.json   {"format", "kind": "interleaved", "source", "key", "parts": [{"text": ...} or {"medium": i}],
                 "media": [what each medium's json above holds: kind, codes, tokenizer]}
    <key>.txt    its texts, one a line (what tokenizer training reads)
    <key>.<i>.npy   the codes of medium i

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
        check_key(key)
        meta = {"format": FORMAT, "source": self.source, "key": self.key, **self.medium_meta()}
        return {
            "__key__": key,
            "npy": self.npy(),
            "txt": self.text.encode("utf-8"),
            "json": json.dumps(meta, sort_keys=True).encode("utf-8"),
        }

    def npy(self) -> bytes:
        buffer = io.BytesIO()
        np.save(buffer, np.ascontiguousarray(self.codes, dtype=CODE_DTYPE), allow_pickle=False)
        return buffer.getvalue()

    def medium_meta(self) -> dict[str, Any]:
        """What the json says of the codes: kind, their shape and order, the tokenizer that made them."""
        codes = {"dtype": "uint16", "shape": list(self.codes.shape), "frames": self.frames}
        if self.kind == "audio":
            codes["order"] = "frame, level"
        else:
            codes.update(order="frame, scale, row, col", scales=list(self.scales))
        return {
            "kind": self.kind,
            "codes": {**codes, **self.info},
            "tokenizer": {
                "name": self.tokenizer_name, "hash": self.tokenizer_hash, "config": self.tokenizer_config
            },
        }  # fmt: skip

    @classmethod
    def from_sample(cls, sample: dict) -> CodeRecord:
        """A record of one medium from a tar sample (`TarSamples`); `BadSample` naming the shard and key."""
        record = read_record(sample)
        if not isinstance(record, CodeRecord):
            raise BadSample(f"{where_of(sample)}: an interleaved record, not a record of one medium")
        return record

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


@dataclass(frozen=True)
class InterleavedRecord:
    """One pre-tokenized interleaved document: its texts and its media (`CodeRecord`s with no text) in
    order. source, key: the input file and the sample's key in it."""

    parts: tuple[str | CodeRecord, ...]
    source: str
    key: str

    @property
    def kind(self) -> str:
        return "interleaved"

    @property
    def media(self) -> list[CodeRecord]:
        return [p for p in self.parts if isinstance(p, CodeRecord)]

    @property
    def texts(self) -> list[str]:
        return [p for p in self.parts if isinstance(p, str)]

    def to_sample(self, key: str) -> dict[str, Any]:
        check_key(key)
        parts, media, sample = [], [], {"__key__": key}
        for part in self.parts:
            if isinstance(part, str):
                parts.append({"text": part})
            else:
                parts.append({"medium": len(media)})
                sample[f"{len(media)}.npy"] = part.npy()
                media.append(part.medium_meta())
        meta = {"format": FORMAT, "kind": "interleaved", "source": self.source, "key": self.key,
                "parts": parts, "media": media}  # fmt: skip
        sample["txt"] = "\n".join(self.texts).encode("utf-8")
        sample["json"] = json.dumps(meta, sort_keys=True).encode("utf-8")
        return sample

    def segments(self) -> tuple[str | VisualSegment | AudioSegment, ...]:
        """The parts as an interleaved sample's: texts, and media as the sequence builder's segments."""
        return tuple(p if isinstance(p, str) else p.segment() for p in self.parts)


def check_key(key: str) -> None:
    if "." in key:
        raise ValueError(f"a record key must not hold a dot (webdataset splits at the first): {key!r}")


def where_of(sample: dict) -> str:
    return f"{sample.get('__url__', '?')} [{sample.get('__key__', '?')}]"


def _load_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def read_record(sample: dict) -> CodeRecord | InterleavedRecord:
    """A code record from a tar sample (`TarSamples`), or `BadSample` naming the shard and key."""
    where = where_of(sample)
    missing = [f for f in ("txt", "json") if f not in sample]
    if missing:
        fields = sorted(k for k in sample if not k.startswith("__"))
        raise BadSample(f"{where}: not a code record: no {', '.join(missing)} member (has {fields})")
    try:
        meta = json.loads(sample["json"])
        text = bytes(sample["txt"]).decode("utf-8")
    except (ValueError, OSError) as error:  # JSON and UTF-8 errors
        raise BadSample(f"{where}: unreadable code record ({error})") from None
    if isinstance(meta, dict) and meta.get("kind") == "interleaved":
        return _interleaved(sample, meta, where)
    if "npy" not in sample:
        fields = sorted(k for k in sample if not k.startswith("__"))
        raise BadSample(f"{where}: not a code record: no npy member (has {fields})")
    try:
        codes = _load_npy(sample["npy"])
    except (ValueError, OSError, EOFError) as error:
        raise BadSample(f"{where}: unreadable code record ({error})") from None
    return CodeRecord._from_parts(meta, codes, text, where)


def _interleaved(sample: dict, meta: dict, where: str) -> InterleavedRecord:
    if meta.get("format") != FORMAT:
        raise BadSample(f"{where}: not a code record of format {FORMAT!r} (got {meta.get('format')!r})")
    parts_meta, media_meta = meta.get("parts"), meta.get("media")
    if not isinstance(parts_meta, list) or not isinstance(media_meta, list) or not parts_meta:
        raise BadSample(f"{where}: an interleaved record needs a non-empty 'parts' list and a 'media' list")
    source, key = str(meta.get("source", "?")), str(meta.get("key", "?"))
    parts: list[str | CodeRecord] = []
    for i, part in enumerate(parts_meta):
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            parts.append(part["text"])
            continue
        number = part.get("medium") if isinstance(part, dict) else None
        if not isinstance(number, int) or not 0 <= number < len(media_meta):
            raise BadSample(f"{where}: part {i} is neither a text nor one of the {len(media_meta)} media")
        member = f"{number}.npy"
        if not isinstance(media_meta[number], dict):
            raise BadSample(f"{where}: medium {number} is described by {media_meta[number]!r}, not an object")
        if member not in sample:
            raise BadSample(f"{where}: medium {number} has no {member} member")
        try:
            codes = _load_npy(sample[member])
        except (ValueError, OSError, EOFError) as error:
            raise BadSample(f"{where}: unreadable codes of medium {number} ({error})") from None
        medium = {"format": FORMAT, "source": source, "key": key, **media_meta[number]}
        parts.append(CodeRecord._from_parts(medium, codes, "", f"{where} medium {number}"))
    return InterleavedRecord(tuple(parts), source, key)
