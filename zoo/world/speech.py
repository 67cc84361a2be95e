"""ShapesWorld speech: captions spoken as speech-like audio, and the verifier that reads the words back.

DESIGN.md, "ShapesWorld" and issue 4 item 4: each caption word is a distinct, deterministic sound pattern,
with small seeded variation in timing and pitch, so that audio understanding and generation are measurable
and RL has a verifiable reward.

A word is 2 or 3 voiced segments, like syllables: a harmonic tone (fundamental f0) whose harmonics are
shaped by two formant peaks (F1, F2), as vowels are. A word's segments are drawn from a fixed grid by a
generator seeded with `stable_seed(word)`, the same in every process; segments glide into each other, and
words are separated by short pauses. Per utterance (seeded by `seed`) every word varies: duration +-10 %,
pitch +-3 %, loudness, pause length, plus faint noise.

Reading back: the waveform is cut into words at its pauses (frame energy), and each word is the template
(every vocabulary word rendered without variation, at three pitches) nearest in a time-normalised log-mel
feature. Audio is float32 mono in [-1, 1] at 16 kHz by default (the zoo's convention).
"""

from __future__ import annotations

import functools
import random

import numpy as np
import torchaudio.functional as AF
from torch import Tensor

from zoo.world.scenes import CaptionScore, Scene, caption_vocabulary, stable_seed, verify_caption

SAMPLE_RATE = 16000
WORD_SECONDS = 0.12
GAP_SECONDS = (0.025, 0.045)
EDGE_SECONDS = 0.03  # silence before the first and after the last word
NOISE_STD = 0.002
# The grid a word's segments are drawn from (Hz).
F0_CHOICES = (110.0, 160.0, 235.0)
F1_CHOICES = (300.0, 450.0, 620.0, 820.0)
F2_CHOICES = (950.0, 1350.0, 1850.0, 2450.0)
_TOP_HARMONIC_HZ = 4000.0
_FRAME_SECONDS, _HOP_SECONDS = 0.010, 0.005  # energy frames for cutting words
_FEATURE_FRAMES, _MEL_BANDS = 8, 32


@functools.cache
def word_patterns() -> dict[str, tuple[tuple[float, float, float], ...]]:
    """Each vocabulary word's segments as (f0, F1, F2) triples, distinct between words."""
    patterns: dict[str, tuple[tuple[float, float, float], ...]] = {}
    for word in caption_vocabulary():
        attempt = 0
        while True:
            rng = random.Random(stable_seed("shapes-speech-word", word, attempt))
            count = rng.choice((2, 3))
            pattern = tuple(
                (rng.choice(F0_CHOICES), rng.choice(F1_CHOICES), rng.choice(F2_CHOICES)) for _ in range(count)
            )
            # Consecutive segments differ in timbre, so a word is audibly a sequence.
            varied = all(a[1:] != b[1:] for a, b in zip(pattern, pattern[1:], strict=False))
            if varied and pattern not in patterns.values():
                break
            attempt += 1
        patterns[word] = pattern
    return patterns


