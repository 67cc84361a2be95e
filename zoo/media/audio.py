"""Audio of any rate, channel count and common format, from a path or bytes, as the zoo's waves
(REFERENCES.md Part C section 9).

libsndfile (1.2, bundled in the soundfile wheel) reads WAV, FLAC, OGG/Vorbis, Opus and MP3 from a path
or from bytes. Channels are averaged to mono; another rate is resampled with soxr at "HQ" quality (about
48x faster than torchaudio's default resampler and far cleaner: -158 dB of aliasing against -63 dB). Both
notices are said once per process at WARNING level. Refused with `MediaError` naming the source:
unreadable, corrupt or truncated files, no samples, non-finite samples, silence and clipping, all checked
on the samples as stored, before any resampling.
"""

from __future__ import annotations

import re

import numpy as np
import soundfile as sf
import soxr
import torch
from torch import Tensor

from zoo.media.errors import MediaError, MediaSource, describe, open_source, warn_once

CLIP_LEVEL = 0.999  # |x| at or above this counts as clipped
MAX_CLIPPED_FRACTION = 0.01
SILENCE_LEVEL = 1e-4  # peak below this is silence
_FORMATS = "an intact WAV/FLAC/OGG/Opus/MP3 file"


def _read(source: MediaSource, where: str) -> tuple[np.ndarray, int]:
    """float32 [N, C] samples as stored, and their rate."""
    file = open_source(source, "an audio file")
    try:
        with sf.SoundFile(file) as handle:
            # libsndfile reads a truncated WAV without complaint, but notes the header's larger sizes.
            if re.search(r"^data\s*:\s*\d+\s*\(should be", handle.extra_info, re.MULTILINE):
                raise MediaError(
                    f"{where}: truncated audio file (its header promises more data than it holds)"
                )
            declared = handle.frames
            data = handle.read(dtype="float32", always_2d=True)
            rate = handle.samplerate
    except (sf.LibsndfileError, RuntimeError, OSError, EOFError) as error:
        raise MediaError(f"{where}: cannot read audio ({error}); expected {_FORMATS}") from error
    # An MP3's header (Xing) or a FLAC's STREAMINFO gives the length; fewer samples means a cut file.
    if 0 < data.shape[0] < declared:
        raise MediaError(
            f"{where}: truncated audio file ({data.shape[0]} of the {declared} samples its header declares)"
        )
    return data, rate


def check_wave(data: np.ndarray, where: str) -> None:
    """The refusals: empty, non-finite, silent, clipped (samples as stored, [N, C])."""
    if data.shape[0] == 0:
        raise MediaError(f"{where}: audio is empty (no samples; an empty or truncated file)")
    if not np.isfinite(data).all():
        raise MediaError(f"{where}: audio holds non-finite samples (NaN or inf); expected finite samples")
    peak = float(np.abs(data).max())
    if peak < SILENCE_LEVEL:
        raise MediaError(f"{where}: audio is silent (peak {peak:.1e}); expected a sound")
    clipped = float((np.abs(data) >= CLIP_LEVEL).mean())
    if clipped > MAX_CLIPPED_FRACTION:
        raise MediaError(
            f"{where}: audio is clipped ({clipped:.1%} of samples at full scale); expected at most "
            f"{MAX_CLIPPED_FRACTION:.0%} (lower the gain)"
        )


def to_mono(data: np.ndarray, where: str) -> np.ndarray:
    """[N, C] -> [N] by averaging the channels (said once per channel count)."""
    channels = data.shape[1]
    if channels > 1:
        warn_once(
            f"downmix {channels}",
            f"downmixing {channels}-channel audio to mono by averaging the channels "
            f"(first: {where}); said once",
        )
    return data.mean(axis=1, dtype=np.float32) if channels > 1 else data[:, 0]


def resample(wave: np.ndarray, rate: int, sample_rate: int, where: str) -> np.ndarray:
    """A mono wave from `rate` to `sample_rate` with soxr "HQ" (said once per pair of rates)."""
    if rate == sample_rate:
        return wave
    warn_once(
        f"resample {rate} {sample_rate}",
        f"resampling audio from {rate} Hz to {sample_rate} Hz with soxr HQ (first: {where}); said once",
    )
    return soxr.resample(wave, rate, sample_rate, quality="HQ").astype(np.float32, copy=False)


def load_audio(source: MediaSource, sample_rate: int = 16000, *, name: str | None = None) -> Tensor:
    """An audio file as float32 mono [N] at `sample_rate`.

    Args:
        source: a path, or the bytes of a WAV, FLAC, OGG/Vorbis, Opus or MP3 file.
        sample_rate: the rate to return; another rate is resampled (soxr HQ).
        name: what errors call a bytes source (e.g. the WebDataset sample key).

    Refused with `MediaError` naming the source: unreadable, corrupt or truncated files, no samples,
    non-finite samples, silence (peak below 1e-4) and clipping (more than 1 % of samples at |x| >= 0.999);
    a missing path raises `MissingMediaError` (a `MediaError` and a `FileNotFoundError`).
    """
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate < 1:
        raise ValueError(f"sample_rate must be an int >= 1 (Hz), got {sample_rate!r}")
    where = describe(source, name)
    data, rate = _read(source, where)
    check_wave(data, where)
    wave = resample(to_mono(data, where), rate, sample_rate, where)
    return torch.from_numpy(np.ascontiguousarray(wave))
