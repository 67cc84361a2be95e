"""Media files out: PNG, GIF, MP4/WebM, WAV/FLAC and spectrogram pictures, for galleries, pages and tests.

Writers take the zoo's tensor conventions (float [3, H, W] or [3, T, H, W] in [-1, 1], mono float waves
[N]) or uint8 channels-last arrays, create parent folders, and return the path written. What `zoo.media`
writes it reads back: `save_gif` records its frame period so `load_video` recovers every frame.
"""

from __future__ import annotations

import logging
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import soundfile as sf
import torch
from PIL import Image
from torch import Tensor

log = logging.getLogger(__name__)

# Video codecs by container, best first; the first the bundled FFmpeg can encode is used.
VIDEO_CODECS = {".mp4": ("libx264", "mpeg4"), ".mkv": ("libx264", "mpeg4"), ".webm": ("libvpx-vp9", "libvpx"),
                ".avi": ("mpeg4",), ".mov": ("libx264", "mpeg4")}  # fmt: skip
# Near-lossless settings: galleries show small pictures, and tests read colours back.
_QUALITY = {
    "libx264": {"crf": "12"},
    "libvpx-vp9": {"crf": "12", "b": "0"},
    "libvpx": {"crf": "4", "b": "8M"},
}


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


def _video_array(video: Tensor | np.ndarray, fps: float, writer: str) -> np.ndarray:
    array = _as_uint8(video, "[3, T, H, W]")
    if array.ndim != 4 or array.shape[0] == 0:
        raise ValueError(f"{writer} expects a video [3, T, H, W] with T >= 1, got shape {list(array.shape)}")
    if not fps > 0:
        raise ValueError(f"fps must be > 0, got {fps!r}")
    return array


