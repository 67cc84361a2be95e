"""The media parts of a chat request as files: data URLs and base64 audio decoded, checked against the
server's limits (`MediaLimits`). What a conversation becomes for the model (the chat format, or the plain
layout of a model without role tokens) is `zoo.datamodules.chat`'s, through `Pipeline.conversation_batch`.

Media parts come as data, never as addresses (the server fetches nothing): an image as a `data:` URL of
base64 PNG/JPEG/WebP/GIF, audio as base64 WAV/FLAC/MP3 (`input_audio`).
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Literal

import soundfile as sf

MediaKind = Literal["image", "audio"]


class PartError(ValueError):
    """A media part this server cannot read. param: the request field at fault (OpenAI's `param`);
    status: 400, or 413 for a payload over its size limit."""

    def __init__(self, message: str, param: str, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


@dataclass(frozen=True)
class MediaPart:
    """An image or audio part as its file's bytes. where: the request field it came from."""

    kind: MediaKind
    data: bytes
    where: str


@dataclass(frozen=True)
class MediaLimits:
    """max_image_bytes, max_audio_bytes: largest decoded file (413 past it); max_audio_seconds: longest
    audio input (400 past it)."""

    max_image_bytes: int = 10 * 2**20
    max_audio_bytes: int = 25 * 2**20
    max_audio_seconds: float = 30.0


def image_from_data_url(url: str, where: str, limits: MediaLimits) -> MediaPart:
    """An `image_url` part's `data:image/...;base64,...` URL as the image file's bytes."""
    if not url.startswith("data:"):
        raise PartError(
            f"{where}: only data URLs (data:image/png;base64,...) are read; this server fetches nothing",
            where,
        )
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64") or not header[5:].startswith("image/"):
        raise PartError(
            f"{where}: expected data:image/<png|jpeg|webp|gif>;base64,<data>; got {header!r}", where
        )
    data = decode_base64(payload, where, limits.max_image_bytes)
    return MediaPart("image", data, where)


def audio_from_base64(data: str, audio_format: str, where: str, limits: MediaLimits) -> MediaPart:
    """An `input_audio` part's base64 file as its bytes, refused past the length limit."""
    raw = decode_base64(data, where, limits.max_audio_bytes)
    check_audio_length(raw, where, limits, audio_format)
    return MediaPart("audio", raw, where)


def check_audio_length(raw: bytes, where: str, limits: MediaLimits, audio_format: str = "") -> None:
    try:
        info = sf.info(io.BytesIO(raw))
    except (sf.LibsndfileError, RuntimeError, TypeError) as error:
        said = f" (said to be {audio_format})" if audio_format else ""
        raise PartError(f"{where}: cannot read the audio{said}: {error}", where) from None
    if info.duration > limits.max_audio_seconds:
        raise PartError(
            f"{where}: the audio lasts {info.duration:.1f} s; this server reads at most "
            f"{limits.max_audio_seconds:g} s",
            where,
        )


def decode_base64(payload: str, where: str, max_bytes: int) -> bytes:
    if len(payload) * 3 // 4 > max_bytes + 2:  # checked before decoding: no oversized allocation
        raise PartError(
            f"{where}: the payload is about {len(payload) * 3 // 4:,} bytes; this server takes at most "
            f"{max_bytes:,}",
            where,
            status=413,
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise PartError(f"{where}: not valid base64 ({error})", where) from None
