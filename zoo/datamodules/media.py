"""Real media files in and out: images, videos, audio and jsonl manifests (DESIGN.md, "ShapesWorld", last
paragraph; issue 3 and issue 4, "Bad input").

Loaders return the zoo's tensor conventions: pixels float32 in [-1, 1], channels first ([3, H, W], video
[3, T, H, W]); audio float32 mono [N] at the requested rate. Nothing is converted by accident: grayscale is
replicated to RGB, transparency is composited on black, multi-channel audio is averaged to mono, other
sample rates are resampled with torchaudio (said once in the log), each as an explicit step. Bad files
(missing, corrupt, truncated, empty, silent, clipped, non-finite) raise `MediaError`, whose message names
the file and what was expected.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torchaudio.functional as AF
from PIL import Image, ImageSequence, UnidentifiedImageError
from torch import Tensor

log = logging.getLogger(__name__)

MEDIA_KINDS = ("image", "video", "audio")
CLIP_LEVEL = 0.999  # |x| at or above this counts as clipped
MAX_CLIPPED_FRACTION = 0.01
SILENCE_LEVEL = 1e-4  # peak below this is silence
_GIF_PERIOD = re.compile(r"zoo frame_ms=(\d+)")
_said: set[str] = set()


class MediaError(ValueError):
    """A media file or manifest that cannot be used; the message names the file and what was expected."""


def _once(key: str, message: str) -> None:
    """Log `message` the first time `key` comes up in this process."""
    if key not in _said:
        _said.add(key)
        log.info(message)


def _existing(path: str | Path, what: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file; expected {what}")
    return path


# ---------------------------------------------------------------- images


def _rgb_array(image: Image.Image, path: Path) -> np.ndarray:
    """A PIL image of any common mode -> uint8 [H, W, 3], every conversion spelled out."""
    mode = image.mode
    if mode == "RGB":
        return np.asarray(image, dtype=np.uint8)
    if mode in ("RGBA", "LA", "PA", "P", "RGBa", "La"):
        # Transparency is composited on black, the ShapesWorld background.
        rgba = np.asarray(image.convert("RGBA"), dtype=np.float32)
        return np.round(rgba[..., :3] * rgba[..., 3:] / 255.0).astype(np.uint8)
    if mode in ("L", "1"):
        grey = np.asarray(image.convert("L"), dtype=np.uint8)
        return np.repeat(grey[..., None], 3, axis=-1)
    if mode in ("I;16", "I;16B", "I;16L", "I"):
        values = np.asarray(image, dtype=np.float64)
        top = 65535.0 if mode.startswith("I;16") or values.max() > 255 else 255.0
        grey = np.round(np.clip(values / top, 0, 1) * 255).astype(np.uint8)
        return np.repeat(grey[..., None], 3, axis=-1)
    if mode in ("CMYK", "YCbCr", "LAB", "HSV"):
        return np.asarray(image.convert("RGB"), dtype=np.uint8)
    raise MediaError(
        f"{path}: image mode {mode!r} is not supported; expected RGB, RGBA, grayscale or palette"
    )


def _fit(array: np.ndarray, size: int | None, path: Path) -> np.ndarray:
    h, w = array.shape[:2]
    if size is None or (h == size and w == size):
        return array
    image = Image.fromarray(array)
    if h != w:
        side = min(h, w)
        log.warning(
            "%s: %dx%d is not square; its centre %dx%d is kept before resizing", path, w, h, side, side
        )
        top, left = (h - side) // 2, (w - side) // 2
        image = image.crop((left, top, left + side, top + side))
    return np.asarray(image.resize((size, size), Image.Resampling.BILINEAR), dtype=np.uint8)


def _pixels(array: np.ndarray) -> Tensor:
    return torch.from_numpy(np.array(array, dtype=np.uint8)).float().div(127.5).sub(1.0).permute(2, 0, 1)


def _check_side(size: int | None) -> None:
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(f"size must be None or an int >= 1 (pixels per side), got {size!r}")


def load_image(path: str | Path, size: int | None = None) -> Tensor:
    """An image file as float32 [3, H, W] in [-1, 1].

    Args:
        path: PNG, JPEG, BMP, ... (anything Pillow reads).
        size: resize to size x size (a non-square image keeps its centre square first, with a warning);
            None returns the image at its own size.
    """
    _check_side(size)
    path = _existing(path, "an image file")
    try:
        with Image.open(path) as image:
            image.load()
            array = _rgb_array(image, path)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        if isinstance(error, MediaError):
            raise
        raise MediaError(f"{path}: cannot read image ({error}); expected an intact PNG/JPEG file") from error
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise MediaError(f"{path}: image is empty ({array.shape[1]}x{array.shape[0]})")
    return _pixels(_fit(array, size, path))


# ---------------------------------------------------------------- videos


def _gif_frames(path: Path) -> list[np.ndarray]:
    try:
        with Image.open(path) as image:
            period = _GIF_PERIOD.search(image.info.get("comment", b"").decode("utf-8", "replace"))
            frames = []
            for frame in ImageSequence.Iterator(image):
                array = _rgb_array(frame.convert("RGBA"), path)
                # Pillow merges identical consecutive frames into one longer frame; the period that
                # `save_gif` records lets us expand them again.
                repeat = 1
                if period is not None:
                    repeat = max(1, round(frame.info.get("duration", 0) / int(period.group(1))))
                frames.extend([array] * repeat)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        if isinstance(error, MediaError):
            raise
        raise MediaError(f"{path}: cannot read video ({error}); expected an intact GIF") from error
    return frames


def _natural(path: Path) -> list:
    """Sort key: frame_2.png before frame_10.png."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def load_video(path: str | Path, frames: int | None = None, size: int | None = None) -> Tensor:
    """A video as float32 [3, T, H, W] in [-1, 1], from an animated GIF (or other multi-frame image) or a
    folder of PNG frames (taken in name order).

    Args:
        path: the GIF file, or the folder of frames.
        frames: keep the first `frames` frames (a longer video is cut, with a warning; a shorter one is
            refused); None keeps them all.
        size: resize every frame to size x size; None keeps the frames' size (all frames must agree).
    """
    _check_side(size)
    if frames is not None and (isinstance(frames, bool) or not isinstance(frames, int) or frames < 1):
        raise ValueError(f"frames must be None or an int >= 1, got {frames!r}")
    path = _existing(path, "a GIF file or a folder of PNG frames")
    if path.is_dir():
        files = sorted(path.glob("*.png"), key=_natural)
        total = len(files)
        if total == 0:
            raise MediaError(f"{path}: empty video, no *.png frames in the folder")
        clips = [load_image(f, size) for f in files[:frames]]
        shapes = {tuple(c.shape) for c in clips}
        if len(shapes) > 1:
            raise MediaError(
                f"{path}: frames differ in size {sorted(shapes)}; expected one size (or pass size)"
            )
        video = torch.stack(clips, dim=1)
    else:
        arrays = _gif_frames(path)
        total = len(arrays)
        if total == 0:
            raise MediaError(f"{path}: empty video, it holds no frames")
        video = torch.stack([_pixels(_fit(a, size, path)) for a in arrays[:frames]], dim=1)
    if frames is not None:
        if total < frames:
            raise MediaError(f"{path}: video has {total} frames; expected at least {frames}")
        if total > frames:
            log.warning("%s: keeping the first %d of %d frames", path, frames, total)
    return video


