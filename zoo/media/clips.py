"""Which frames of a video make a clip: picked by timestamp at a target frame rate from a clip start.

A clip is `frames` frames at `fps` frames per second starting at a time chosen by `start`:
- "start": the video's first frame;
- "centre": the clip's middle at the video's middle (the start when the video is shorter than the clip);
- a number: that many seconds after the video's first frame.

Clip frame k shows what is on screen at start + k / fps: the last source frame whose timestamp is at or
before that time (torchcodec's "played at"), allowing 5 % of a source frame interval for timestamp
rounding (an MP4 time base rarely divides a frame period exactly). So a 30 fps video read at 10 fps takes
every third frame, and a 4 fps GIF read at 8 fps shows each frame twice. `fps=None` reads the video at its
own frame rate.

A video that ends before the clip does (its last frame stops being shown) is refused with `MediaError` by
default (`short="refuse"`); `short="repeat_last"` holds its last frame instead. `frames=None` takes every
clip frame until the video ends.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from zoo.media.errors import MediaError

ClipStart = Literal["start", "centre"] | float
ShortVideo = Literal["refuse", "repeat_last"]
TIMESTAMP_SLACK = 0.05  # of a source frame interval

T = TypeVar("T")


@dataclass(frozen=True)
class ClipSpec:
    """What clip to take (module docstring). fps None: the video's own rate."""

    frames: int | None = None
    fps: float | None = None
    start: ClipStart = "start"
    short: ShortVideo = "refuse"

    def __post_init__(self) -> None:
        f = self.frames
        if f is not None and (isinstance(f, bool) or not isinstance(f, int) or f < 1):
            raise ValueError(f"frames must be None or an int >= 1, got {f!r}")
        if self.fps is not None and (isinstance(self.fps, bool) or not self.fps > 0):
            raise ValueError(f"fps must be None or a number > 0, got {self.fps!r}")
        s = self.start
        if not (
            s in ("start", "centre") or (isinstance(s, int | float) and not isinstance(s, bool) and s >= 0)
        ):
            raise ValueError(f"start must be 'start', 'centre' or seconds >= 0, got {s!r}")
        if self.short not in ("refuse", "repeat_last"):
            raise ValueError(f"short must be 'refuse' or 'repeat_last', got {self.short!r}")

    def start_time(self, begin: float, duration: float | None, fps: float, where: str) -> float:
        """The clip's first time, for a video whose first frame is at `begin` and lasts `duration` s."""
        if self.start == "start":
            return begin
        if self.start == "centre":
            if duration is None or self.frames is None:
                return begin
            return begin + max(0.0, (duration - self.frames / fps) / 2)
        if duration is not None and self.start >= duration:
            raise MediaError(
                f"{where}: the clip starts at {self.start:g} s but the video lasts {duration:.3f} s"
            )
        return begin + float(self.start)

    def times(self, first: float, fps: float) -> Iterator[float]:
        """The clip's frame times (endless when frames is None: the video's end stops it)."""
        steps = itertools.count() if self.frames is None else range(self.frames)
        return (first + k / fps for k in steps)


@dataclass(frozen=True)
class Frame(Generic[T]):
    """A decoded source frame: its timestamp and how long it is shown (seconds), and what it holds."""

    time: float
    duration: float
    item: T


def played_at(frames: Iterable[Frame[T]], times: Iterator[float], interval: float) -> tuple[list[T], bool]:
    """For each of `times` (ascending), the item of the frame on screen then, stopping when the frames end;
    and whether frames remain after the last time (the video goes on past the clip).

    Reads `frames` lazily and no further than the last time needs (plus one frame), so a decoder can stop.
    `interval` is the source's frame interval (seconds), which sets the timestamp slack.
    """
    slack = TIMESTAMP_SLACK * interval
    picked: list[T] = []
    target = next(times, None)
    shown: Frame[T] | None = None
    for frame in frames:
        # Every target before this frame starts was on screen during the previous frame (or, before the
        # first frame, gets the first frame: nothing else was shown).
        while target is not None and frame.time > target + slack:
            picked.append((shown or frame).item)
            target = next(times, None)
        if target is None:
            return picked, True  # this frame starts after the clip
        shown = frame
    if shown is not None:
        end = shown.time + shown.duration
        while target is not None and target < end - slack:
            picked.append(shown.item)
            target = next(times, None)
    return picked, False


def complete(picked: list[T], spec: ClipSpec, first: float, fps: float, where: str) -> list[T]:
    """The clip, with the `short` policy applied when the video ended before it did."""
    if not picked:
        raise MediaError(f"{where}: no frame is shown at or after {first:.3f} s; expected a clip from there")
    missing = 0 if spec.frames is None else spec.frames - len(picked)
    if missing <= 0:
        return picked
    if spec.short == "repeat_last":
        return picked + [picked[-1]] * missing
    raise MediaError(
        f"{where}: video too short: from {first:.3f} s at {fps:g} fps it gives {len(picked)} frames; "
        f"expected at least {spec.frames} frames (or short='repeat_last' to repeat the last frame)"
    )