def _writable(path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def save_png(image: Tensor | np.ndarray, path: str | Path) -> Path:
    """Write float [3, H, W] in [-1, 1] (or uint8 [H, W, 3]) as a PNG; parent folders are created."""
    array = _as_uint8(image, "[3, H, W]")
    if array.ndim != 3:
        raise ValueError(f"save_png expects one image [3, H, W], got {array.ndim}-d pixels")
    path = _writable(path)
    Image.fromarray(array).save(path, format="PNG")
    return path


def save_gif(video: Tensor | np.ndarray, path: str | Path, fps: float = 4.0) -> Path:
    """Write float [3, T, H, W] in [-1, 1] (or uint8 [T, H, W, 3]) as a looping GIF at `fps`."""
    array = _video_array(video, fps, "save_gif")
    path = _writable(path)
    period = max(10, round(1000 / fps / 10) * 10)  # GIF durations are in 1/100 s
    frames = [Image.fromarray(a) for a in array]
    frames[0].save(
        path, format="GIF", save_all=True, append_images=frames[1:], duration=period, loop=0,
        comment=f"zoo frame_ms={period}",
    )  # fmt: skip
    return path


def video_codec(suffix: str) -> str:
    """The first codec of `VIDEO_CODECS[suffix]` the bundled FFmpeg encodes."""
    if suffix not in VIDEO_CODECS:
        raise ValueError(f"cannot write {suffix!r} videos; expected one of {', '.join(VIDEO_CODECS)}")
    for codec in VIDEO_CODECS[suffix]:
        try:
            av.codec.Codec(codec, "w")
            return codec
        except av.codec.codec.UnknownCodecError:
            continue
    raise RuntimeError(f"this FFmpeg encodes none of {VIDEO_CODECS[suffix]} for {suffix} videos")


def save_video(
    video: Tensor | np.ndarray, path: str | Path, fps: float = 4.0, codec: str | None = None
) -> Path:
    """Write float [3, T, H, W] in [-1, 1] (or uint8 [T, H, W, 3]) as an MP4, WebM, MKV, AVI or MOV by
    the file's suffix, with PyAV at `fps`, 4:2:0 chroma (what browsers play: H and W must be even).

    Args:
        codec: an FFmpeg encoder name; None takes the first the bundled FFmpeg has of `VIDEO_CODECS`.
    """
    array = _video_array(video, fps, "save_video")
    height, width = array.shape[1:3]
    if height % 2 or width % 2:
        raise ValueError(
            f"save_video writes 4:2:0 video, which needs an even width and height; got {width}x{height}"
        )
    path = _writable(path)
    codec = codec or video_codec(path.suffix.lower())
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = dict(_QUALITY.get(codec, {}))
        if codec not in _QUALITY:
            stream.bit_rate = 8_000_000
        for frame in array:
            container.mux(
                stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24"))
            )
        container.mux(stream.encode())
    return path


def save_mp4(video: Tensor | np.ndarray, path: str | Path, fps: float = 4.0) -> Path:
    """Write float [3, T, H, W] in [-1, 1] (or uint8 [T, H, W, 3]) as an MP4 (H.264, else MPEG-4 Part 2)."""
    if Path(path).suffix.lower() != ".mp4":
        raise ValueError(f"save_mp4 writes .mp4 files, got {path}; save_video writes the other containers")
    return save_video(video, path, fps)


def save_wav(wave: Tensor | np.ndarray, path: str | Path, sample_rate: int = 16000) -> Path:
    """Write a mono float wave [N] in [-1, 1] as 16-bit PCM (WAV, or FLAC by the file's suffix)."""
    x = torch.as_tensor(wave).detach().float().cpu().numpy()
    if x.ndim != 1 or x.shape[0] == 0:
        raise ValueError(f"save_wav expects a non-empty mono wave [N], got shape {list(x.shape)}")
    if not np.isfinite(x).all():
        raise ValueError("save_wav: the wave holds non-finite samples")
    if np.abs(x).max() > 1.0:
        log.warning("%s: samples beyond [-1, 1] are clipped on writing", path)
    path = _writable(path)
    sf.write(str(path), np.clip(x, -1.0, 1.0), sample_rate, subtype="PCM_16")
    return path


def spectrogram_rgb(wave: Tensor | np.ndarray, sample_rate: int = 16000, n_mels: int = 64) -> np.ndarray:
    """A log-mel spectrogram of a mono wave [N] as an [n_mels, frames, 3] float array in [0, 1] (time left to
    right, low frequencies at the bottom, magma colours, the top 80 dB)."""
    import torchaudio.functional as AF  # imported here: only pictures need them
    from matplotlib import colormaps

    x = torch.as_tensor(wave).detach().float().cpu()
    if x.ndim != 1 or x.shape[0] == 0:
        raise ValueError(f"a spectrogram needs a non-empty mono wave [N], got shape {list(x.shape)}")
    n_fft = 512
    spec = (
        torch.stft(
            torch.nn.functional.pad(x, (0, max(0, n_fft - x.shape[0]))),
            n_fft,
            hop_length=n_fft // 4,
            window=torch.hann_window(n_fft),
            return_complex=True,
        )
        .abs()
        .pow(2)
    )
    mel = AF.melscale_fbanks(n_fft // 2 + 1, 0.0, sample_rate / 2, n_mels, sample_rate).T @ spec
    db = 10 * torch.log10(mel.clamp_min(1e-10))
    db = (db - db.max() + 80).clamp_min(0) / 80  # the top 80 dB, scaled to [0, 1]
    return colormaps["magma"](db.flip(0).numpy())[..., :3]


def save_spectrogram_png(
    wave: Tensor | np.ndarray, path: str | Path, sample_rate: int = 16000, n_mels: int = 64, height: int = 128
) -> Path:
    """Write a log-mel spectrogram of a mono wave [N] as a PNG (`spectrogram_rgb`): a page can show what a
    WAV sounds like at a glance."""
    rgb = spectrogram_rgb(wave, sample_rate, n_mels)
    image = Image.fromarray((rgb * 255).astype(np.uint8))
    image = image.resize((max(image.width * 2, 64), height), Image.Resampling.NEAREST)
    path = _writable(path)
    image.save(path, format="PNG")
    return path