# ---------------------------------------------------------------- audio


def _read_audio(path: Path) -> tuple[np.ndarray, int]:
    try:
        info = sf.info(str(path))
        # libsndfile reads a truncated WAV without complaint, but notes the header's larger sizes.
        if re.search(r"^data\s*:\s*\d+\s*\(should be", info.extra_info, re.MULTILINE):
            raise MediaError(f"{path}: truncated audio file (its header promises more data than it holds)")
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, OSError) as error:
        raise MediaError(
            f"{path}: cannot read audio ({error}); expected an intact WAV/FLAC/OGG file"
        ) from error
    return data, rate


def load_audio(path: str | Path, sample_rate: int = 16000) -> Tensor:
    """An audio file as float32 mono [N] at `sample_rate`.

    Multi-channel audio is averaged to mono; another rate is resampled (torchaudio, said once in the log).
    Refused with `MediaError`: unreadable, corrupt or truncated files, no samples, non-finite samples,
    silence (peak below 1e-4) and clipping (more than 1 % of samples at |x| >= 0.999).

    Args:
        path: WAV, FLAC, OGG, ... (anything libsndfile reads).
        sample_rate: the rate to return.
    """
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate < 1:
        raise ValueError(f"sample_rate must be an int >= 1 (Hz), got {sample_rate!r}")
    path = _existing(path, "an audio file")
    data, rate = _read_audio(path)
    if data.shape[0] == 0:
        raise MediaError(f"{path}: audio is empty (no samples)")
    if not np.isfinite(data).all():
        raise MediaError(f"{path}: audio holds non-finite samples (NaN or inf); expected finite samples")
    if data.shape[1] > 1:
        _once(
            f"downmix {data.shape[1]}",
            f"downmixing {data.shape[1]}-channel audio to mono by averaging the channels (first: {path})",
        )
    peak = float(np.abs(data).max())
    if peak < SILENCE_LEVEL:
        raise MediaError(f"{path}: audio is silent (peak {peak:.1e}); expected a sound")
    clipped = float((np.abs(data) >= CLIP_LEVEL).mean())
    if clipped > MAX_CLIPPED_FRACTION:
        raise MediaError(
            f"{path}: audio is clipped ({clipped:.1%} of samples at full scale); expected at most "
            f"{MAX_CLIPPED_FRACTION:.0%} (lower the gain)"
        )
    wave = torch.from_numpy(data.mean(axis=1))
    if rate != sample_rate:
        _once(
            f"resample {rate} {sample_rate}",
            f"resampling audio from {rate} Hz to {sample_rate} Hz with torchaudio (first: {path})",
        )
        wave = AF.resample(wave, rate, sample_rate)
    return wave.contiguous()


