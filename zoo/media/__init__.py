"""The media layer: real images, videos and audio in and out, from paths or bytes, as the zoo's tensors.

Low in the house (no Lightning, no model imports): datamodules, `zoo tokenize`, an inference pipeline and
a server all decode media through it. Conventions: pixels float32 in [-1, 1], channels first ([3, H, W],
video [3, T, H, W]); audio float32 mono [N] at the requested rate. Every refusal is a `MediaError` (a
`ValueError`) whose message starts with the file or sample at fault.

    errors.py      MediaError, MissingMediaError, sources (path or bytes), notices said once
    kinds.py       kind_of: image, video or audio by file suffix or WebDataset key
    resize.py      the resize policy (`fit`: center_crop, pad, stretch) shared by images and video
    images.py      load_image / decode_image: any mode, EXIF orientation, pixel cap, JPEG draft
    audio.py       load_audio: WAV, FLAC, OGG/Vorbis, Opus, MP3 (libsndfile), soxr resampling, mono
    clips.py       which frames make a video clip: target fps, clip start, short-video policy
    containers.py  MP4/WebM/MKV/AVI decoding with PyAV, or torchcodec when it loads
    video.py       load_video: containers, animated GIF, folders of frames
    writing.py     save_png, save_gif, save_video / save_mp4, save_wav, save_spectrogram_png
"""

from zoo.media.audio import load_audio
from zoo.media.clips import ClipSpec, ClipStart, ShortVideo
from zoo.media.errors import MediaError, MediaSource, MissingMediaError
from zoo.media.images import DEFAULT_MAX_PIXELS, decode_image, load_image
from zoo.media.kinds import AUDIO_SUFFIXES, IMAGE_SUFFIXES, VIDEO_SUFFIXES, MediaKind, kind_of
from zoo.media.resize import Fit, fit_frame
from zoo.media.video import load_video
from zoo.media.writing import save_gif, save_mp4, save_png, save_spectrogram_png, save_video, save_wav

__all__ = [
    "AUDIO_SUFFIXES",
    "IMAGE_SUFFIXES",
    "VIDEO_SUFFIXES",
    "MediaKind",
    "kind_of",
    "DEFAULT_MAX_PIXELS",
    "ClipSpec",
    "ClipStart",
    "Fit",
    "MediaError",
    "MediaSource",
    "MissingMediaError",
    "ShortVideo",
    "decode_image",
    "fit_frame",
    "load_audio",
    "load_image",
    "load_video",
    "save_gif",
    "save_mp4",
    "save_png",
    "save_spectrogram_png",
    "save_video",
    "save_wav",
]
