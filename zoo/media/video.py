"""Videos as the zoo's pixels: MP4, WebM, MKV, AVI (FFmpeg, `zoo.media.containers`), animated GIF and a
folder of frames, from a path or bytes, to a target frame rate, frame size and clip length.

Which frames make the clip is `zoo.media.clips` (picked by timestamp from a clip start; a video shorter
than the clip refused or its last frame held); each frame is resized by the `fit` policy of
`zoo.media.resize`. GIFs are read by Pillow so that the frame period `save_gif` records (`zoo frame_ms=`
in the GIF comment) gives back every frame Pillow merged on writing; without it a GIF's rate is its median
frame duration (durations of 10 ms or less play as 100 ms, as in browsers). A folder of frames (PNG, JPEG,
WebP or BMP, in natural name order: frame_2 before frame_10) carries no timing: each file is one clip
frame.
"""

from __future__ import annotations

import io
import re
import statistics
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageSequence
from torch import Tensor

from zoo.media.clips import ClipSpec, ClipStart, Frame, ShortVideo, complete, played_at
from zoo.media.containers import Backend, open_container
from zoo.media.errors import MediaError, MediaSource, describe, existing, is_bytes, warn_once
from zoo.media.images import (
    DEFAULT_MAX_PIXELS,
    PILLOW_ERRORS,
    check_max_pixels,
    decode_image,
    refuse_oversized,
    rgb_array,
    to_pixels,
)
from zoo.media.resize import Fit, Size, check_fit, check_size, fit_frame

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
_GIF_PERIOD = re.compile(r"zoo frame_ms=(\d+)")
_GIF_MAGIC = (b"GIF87a", b"GIF89a")
_SHORTEST_GIF_FRAME_MS = 10


def _natural(path: Path) -> list:
    """Sort key: frame_2.png before frame_10.png."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def _is_gif(source: MediaSource, path: Path | None) -> bool:
    if path is not None:
        with open(path, "rb") as handle:
            return handle.read(6) in _GIF_MAGIC
    return bytes(source[:6]) in _GIF_MAGIC


def _gif_clip(
    source: MediaSource, where: str, spec: ClipSpec, max_pixels: int
) -> tuple[list[np.ndarray], bool]:
    """A GIF's frames with their timestamps from the frame durations, then the clip."""
    frames: list[Frame[np.ndarray]] = []
    try:
        with Image.open(io.BytesIO(bytes(source)) if is_bytes(source) else source) as image:
            refuse_oversized(image.width, image.height, max_pixels, where)
            comment = image.info.get("comment", b"").decode("utf-8", "replace")
            period = _GIF_PERIOD.search(comment)
            time = 0.0
            for frame in ImageSequence.Iterator(image):
                ms = frame.info.get("duration") or 0
                ms = ms if ms > _SHORTEST_GIF_FRAME_MS else 100
                frames.append(Frame(time, ms / 1000, rgb_array(frame.convert("RGBA"), where)))
                time += ms / 1000
    except PILLOW_ERRORS as error:
        if isinstance(error, MediaError):
            raise
        raise MediaError(f"{where}: cannot read video ({error}); expected an intact GIF") from error
    if not frames:
        raise MediaError(f"{where}: empty video, it holds no frames")
    # Pillow merges identical consecutive frames into one longer frame; the recorded period splits them again.
    interval = int(period.group(1)) / 1000 if period else statistics.median(f.duration for f in frames)
    rate = spec.fps or 1 / interval
    first = spec.start_time(0.0, frames[-1].time + frames[-1].duration, rate, where)
    picked, more = played_at(iter(frames), spec.times(first, rate), interval)
    return complete(picked, spec, first, rate, where), more


def _folder_clip(
    folder: Path, spec: ClipSpec, size: Size | None, fit: Fit, max_pixels: int
) -> tuple[list[np.ndarray], bool]:
    """The files of a folder, one clip frame each; only the picked files are decoded."""
    files = sorted((f for f in folder.iterdir() if f.suffix.lower() in FRAME_SUFFIXES), key=_natural)
    where = str(folder)
    if not files:
        raise MediaError(f"{where}: empty video, no frame files ({', '.join(FRAME_SUFFIXES)}) in the folder")
    if spec.fps is not None:
        warn_once(
            "folder fps",
            f"a folder of frames has no timestamps: each file is one clip frame, fps={spec.fps:g} is not "
            f"applied (first: {where}); said once",
        )
    frames = [Frame(float(i), 1.0, f) for i, f in enumerate(files)]
    first = spec.start_time(0.0, float(len(files)), 1.0, where)
    picked, more = played_at(iter(frames), spec.times(first, 1.0), 1.0)
    picked = complete(picked, spec, first, 1.0, where)
    decoded = {f: decode_image(f, size, fit=fit, max_pixels=max_pixels) for f in dict.fromkeys(picked)}
    return [decoded[f] for f in picked], more


def load_video(
    source: MediaSource,
    frames: int | None = None,
    size: Size | None = None,
    *,
    fps: float | None = None,
    start: ClipStart = "start",
    short: ShortVideo = "refuse",
    fit: Fit = "center_crop",
    name: str | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    backend: Backend = "auto",
) -> Tensor:
    """A video clip as float32 [3, T, H, W] in [-1, 1].

    Args:
        source: a path to a video file (MP4, WebM, MKV, AVI, MOV, GIF, ...) or to a folder of frames, or the
            bytes of a video file.
        frames: the clip's length T; None takes every clip frame until the video ends.
        size: resize every frame to size x size, or to (height, width), by `fit`; None keeps the frames'
            own size (they must then agree).
        fps: the clip's frame rate; None reads the video at its own rate (see `zoo.media.clips`).
        start: "start", "centre", or seconds after the first frame: where the clip begins.
        short: a video that ends before the clip: "refuse" (`MediaError`) or "repeat_last".
        fit: "center_crop", "pad" or "stretch" (see `zoo.media.resize`).
        name: what errors call a bytes source (e.g. the WebDataset sample key).
        max_pixels: videos with frames of more pixels are refused before decoding.
        backend: for containers, "auto" (torchcodec when it loads, else PyAV), "pyav" or "torchcodec".

    A clip shorter than the video is said once per process. Refused with `MediaError` naming the source:
    unreadable, undecodable, truncated or zero-frame videos, and videos too short for the clip (unless
    `short="repeat_last"`); a missing path raises `MissingMediaError`.
    """
    spec = ClipSpec(frames, fps, start, short)
    check_size(size)
    check_fit(fit)
    check_max_pixels(max_pixels)
    where = describe(source, name)
    path = None if is_bytes(source) else existing(source, "a video file, a GIF or a folder of frames")
    if path is not None and path.is_dir():
        arrays, more = _folder_clip(path, spec, size, fit, max_pixels)
    elif _is_gif(source, path):
        arrays, more = _gif_clip(source if path is None else path, where, spec, max_pixels)
    else:
        arrays, more = open_container(source, where, max_pixels, backend).read(spec)
    if more:
        warn_once(
            "clip cut",
            f"videos longer than the clip are cut to it ({len(arrays)} frames from start={start!r}; first: "
            f"{where}); said once",
        )
    fitted = {id(a): to_pixels(fit_frame(a, size, fit, where)) for a in arrays}
    clip = [fitted[id(a)] for a in arrays]
    shapes = sorted({tuple(c.shape) for c in clip})
    if len(shapes) > 1:
        raise MediaError(f"{where}: frames differ in size {shapes}; expected one size (or pass size)")
    return torch.stack(clip, dim=1)