# ---------------------------------------------------------------- writing


def _as_uint8(pixels: Tensor | np.ndarray, layout: str) -> np.ndarray:
    """float [3, ...] in [-1, 1] (torch or numpy) or uint8 channels-last -> uint8 channels-last."""
    if isinstance(pixels, np.ndarray) and pixels.dtype == np.uint8:
        if pixels.shape[-1] != 3:
            raise ValueError(f"uint8 pixels must be channels last [..., 3], got {list(pixels.shape)}")
        return pixels
    x = torch.as_tensor(pixels).detach().float().cpu()
    if x.shape[0] != 3:
        raise ValueError(f"float pixels must be {layout} in [-1, 1], got shape {list(x.shape)}")
    x = ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(*range(1, x.dim()), 0).numpy()


def save_png(image: Tensor | np.ndarray, path: str | Path) -> Path:
    """Write float [3, H, W] in [-1, 1] (or uint8 [H, W, 3]) as a PNG; parent folders are created."""
    array = _as_uint8(image, "[3, H, W]")
    if array.ndim != 3:
        raise ValueError(f"save_png expects one image [3, H, W], got {array.ndim}-d pixels")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, format="PNG")
    return path


def save_gif(video: Tensor | np.ndarray, path: str | Path, fps: float = 4.0) -> Path:
    """Write float [3, T, H, W] in [-1, 1] (or uint8 [T, H, W, 3]) as a looping GIF at `fps`."""
    array = _as_uint8(video, "[3, T, H, W]")
    if array.ndim != 4 or array.shape[0] == 0:
        raise ValueError(f"save_gif expects a video [3, T, H, W] with T >= 1, got shape {list(array.shape)}")
    if not fps > 0:
        raise ValueError(f"fps must be > 0, got {fps!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    period = max(10, round(1000 / fps / 10) * 10)  # GIF durations are in 1/100 s
    frames = [Image.fromarray(a) for a in array]
    frames[0].save(
        path, format="GIF", save_all=True, append_images=frames[1:], duration=period, loop=0,
        comment=f"zoo frame_ms={period}",
    )  # fmt: skip
    return path


def save_wav(wave: Tensor | np.ndarray, path: str | Path, sample_rate: int = 16000) -> Path:
    """Write a mono float wave [N] in [-1, 1] as 16-bit PCM (WAV, or FLAC by the file's suffix)."""
    x = torch.as_tensor(wave).detach().float().cpu().numpy()
    if x.ndim != 1 or x.shape[0] == 0:
        raise ValueError(f"save_wav expects a non-empty mono wave [N], got shape {list(x.shape)}")
    if not np.isfinite(x).all():
        raise ValueError("save_wav: the wave holds non-finite samples")
    if np.abs(x).max() > 1.0:
        log.warning("%s: samples beyond [-1, 1] are clipped on writing", path)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(str(path), np.clip(x, -1.0, 1.0), sample_rate, subtype="PCM_16")
    return path


def save_spectrogram_png(
    wave: Tensor | np.ndarray, path: str | Path, sample_rate: int = 16000, n_mels: int = 64, height: int = 128
) -> Path:
    """Write a log-mel spectrogram of a mono wave [N] as a PNG (time left to right, low frequencies at the
    bottom, magma colours, 80 dB range): a page can show what a WAV sounds like at a glance."""
    from matplotlib import colormaps  # imported here: only pictures need it

    x = torch.as_tensor(wave).detach().float().cpu()
    if x.ndim != 1 or x.shape[0] == 0:
        raise ValueError(f"save_spectrogram_png expects a non-empty mono wave [N], got shape {list(x.shape)}")
    n_fft = 512
    spec = torch.stft(
        torch.nn.functional.pad(x, (0, max(0, n_fft - x.shape[0]))), n_fft, hop_length=n_fft // 4,
        window=torch.hann_window(n_fft), return_complex=True,
    ).abs().pow(2)
    mel = AF.melscale_fbanks(n_fft // 2 + 1, 0.0, sample_rate / 2, n_mels, sample_rate).T @ spec
    db = 10 * torch.log10(mel.clamp_min(1e-10))
    db = (db - db.max() + 80).clamp_min(0) / 80  # the top 80 dB, scaled to [0, 1]
    rgb = colormaps["magma"](db.flip(0).numpy())[..., :3]
    image = Image.fromarray((rgb * 255).astype(np.uint8))
    image = image.resize((max(image.width * 2, 64), height), Image.Resampling.NEAREST)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG")
    return path


# ---------------------------------------------------------------- manifests


def read_manifest(path: str | Path) -> list[dict]:
    """The samples of a jsonl manifest, one JSON object per line (blank lines skipped).

    A line is {"image": ...} or {"video": ...} or {"audio": ...} (a path relative to the manifest's folder,
    or absolute) with an optional "text" (a string); other keys are kept. Each returned dict holds the
    line's keys with the media path made absolute, plus "kind" (the media key) and "line" (its number).
    Any bad line raises `MediaError` naming file:line and what was expected; media files must exist.
    """
    path = _existing(path, "a jsonl manifest")
    root = path.parent
    samples = []
    with open(path, encoding="utf-8") as handle:
        for number, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            try:
                entry = json.loads(raw)
            except json.JSONDecodeError as error:
                raise MediaError(
                    f"{where}: not valid JSON ({error.msg}); expected one object per line"
                ) from error
            if not isinstance(entry, dict):
                raise MediaError(f"{where}: expected a JSON object, got {type(entry).__name__}")
            kinds = [k for k in MEDIA_KINDS if k in entry]
            if len(kinds) != 1:
                raise MediaError(f"{where}: expected exactly one of {MEDIA_KINDS} keys, got {sorted(entry)}")
            kind = kinds[0]
            if not isinstance(entry[kind], str) or not entry[kind]:
                raise MediaError(f"{where}: {kind!r} must be a non-empty path string, got {entry[kind]!r}")
            if "text" in entry and not isinstance(entry["text"], str):
                raise MediaError(f"{where}: 'text' must be a string, got {type(entry['text']).__name__}")
            media = (root / entry[kind]).resolve()
            if not media.exists():
                raise MediaError(f"{where}: {kind} file {media} does not exist")
            samples.append({**entry, kind: str(media), "kind": kind, "line": number})
    if not samples:
        raise MediaError(f"{path}: manifest is empty; expected one JSON object per line")
    return samples
