"""Decoded media samples: what a paired source's record becomes before it meets a task (issue 14, item 1).

Paired data is made in two stages, so that pre-tokenized code shards can replace raw media later without
touching the documents:

    (a) a source's record  ->  a *media sample*: its text and its media, decoded by `zoo.media` to the
        model's sizes (pixels, waves), or already codes (`VisualSegment(codes=)`, `AudioSegment(codes=)`)
    (b) a media sample + a task  ->  a `Document` (`zoo.datamodules.paired_documents.DocumentMaker`)

This module holds the two kinds of media sample, `MediaSpec` (the decoding settings of stage (a), shared
by `PairedDataModule` and `zoo tokenize`) and `sample_id`. A media sample carries its media as segments;
their `predict` flags mean nothing here: stage (b) sets them from the task.

A sample's identity (`sample_id`) is the name of the file that holds it and its key there: a sample read raw
from a manifest line or a tar member, and its code record that `zoo tokenize` wrote (which records both),
have the same identity, so the per-epoch draws of stage (b) (task, caption dropping, BPE-dropout) that key
on it give both the same document.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import PurePosixPath
from typing import Any, Literal

from zoo.datamodules.bad_samples import BadSample
from zoo.datamodules.sequence import AudioSegment, VisualSegment
from zoo.media import (
    DEFAULT_MAX_PIXELS,
    ClipStart,
    Fit,
    MediaSource,
    ShortVideo,
    load_audio,
    load_image,
    load_video,
)
from zoo.media.kinds import MediaKind

Media = VisualSegment | AudioSegment
SampleKind = Literal["image", "video", "audio", "interleaved"]


@dataclass(frozen=True)
class MediaSpec:
    """How stage (a) decodes media. `None` fields come from the model's tokenizers at setup
    (`resolved_for`); without a model, from the defaults named below.

    Args:
        image_size: side of images and video frames (None: the visual tokenizer's `image_size`, else the
            vision encoder's, else 32).
        fit: how a picture of another aspect ratio meets the square (`zoo.media.resize`): "center_crop",
            "pad" or "stretch".
        max_pixels: images (and video frames) with more pixels are bad samples, refused before decoding.
        video_frames: frames per clip, 1 + temporal_stride * k (None: 1 + the tokenizer's temporal stride).
        fps: the clip's frame rate (None: the video's own rate); videos are read by timestamp at it.
        clip_start: where the clip begins: "start", "centre" or seconds after the first frame.
        short_video: a video that ends before the clip: "refuse" (a bad sample) or "repeat_last".
        sample_rate: audio rate in Hz (None: the audio codec's `sample_rate`, else 16000); other rates are
            resampled (soxr), channels averaged to mono.
    """

    image_size: int | None = None
    fit: Fit = "center_crop"
    max_pixels: int = DEFAULT_MAX_PIXELS
    video_frames: int | None = None
    fps: float | None = None
    clip_start: ClipStart = "start"
    short_video: ShortVideo = "refuse"
    sample_rate: int | None = None

    def __post_init__(self) -> None:
        for name in ("image_size", "video_frames", "sample_rate"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"media.{name} must be None or an int >= 1, got {value!r}")

    def resolved_for(self, model: object | None) -> MediaSpec:
        """Every `None` size filled from `model` (a `UnifiedModel`, or None for the defaults); a size given
        here that differs from the model's tokenizer is refused, naming both."""
        return self.resolved(
            getattr(model, "visual_tokenizer", None),
            getattr(model, "audio_codec", None),
            getattr(model, "vision_encoder", None),
        )

    def resolved(self, visual: Any, codec: Any, encoder: Any = None) -> MediaSpec:
        """`resolved_for` from the components themselves (`zoo tokenize` has tokenizers, not a model)."""
        stride = visual.temporal_stride if visual is not None and visual.temporal else 4
        wanted = {
            "image_size": getattr(visual, "image_size", None) or getattr(encoder, "image_size", None),
            "sample_rate": getattr(codec, "sample_rate", None),
        }
        for name, theirs in wanted.items():
            mine = getattr(self, name)
            if mine is not None and theirs is not None and mine != theirs:
                raise ValueError(
                    f"data media.{name}={mine} differs from the model's tokenizer ({theirs}): leave it out "
                    "(null) to take the model's, or give the model's value"
                )
        return replace(
            self,
            image_size=self.image_size or wanted["image_size"] or 32,
            sample_rate=self.sample_rate or wanted["sample_rate"] or 16000,
            video_frames=self.video_frames or 1 + stride,
        )


def sample_id(source: str, key: str) -> str:
    """A sample's identity for its draws: the name of the file that holds it (not its folder, which moves
    between machines) and its key there (a tar key, or `line N` of a manifest)."""
    return f"{PurePosixPath(str(source)).name}#{key}"


@dataclass(frozen=True)
class PairedSample:
    """A text and one medium: an image or a video (`VisualSegment`, pixels or codes) or a clip of audio
    (`AudioSegment`, wave or codes). `name` is where the sample lives (file and key), for messages;
    `identity` what its draws key on (`sample_id`; every source sets it)."""

    name: str
    caption: str
    media: Media
    identity: str = ""

    @property
    def kind(self) -> SampleKind:
        if isinstance(self.media, AudioSegment):
            return "audio"
        return "video" if self.media.is_video else "image"


@dataclass(frozen=True)
class InterleavedSample:
    """Texts and media in document order (a web page with its pictures, a story with its clips); `name`
    and `identity` as for `PairedSample`."""

    name: str
    parts: tuple[str | Media, ...]
    identity: str = ""

    @property
    def kind(self) -> SampleKind:
        return "interleaved"


MediaSample = PairedSample | InterleavedSample


def decode_media(kind: MediaKind, source: MediaSource, spec: MediaSpec, name: str | None = None) -> Media:
    """One file (a path or its bytes) as a segment at the sizes of a resolved `spec`; `MediaError` naming
    `name` (or the path) when it cannot be used."""
    if spec.image_size is None or spec.sample_rate is None or spec.video_frames is None:
        raise ValueError("decode_media needs a resolved MediaSpec (MediaSpec.resolved_for)")
    if kind == "audio":
        return AudioSegment(load_audio(source, spec.sample_rate, name=name))
    if kind == "video":
        clip = load_video(
            source, spec.video_frames, spec.image_size, fps=spec.fps, start=spec.clip_start,
            short=spec.short_video, fit=spec.fit, name=name, max_pixels=spec.max_pixels,
        )  # fmt: skip
        return VisualSegment(clip)
    if kind == "image":
        return VisualSegment(
            load_image(source, spec.image_size, fit=spec.fit, name=name, max_pixels=spec.max_pixels)
        )
    raise ValueError(f"unknown media kind {kind!r}; expected image, video or audio")


def checked_text(value: object, where: str, what: str = "caption") -> str:
    """`value` as a usable text; `BadSample` naming `where` for a missing, non-string or blank one."""
    if not isinstance(value, str):
        got = "nothing" if value is None else type(value).__name__
        raise BadSample(f"{where}: expected a {what} string, got {got}")
    if not value.strip():
        raise BadSample(f"{where}: empty {what}; expected some text")
    return value
