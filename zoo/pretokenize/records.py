"""Raw paired samples as `zoo tokenize` reads them: one medium and its caption, from a jsonl manifest line
or a WebDataset tar sample, decoded to the zoo's tensors by `zoo.media`.

The formats are the paired-media datamodule's (issue 14, item 1):
- manifest line: `{"image" | "audio" | "video": path, "caption" | "text": str}`, the path relative to the
  manifest's folder (or absolute);
- tar sample: one media member (jpg/png/webp/..., wav/flac/ogg/..., mp4/webm/gif/...) and the caption in a
  `txt` member or in the `caption`/`text` field of a `json` member.

This reader is small on purpose: the lead will make it and the paired datamodule's share one; what the
rest of `zoo.pretokenize` needs from it is `RawRecord` and `decode`. Every refusal is a `BadSample` (or,
from decoding, a `MediaError`) naming the file and key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from zoo.datamodules.bad_samples import BadSample
from zoo.datamodules.shards import json_record, local_path
from zoo.media import (
    DEFAULT_MAX_PIXELS,
    ClipStart,
    Fit,
    MediaSource,
    ShortVideo,
    kind_of,
    load_audio,
    load_image,
    load_video,
)

MEDIA_KEYS = ("image", "audio", "video")
TEXT_KEYS = ("caption", "text")


@dataclass(frozen=True)
class RawRecord:
    """One paired sample before decoding: where it is, its medium (a path or the bytes of a file) and the
    name errors give that medium, and its caption."""

    source: str
    key: str
    kind: str
    media: MediaSource
    name: str
    text: str


def _caption(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise BadSample(f"{where}: the caption must be a string, got {type(value).__name__}")
    if not value.strip():
        raise BadSample(f"{where}: empty caption; expected the text paired with the medium")
    return value


def manifest_record(sample: dict) -> RawRecord:
    """A `JsonlLines` sample (one manifest line) as a record; paths resolve against the manifest's folder."""
    url, key = str(sample["__url__"]), str(sample["__key__"])
    where = f"{url} {key}"
    line = json_record(sample)
    if "segments" in line:
        raise BadSample(f"{where}: interleaved 'segments' records are not pre-tokenized; give paired records")
    kinds = [k for k in MEDIA_KEYS if k in line]
    if len(kinds) != 1:
        raise BadSample(f"{where}: expected exactly one of {MEDIA_KEYS} keys, got {sorted(line)}")
    kind = kinds[0]
    path = line[kind]
    if not isinstance(path, str) or not path:
        raise BadSample(f"{where}: {kind!r} must be a non-empty path string, got {path!r}")
    texts = [k for k in TEXT_KEYS if k in line]
    if not texts:
        raise BadSample(f"{where}: no caption; expected a 'caption' or 'text' string")
    media = Path(local_path(url)).parent / path
    return RawRecord(url, key, kind, str(media), str(media), _caption(line[texts[0]], where))


def tar_record(sample: dict) -> RawRecord:
    """A `TarSamples` sample as a record: its one media member, its caption from `txt` or `json`."""
    url, key = str(sample["__url__"]), str(sample["__key__"])
    where = f"{url} [{key}]"
    fields = {k: v for k, v in sample.items() if not k.startswith("__")}
    media = [f for f in fields if kind_of(f) is not None]
    if len(media) != 1:
        found = ", ".join(sorted(fields)) or "nothing"
        raise BadSample(
            f"{where}: expected exactly one media member (jpg, png, wav, flac, mp4, ...), got {found}"
        )
    if "txt" in fields:
        try:
            text = bytes(fields["txt"]).decode("utf-8")
        except UnicodeDecodeError as error:
            raise BadSample(f"{where}: the txt member is not UTF-8 ({error.reason})") from None
    elif "json" in fields:
        record = json_record({"__url__": url, "__key__": key, "json": fields["json"]})
        texts = [k for k in TEXT_KEYS if k in record]
        if not texts:
            raise BadSample(f"{where}: no caption: no txt member, and the json has no 'caption' or 'text'")
        text = record[texts[0]]
    else:
        raise BadSample(f"{where}: no caption; expected a txt member or a json one with 'caption'/'text'")
    field = media[0]
    return RawRecord(
        url, key, str(kind_of(field)), fields[field], f"{url}:{key}.{field}", _caption(text, where)
    )


@dataclass(frozen=True)
class DecodeSettings:
    """How media become the tokenizers' inputs (the `zoo.media` policies; the same decoding must feed the
    raw-media datamodule for both paths to give the same documents).

    image_size: side of the visual tokenizer's frames (None: no visual tokenizer, images are refused).
    fit: the resize policy ("center_crop", "pad", "stretch").
    video_frames, video_fps, video_start, short: the clip (`zoo.media.load_video`); None frames: no video.
    sample_rate: the codec's rate (None: no codec, audio is refused).
    max_pixels: the decompression-bomb cap.
    """

    image_size: int | None = None
    fit: Fit = "center_crop"
    video_frames: int | None = None
    video_fps: float | None = None
    video_start: ClipStart = "start"
    short: ShortVideo = "refuse"
    sample_rate: int | None = None
    max_pixels: int = DEFAULT_MAX_PIXELS


def decode(record: RawRecord, settings: DecodeSettings) -> Tensor:
    """The record's medium: pixels [3, S, S], a clip [3, T, S, S] (floats in [-1, 1]) or a mono wave [N]."""
    s = settings
    where = f"{record.source} [{record.key}]"
    if record.kind == "audio":
        if s.sample_rate is None:
            raise BadSample(f"{where}: an audio sample, but no audio codec was given")
        return load_audio(record.media, s.sample_rate, name=record.name)
    if s.image_size is None:
        raise BadSample(
            f"{where}: a{'n image' if record.kind == 'image' else ' video'}, but no visual tokenizer"
        )
    if record.kind == "image":
        return load_image(record.media, s.image_size, fit=s.fit, name=record.name, max_pixels=s.max_pixels)
    if s.video_frames is None:
        raise BadSample(f"{where}: a video, but the visual tokenizer is 2D (videos need a causal 3D one)")
    return load_video(
        record.media, s.video_frames, s.image_size, fps=s.video_fps, start=s.video_start, short=s.short,
        fit=s.fit, name=record.name, max_pixels=s.max_pixels,
    )  # fmt: skip