def _smooth(x: np.ndarray, n: int) -> np.ndarray:
    if n < 2:
        return x
    kernel = np.hanning(n + 2)[1:-1]
    kernel /= kernel.sum()
    padded = np.pad(x, (n // 2, n - 1 - n // 2), mode="edge")
    return np.convolve(padded, kernel, mode="valid")


def _word_wave(word: str, sample_rate: int, duration: float, pitch: float) -> np.ndarray:
    pattern = word_patterns()[word]
    n = max(int(round(duration * sample_rate)), len(pattern))
    # Pitch and formants change slowly: they live on a 4 ms grid, interpolated to samples where needed.
    step = max(1, int(0.004 * sample_rate))
    coarse = np.arange(0, n, step)
    segment = np.minimum(coarse * len(pattern) // n, len(pattern) - 1)
    params = np.array(pattern, dtype=np.float64)[segment]  # [n / step, 3]
    glide = round(0.012 * sample_rate / step)  # segments glide into each other like syllables
    f0, f1, f2 = (_smooth(params[:, i], glide) for i in range(3))
    f0 = f0 * pitch
    phase = (2 * np.pi * np.cumsum(np.interp(np.arange(n), coarse, f0)) / sample_rate) % (2 * np.pi)
    top = min(_TOP_HARMONIC_HZ, sample_rate / 2 - 200)
    k = np.arange(1, int(top / (F0_CHOICES[0] * 0.95)) + 1)[:, None]  # [K, 1]
    freq = k * f0
    gain = np.exp(-(((freq - f1) / 130.0) ** 2)) + 0.6 * np.exp(-(((freq - f2) / 200.0) ** 2))
    gain = np.where(freq < top, gain + 0.02, 0.0) / np.sqrt(k)  # [K, n / step]
    # Harmonics far from both formants are faint throughout; leaving them out makes synthesis ~3x faster.
    keep = gain.max(1) > 0.05
    gain, k = gain[keep], k[keep]
    position = np.arange(n) / step
    i0 = np.minimum(position.astype(int), len(coarse) - 1)
    i1 = np.minimum(i0 + 1, len(coarse) - 1)
    frac = (position - i0).astype(np.float32)
    gain = gain.astype(np.float32)
    gain = gain[:, i0] * (1 - frac) + gain[:, i1] * frac
    wave = (gain * np.sin((k * phase).astype(np.float32))).sum(0, dtype=np.float64)
    ramp = int(0.012 * sample_rate)
    envelope = np.ones(n)
    envelope[:ramp] = np.sin(np.linspace(0, np.pi / 2, ramp)) ** 2
    envelope[-ramp:] = envelope[:ramp][::-1]
    wave *= envelope
    return wave / np.abs(wave).max()


def _words(text: str) -> list[str]:
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    words = text.lower().split()
    if not words:
        raise ValueError("text is empty; expected at least one caption word")
    vocabulary = set(caption_vocabulary())
    unknown = sorted({w for w in words if w not in vocabulary})
    if unknown:
        raise ValueError(f"words {unknown} are not in the ShapesWorld vocabulary {caption_vocabulary()}")
    return words


def _check_rate(sample_rate: object) -> int:
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate < 8000:
        raise ValueError(f"sample_rate must be an int >= 8000 (Hz), got {sample_rate!r}")
    return sample_rate


def render_speech(text: str, seed: int, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """The caption `text` spoken: float32 [N] mono in [-1, 1] (peak about 0.5).

    Args:
        text: words of `caption_vocabulary()`, separated by spaces (case ignored).
        seed: the utterance's variation (timing, pitch, loudness, noise); the same seed gives the same wave.
        sample_rate: samples per second.
    """
    words = _words(text)
    _check_rate(sample_rate)
    rng = np.random.default_rng(stable_seed("shapes-speech-utterance", seed))
    edge = np.zeros(int(EDGE_SECONDS * sample_rate))
    pieces = [edge]
    for i, word in enumerate(words):
        duration = WORD_SECONDS * rng.uniform(0.9, 1.1)
        pitch = rng.uniform(0.97, 1.03)
        pieces.append(rng.uniform(0.35, 0.5) * _word_wave(word, sample_rate, duration, pitch))
        if i + 1 < len(words):
            pieces.append(np.zeros(int(rng.uniform(*GAP_SECONDS) * sample_rate)))
    pieces.append(edge)
    wave = np.concatenate(pieces)
    wave += NOISE_STD * rng.standard_normal(wave.shape[0])
    return wave.astype(np.float32)


# ---------------------------------------------------------------- reading speech back


def _as_wave(wave: np.ndarray | Tensor) -> np.ndarray:
    if isinstance(wave, Tensor):
        wave = wave.detach().float().cpu().numpy()
    if not isinstance(wave, np.ndarray):
        raise TypeError(f"wave must be a numpy array or tensor [N], got {type(wave).__name__}")
    if wave.ndim != 1:
        raise ValueError(f"wave must be mono [N], got shape {list(wave.shape)}")
    if not np.issubdtype(wave.dtype, np.floating):
        raise TypeError(f"wave must hold floats in [-1, 1], got dtype {wave.dtype}")
    if not np.isfinite(wave).all():
        raise ValueError("wave holds non-finite samples")
    return wave.astype(np.float64)


def split_words(wave: np.ndarray, sample_rate: int = SAMPLE_RATE) -> list[tuple[int, int]]:
    """(start, end) sample ranges of the words of a spoken caption, cut at its pauses."""
    wave = _as_wave(wave)
    frame, hop = int(_FRAME_SECONDS * sample_rate), int(_HOP_SECONDS * sample_rate)
    if wave.shape[0] < frame:
        return []
    starts = np.arange(0, wave.shape[0] - frame + 1, hop)
    energy = np.sqrt(np.array([np.mean(wave[s : s + frame] ** 2) for s in starts]))
    # Between the noise floor (pauses) and the level of words; pauses are >= ~20 % of a caption.
    floor, level = np.percentile(energy, 10), np.percentile(energy, 90)
    if level < 1e-3 or level < 2 * floor:
        return []
    voiced = energy > floor + 0.15 * (level - floor)
    segments: list[list[int]] = []
    for i in np.flatnonzero(voiced):
        # A dip of a frame or two inside a word is not a pause (pauses are >= 25 ms = 5 hops).
        if segments and i - segments[-1][1] <= 2:
            segments[-1][1] = i
        else:
            segments.append([i, i])
    min_frames = int(0.04 / _HOP_SECONDS)
    return [(int(starts[a]), int(starts[b]) + frame) for a, b in segments if b - a + 1 >= min_frames]


def _features(piece: np.ndarray, sample_rate: int) -> np.ndarray:
    n_fft = 1 << int(np.ceil(np.log2(0.032 * sample_rate)))
    hop = int(0.008 * sample_rate)
    if piece.shape[0] < n_fft:
        piece = np.pad(piece, (0, n_fft - piece.shape[0]))
    frames = np.lib.stride_tricks.sliding_window_view(piece, n_fft)[::hop] * np.hanning(n_fft)
    power = np.abs(np.fft.rfft(frames, axis=-1)) ** 2  # [F, n_fft/2+1]
    mel = power @ _mel_bank(n_fft, sample_rate)
    # A floor relative to the loudest bin: faint bands (where noise lives) say little about the word.
    logmel = np.log(mel + 1e-3 * mel.max() + 1e-12)
    # Time-normalise so that a 10 % longer word gives the same feature.
    src = np.linspace(0, 1, logmel.shape[0])
    dst = np.linspace(0, 1, _FEATURE_FRAMES)
    feature = np.stack([np.interp(dst, src, logmel[:, b]) for b in range(logmel.shape[1])], axis=1)
    feature -= feature.mean()  # loudness does not matter
    return feature.ravel()


@functools.lru_cache(maxsize=8)
def _mel_bank(n_fft: int, sample_rate: int) -> np.ndarray:
    bank = AF.melscale_fbanks(n_fft // 2 + 1, 60.0, min(5000.0, sample_rate / 2), _MEL_BANDS, sample_rate)
    return bank.numpy().astype(np.float64)


@functools.lru_cache(maxsize=8)
def _templates(sample_rate: int) -> tuple[np.ndarray, tuple[str, ...]]:
    features, names = [], []
    for word in caption_vocabulary():
        for pitch in (0.97, 1.0, 1.03):
            features.append(_features(_word_wave(word, sample_rate, WORD_SECONDS, pitch), sample_rate))
            names.append(word)
    return np.stack(features), tuple(names)


def read_speech(wave: np.ndarray | Tensor, sample_rate: int = SAMPLE_RATE) -> str:
    """The words of a spoken caption, joined by spaces ("" when no word is heard).

    Args:
        wave: float mono [N] in [-1, 1] (numpy or torch).
        sample_rate: samples per second of `wave`.
    """
    _check_rate(sample_rate)
    wave = _as_wave(wave)
    templates, names = _templates(sample_rate)
    words = []
    for start, end in split_words(wave, sample_rate):
        feature = _features(wave[start:end], sample_rate)
        words.append(names[int(((templates - feature) ** 2).sum(1).argmin())])
    return " ".join(words)


def verify_speech(
    wave: np.ndarray | Tensor, scene: Scene, sample_rate: int = SAMPLE_RATE, include_motion: bool = False
) -> CaptionScore:
    """Score the caption read from speech against the scene (`verify_caption(read_speech(wave), scene)`)."""
    return verify_caption(read_speech(wave, sample_rate), scene, include_motion=include_motion)


def word_accuracy(said: str, heard: str) -> float:
    """Share of the words of `said` heard in the same place, 1 - (word edit distance / len(said))."""
    a, b = said.split(), heard.split()
    row = list(range(len(b) + 1))
    for i, wa in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, wb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (wa != wb))
    return max(0.0, 1.0 - row[-1] / max(len(a), 1))


def readback_accuracy(n: int = 100, seed: int = 0, noise: float = 0.03) -> dict[str, float]:
    """Word accuracy and exact-caption rate of `read_speech` on `n` "test" scenes (held-out pairs, motion
    said) spoken with seeds never used elsewhere, clean and with Gaussian noise of std `noise`."""
    from zoo.world.scenes import ShapesWorld

    world = ShapesWorld(seed=seed, max_objects=3, include_motion=True)
    rng = np.random.default_rng(seed)
    result: dict[str, float] = {"captions": n}
    scores: dict[str, list[float]] = {
        "clean_word": [],
        "clean_exact": [],
        "noisy_word": [],
        "noisy_exact": [],
    }
    for i in range(n):
        scene = world.scene(i, "test")
        text = world.caption(scene)
        wave = render_speech(text, seed=stable_seed("held-out", seed, i))
        for name, x in (("clean", wave), ("noisy", wave + noise * rng.standard_normal(len(wave)))):
            heard = read_speech(x.astype(np.float32))
            scores[f"{name}_word"].append(word_accuracy(text, heard))
            scores[f"{name}_exact"].append(float(verify_caption(heard, scene, include_motion=True).exact))
    result.update({f"speech_{k}_accuracy": float(np.mean(v)) for k, v in scores.items()})
    return result


if __name__ == "__main__":  # python -m zoo.world.speech: the figures in docs/world_media.md
    import json

    print(json.dumps(readback_accuracy()))
