"""Video containers (MP4, WebM, MKV, AVI, MOV, ...) decoded by FFmpeg: PyAV always, torchcodec when it loads
(REFERENCES.md Part C section 7).

PyAV's wheel bundles FFmpeg, so it always works; torchcodec needs a system FFmpeg 4-9 and is used only when
installed and loadable (`backend="auto"`). `torchvision.io.read_video` no longer exists (torchvision 0.26).
Both backends give a clip of uint8 [H, W, 3] frames picked by `zoo.media.clips`, upright (the container's
display rotation applied, as EXIF orientation is for photos). Decoders are opened per call, so a
DataLoader worker never shares one; inside a worker FFmpeg decodes on one thread, elsewhere on as many as
it likes.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Literal

import av
import numpy as np

from zoo.media.clips import TIMESTAMP_SLACK, ClipSpec, Frame, complete, played_at
from zoo.media.errors import MediaError, MediaSource, is_bytes, open_source, warn_once
from zoo.media.images import refuse_oversized

Backend = Literal["auto", "pyav", "torchcodec"]
_SEEK_AFTER = 1.0  # seconds: closer starts are cheaper to decode from the beginning than to seek


def _in_worker() -> bool:
    from torch.utils.data import get_worker_info

    return get_worker_info() is not None


def _upright(array: np.ndarray, rotation: int) -> np.ndarray:
    """Apply a display rotation (degrees counterclockwise, FFmpeg's display matrix)."""
    quarter = round(rotation / 90) % 4
    return np.ascontiguousarray(np.rot90(array, k=quarter)) if quarter else array


class PyAVClip:
    """One container opened with PyAV; `read` decodes a clip from it."""

    def __init__(self, source: MediaSource, where: str, max_pixels: int) -> None:
        self.where = where
        try:
            self.container = av.open(open_source(source, "a video file"), mode="r")
        except (av.FFmpegError, OSError, ValueError, IndexError) as error:
            raise MediaError(
                f"{where}: cannot read video ({error}); expected an intact MP4/WebM/MKV/AVI file, a GIF or a "
                "folder of frames"
            ) from error
        try:
            self._describe(max_pixels)
        except MediaError:
            self.container.close()
            raise
        self.decoded_end, self.decoded = self.begin, 0

    def _describe(self, max_pixels: int) -> None:
        """The stream's header facts: first time, nominal rate, declared duration; the pixel cap."""
        if not self.container.streams.video:
            raise MediaError(f"{self.where}: no video stream (an empty, truncated or audio-only file)")
        self.stream = stream = self.container.streams.video[0]
        stream.thread_type = "AUTO"
        stream.codec_context.thread_count = 1 if _in_worker() else 0
        refuse_oversized(stream.codec_context.width, stream.codec_context.height, max_pixels, self.where)
        self.begin = float(stream.start_time * stream.time_base) if stream.start_time is not None else 0.0
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        self.rate = float(rate) if rate else None
        if stream.duration is not None:
            self.declared: float | None = float(stream.duration * stream.time_base)
        elif self.container.duration is not None:
            self.declared = self.container.duration / av.time_base
        else:
            self.declared = None

    def _frames(self, from_time: float, interval: float) -> Iterator[Frame[av.VideoFrame]]:
        """Decoded frames in order, starting at or before `from_time` (seeking when it is worth it)."""
        seeked = from_time - self.begin > _SEEK_AFTER
        if seeked:
            try:
                self.container.seek(round(from_time / self.stream.time_base), stream=self.stream)
            except av.FFmpegError:
                self.container.seek(0)
                seeked = False
        previous: float | None = None
        try:
            for frame in self.container.decode(self.stream):
                if frame.time is not None:
                    time = frame.time
                else:  # no timestamp: one nominal interval after the previous frame
                    time = self.begin if previous is None else previous + interval
                if seeked and previous is None and time > from_time + TIMESTAMP_SLACK * interval:
                    # The seek overshot (an index that lies): decode from the beginning instead.
                    self.container.seek(0)
                    self.decoded_end, self.decoded = self.begin, 0
                    yield from self._frames(self.begin, interval)
                    return
                shown = float(frame.duration * frame.time_base) if frame.duration and frame.time_base else 0.0
                previous, self.decoded = time, self.decoded + 1
                self.decoded_end = max(self.decoded_end, time + (shown or interval))
                yield Frame(time, shown or interval, frame)
        except av.FFmpegError as error:
            raise MediaError(
                f"{self.where}: cannot decode the video after {self.decoded_end - self.begin:.3f} s "
                f"({error}); expected an intact file (truncated or corrupt?)"
            ) from error

    def read(self, spec: ClipSpec) -> tuple[list[np.ndarray], bool]:
        """The clip's frames (uint8 [H, W, 3], upright) and whether the video goes on after it."""
        with self.container:
            rate = spec.fps or self.rate or 25.0
            interval = 1.0 / (self.rate or rate)
            duration = None if self.declared is None else self.declared - self.begin
            first = spec.start_time(self.begin, duration, rate, self.where)
            frames = self._frames(first, interval)
            picked, more = played_at(frames, spec.times(first, rate), interval)
            frames.close()
            if self.decoded == 0:
                raise MediaError(f"{self.where}: the video holds no frames (an empty or truncated file)")
            if not more and self.declared is not None:
                declared_end = self.begin + self.declared
                if self.decoded_end < declared_end - 1.5 * interval and (
                    spec.frames is None or len(picked) < spec.frames
                ):
                    raise MediaError(
                        f"{self.where}: truncated video: it decodes to {self.decoded_end - self.begin:.3f} "
                        f"s of the {self.declared:.3f} s its header declares"
                    )
            arrays: dict[int, np.ndarray] = {}
            for frame in picked:
                if id(frame) not in arrays:
                    arrays[id(frame)] = _upright(frame.to_ndarray(format="rgb24"), frame.rotation)
            return complete([arrays[id(f)] for f in picked], spec, first, rate, self.where), more


@functools.cache
def torchcodec_decoder() -> type | None:
    """torchcodec's `VideoDecoder` when installed and loadable (it needs a system FFmpeg), else None."""
    try:
        from torchcodec.decoders import VideoDecoder
    except ImportError:
        return None
    except (RuntimeError, OSError) as error:  # installed, but libtorchcodec finds no FFmpeg
        warn_once(
            "torchcodec", f"torchcodec is installed but does not load ({error}); decoding video with PyAV"
        )
        return None
    return VideoDecoder


class TorchcodecClip:
    """One video opened with torchcodec (exact seek mode); `read` decodes a clip from it."""

    def __init__(self, source: MediaSource, where: str, max_pixels: int) -> None:
        self.where = where
        decoder = torchcodec_decoder()
        if decoder is None:
            raise MediaError(
                f"{where}: backend='torchcodec' asked for, but torchcodec is not installed or loadable"
            )
        payload = bytes(source) if is_bytes(source) else open_source(source, "a video file")
        try:
            self.decoder = decoder(
                payload, dimension_order="NHWC", num_ffmpeg_threads=1 if _in_worker() else 0
            )
        except (RuntimeError, ValueError, OSError) as error:
            raise MediaError(
                f"{where}: cannot read video ({error}); expected an intact video file"
            ) from error
        meta = self.decoder.metadata
        if not meta.num_frames:
            raise MediaError(f"{where}: the video holds no frames (an empty or truncated file)")
        refuse_oversized(meta.width or 0, meta.height or 0, max_pixels, where)
        self.rate = float(meta.average_fps or 25.0)
        self.begin = float(meta.begin_stream_seconds or 0.0)
        end = meta.end_stream_seconds
        self.end = float(end) if end is not None else self.begin + meta.num_frames / self.rate

    def read(self, spec: ClipSpec) -> tuple[list[np.ndarray], bool]:
        rate = spec.fps or self.rate
        slack = TIMESTAMP_SLACK / self.rate
        first = spec.start_time(self.begin, self.end - self.begin, rate, self.where)
        times: list[float] = []
        for time in spec.times(first, rate):
            if time >= self.end - slack:
                break
            times.append(time)
        more = bool(times) and times[-1] + 1 / rate < self.end - slack
        if not times:
            return complete([], spec, first, rate, self.where), more
        try:
            batch = self.decoder.get_frames_played_at(seconds=[t + slack for t in times])
        except (RuntimeError, ValueError, IndexError) as error:
            raise MediaError(
                f"{self.where}: cannot decode the video ({error}); truncated or corrupt?"
            ) from error
        return complete(list(batch.data.numpy()), spec, first, rate, self.where), more


def open_container(
    source: MediaSource, where: str, max_pixels: int, backend: Backend
) -> PyAVClip | TorchcodecClip:
    if backend not in ("auto", "pyav", "torchcodec"):
        raise ValueError(f"backend must be 'auto', 'pyav' or 'torchcodec', got {backend!r}")
    if backend == "torchcodec" or (backend == "auto" and torchcodec_decoder() is not None):
        return TorchcodecClip(source, where, max_pixels)
    return PyAVClip(source, where, max_pixels)
