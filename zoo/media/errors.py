"""The one error type of the media layer, the sources it reads, and notices said once per process.

Every loader of `zoo.media` reads a *source*: a path (str or `Path`) or the encoded bytes of one file (a
WebDataset sample, an upload to a server). Errors name the source: its path, or the `name` the caller
gives bytes (a sample key such as `shard-0003.tar:000123.jpg`), so a bad sample in a corpus of millions
can be found again.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger("zoo.media")

MediaSource = str | Path | bytes | bytearray | memoryview
"""A path to a media file, or the encoded bytes of one."""

_said: set[str] = set()


class MediaError(ValueError):
    """A media file or sample that cannot be used; the message starts with the file or sample at fault
    and says what was expected."""


class MissingMediaError(MediaError, FileNotFoundError):
    """A media path that does not exist: a `MediaError` (so one handler catches every bad sample) and a
    `FileNotFoundError` (what callers of a file API expect)."""


def warn_once(key: str, message: str) -> None:
    """Log `message` at WARNING level the first time `key` comes up in this process.

    For notices that hold for a whole corpus (resampling, downmixing, cropping to a square): said per file
    they would drown the log, said at INFO nobody would see them (issue 21, item 5).
    """
    if key not in _said:
        _said.add(key)
        log.warning(message)


def reset_notices() -> None:
    """Forget which notices were said, so each is said again once (for tests, and for a tool that reports
    on several corpora in one process)."""
    _said.clear()


def is_bytes(source: MediaSource) -> bool:
    return isinstance(source, bytes | bytearray | memoryview)


def describe(source: MediaSource, name: str | None) -> str:
    """What errors call `source`: `name` when given, else the path, else "<N bytes>"."""
    if name is not None:
        return name
    if is_bytes(source):
        return f"<{len(source)} bytes>"
    return str(source)


def existing(path: str | Path, what: str) -> Path:
    """`path` as a Path, or `MissingMediaError` naming it and `what` was expected there."""
    path = Path(path)
    if not path.exists():
        raise MissingMediaError(f"{path}: no such file; expected {what}")
    return path


def open_source(source: MediaSource, what: str) -> str | BinaryIO:
    """A path string or a binary file object that decoders (Pillow, libsndfile, FFmpeg) accept."""
    if is_bytes(source):
        return io.BytesIO(bytes(source))
    if not isinstance(source, str | Path):
        raise TypeError(f"a media source is a path or bytes, got {type(source).__name__}")
    return str(existing(source, what))
