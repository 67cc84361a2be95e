"""Which kind of media a file or a WebDataset field holds, by its suffix (or key: `jpg`, `flac`, `mp4`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

MediaKind = Literal["image", "video", "audio"]

IMAGE_SUFFIXES = ("png", "jpg", "jpeg", "webp", "bmp", "tif", "tiff", "ppm", "pgm")
VIDEO_SUFFIXES = ("mp4", "webm", "mkv", "avi", "mov", "m4v", "gif")
AUDIO_SUFFIXES = ("wav", "flac", "ogg", "oga", "opus", "mp3")


def kind_of(name: str | Path) -> MediaKind | None:
    """ "image", "video" or "audio" for a file name (`a.JPG`), a suffix (`.flac`) or a WebDataset key (`mp4`);
    a folder is a video (of frame files); None for anything else. An animated GIF counts as a video."""
    path = Path(name)
    text = str(name).lower()
    suffix = path.suffix.lower().lstrip(".") if path.suffix else text.lstrip(".").rsplit(".", 1)[-1]
    if suffix in VIDEO_SUFFIXES:
        return "video"
    if suffix in AUDIO_SUFFIXES:
        return "audio"
    if suffix in IMAGE_SUFFIXES:
        return "image"
    return "video" if path.is_dir() else None
