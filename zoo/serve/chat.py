"""A conversation laid out as one prompt: the PROVISIONAL chat rule of `zoo serve`.

The unified vocabulary has no role tokens yet and no model has been trained on conversations (issue 16,
item 2: roles, a chat template, the SFT format, not done). Until then a conversation becomes what the
pipeline already understands, by one plain-text rule:

- the text of every turn (system, developer, user and earlier assistant turns alike), in order, joined by
  a newline: the roles themselves are not written (the model would read them as ordinary words);
- at most one image or audio part in the whole conversation: it becomes the pipeline's media prompt (the
  captioning / transcription document training made), the joined text its prompt;
- the answer continues that text (or follows the medium).

Media parts come as data, never as addresses (the server fetches nothing): an image as a `data:` URL of
base64 PNG/JPEG/WebP/GIF, audio as base64 WAV/FLAC/MP3 (`input_audio`). When the chat format lands this
module is the one place to change; the HTTP layer only hands it the messages.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Literal

import soundfile as sf

MediaKind = Literal["image", "audio"]


class ChatError(ValueError):
    """A conversation this rule cannot lay out. param: the request field at fault (OpenAI's `param`);
    status: 400, or 413 for a payload over its size limit."""

    def __init__(self, message: str, param: str, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class MediaPart:
    """An image or audio part as its file's bytes. where: the request field it came from."""

    kind: MediaKind
    data: bytes
    where: str


@dataclass(frozen=True)
class Turn:
    role: str
    parts: tuple[TextPart | MediaPart, ...]


@dataclass(frozen=True)
class Prompt:
    """What the pipeline is asked: the text, and the one medium (or none) with where it came from."""

    text: str
    media: MediaPart | None = None


@dataclass(frozen=True)
class MediaLimits:
    """max_image_bytes, max_audio_bytes: largest decoded file (413 past it); max_audio_seconds: longest
    audio input (400 past it)."""

    max_image_bytes: int = 10 * 2**20
    max_audio_bytes: int = 25 * 2**20
    max_audio_seconds: float = 30.0


def lay_out(turns: list[Turn]) -> Prompt:
    """The provisional rule (module docstring): the turns' texts joined by newlines, at most one medium."""
    if not turns:
        raise ChatError("messages is empty: expected at least one message", "messages")
    texts, media = [], []
    for turn in turns:
        for part in turn.parts:
            if isinstance(part, MediaPart):
                media.append(part)
            elif part.text:
                texts.append(part.text)
    if len(media) > 1:
        where = ", ".join(m.where for m in media)
        raise ChatError(
            f"{len(media)} media parts ({where}): this server reads at most one image or audio part per "
            "conversation for now",
            media[1].where,
        )
    return Prompt("\n".join(texts), media[0] if media else None)


def image_from_data_url(url: str, where: str, limits: MediaLimits) -> MediaPart:
    """An `image_url` part's `data:image/...;base64,...` URL as the image file's bytes."""
    if not url.startswith("data:"):
        raise ChatError(
            f"{where}: only data URLs (data:image/png;base64,...) are read; this server fetches nothing",
            where,
        )
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64") or not header[5:].startswith("image/"):
        raise ChatError(
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
        raise ChatError(f"{where}: cannot read the audio{said}: {error}", where) from None
    if info.duration > limits.max_audio_seconds:
        raise ChatError(
            f"{where}: the audio lasts {info.duration:.1f} s; this server reads at most "
            f"{limits.max_audio_seconds:g} s",
            where,
        )


def decode_base64(payload: str, where: str, max_bytes: int) -> bytes:
    if len(payload) * 3 // 4 > max_bytes + 2:  # checked before decoding: no oversized allocation
        raise ChatError(
            f"{where}: the payload is about {len(payload) * 3 // 4:,} bytes; this server takes at most "
            f"{max_bytes:,}",
            where,
            status=413,
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ChatError(f"{where}: not valid base64 ({error})", where) from None
