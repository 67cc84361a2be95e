"""Images of any size and mode, from a path or bytes, as the zoo's pixels (REFERENCES.md Part C section 8).

The order of operations is Pillow's recommended one, each step explicit:
1. open: reads the header only; the pixel cap (`max_pixels`, default Pillow's own warning threshold of
   89,478,485) is checked here, before any pixel is decoded, and Pillow's `DecompressionBombError` (not an
   `OSError`) becomes a `MediaError`;
2. JPEG reduced-scale decoding (`Image.draft`) when the image is at least four times the size the resize
   needs, keeping at least twice that size so the antialiased resize still does the last step;
3. decode, then EXIF orientation (`ImageOps.exif_transpose`): a phone photo stored sideways reads upright.
   Malformed EXIF (Pillow raises from a zoo of exception types) is said once and the image used as stored;
4. mode to RGB, every conversion spelled out (`rgb_array`): grey replicated, transparency composited on
   black, 16-bit scaled (not clamped at 255, which is what `convert("RGB")` does);
5. resize by the `fit` policy of `zoo.media.resize`.
"""

from __future__ import annotations

import math
import struct
import warnings

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch import Tensor

from zoo.media.errors import MediaError, MediaSource, describe, open_source, warn_once
from zoo.media.resize import Fit, Size, check_fit, check_size, fit_frame, needed_scale

DEFAULT_MAX_PIXELS = 89_478_485
"""Pillow's `MAX_IMAGE_PIXELS` (it warns above it and refuses above twice it): 9459 x 9459."""

_ORIENTATION = 0x0112
_SWAPS_AXES = (5, 6, 7, 8)  # EXIF orientations that turn the picture by a quarter
PILLOW_ERRORS = (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError, struct.error)


def rgb_array(image: Image.Image, where: str) -> np.ndarray:
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
    if mode in ("CMYK", "YCbCr", "LAB", "HSV", "RGBX"):
        return np.asarray(image.convert("RGB"), dtype=np.uint8)
    raise MediaError(
        f"{where}: image mode {mode!r} is not supported; expected RGB, RGBA, grayscale, 16-bit grayscale, "
        "CMYK or palette"
    )


def to_pixels(array: np.ndarray) -> Tensor:
    """uint8 [H, W, 3] -> float32 [3, H, W] in [-1, 1]."""
    return torch.from_numpy(np.array(array, dtype=np.uint8)).float().div(127.5).sub(1.0).permute(2, 0, 1)


def check_max_pixels(max_pixels: int) -> None:
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1:
        raise ValueError(f"max_pixels must be an int >= 1, got {max_pixels!r}")


def refuse_oversized(width: int, height: int, max_pixels: int, where: str) -> None:
    """The pixel cap, checked from the header before anything is decoded."""
    if width * height > max_pixels:
        raise MediaError(
            f"{where}: {width}x{height} = {width * height:,} pixels is over the cap of {max_pixels:,} "
            "(max_pixels); refused before decoding, as a decompression bomb would be"
        )
    if width == 0 or height == 0:
        raise MediaError(f"{where}: image is empty ({width}x{height})")


def _open(source: MediaSource, where: str) -> Image.Image:
    file = open_source(source, "an image file")
    try:
        with warnings.catch_warnings():
            # Pillow warns above its threshold; our own cap (checked next) decides instead.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(file)
    except Image.DecompressionBombError as error:
        raise MediaError(
            f"{where}: refused as a decompression bomb ({error}); Pillow refuses above "
            f"{2 * Image.MAX_IMAGE_PIXELS:,} pixels whatever max_pixels says"
        ) from error
    except PILLOW_ERRORS as error:
        raise MediaError(f"{where}: cannot read image ({error}); expected an intact image file") from error


def _orientation(image: Image.Image) -> int:
    try:
        return int(image.getexif().get(_ORIENTATION, 1))
    except Exception:  # malformed EXIF; said by `_upright` when it transposes
        return 1


def _draft(image: Image.Image, target: tuple[int, int] | None, fit: Fit) -> None:
    """Ask a JPEG decoder for a reduced scale (1/2, 1/4, 1/8) when the resize would shrink it 4x or more."""
    if target is None or image.format != "JPEG":
        return
    width, height = image.size
    shown = (width, height) if _orientation(image) not in _SWAPS_AXES else (height, width)
    spare = needed_scale(shown[1], shown[0], target, fit) / 2  # keep twice the size the resize needs
    if spare >= 2:
        image.draft(None, (math.ceil(width / spare), math.ceil(height / spare)))


def _upright(image: Image.Image, where: str) -> None:
    try:
        ImageOps.exif_transpose(image, in_place=True)
    except Exception as error:  # Pillow's EXIF parser raises SyntaxError, ValueError, TypeError, ...
        warn_once(
            "malformed exif",
            f"{where}: malformed EXIF ({type(error).__name__}: {error}); images with malformed EXIF are used "
            "as stored, without their orientation (said once)",
        )


def decode_image(
    source: MediaSource,
    size: Size | None = None,
    *,
    fit: Fit = "center_crop",
    name: str | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> np.ndarray:
    """An image as uint8 [H, W, 3], upright; not resized, but a JPEG much larger than `size` needs may come
    back decoded at 1/2, 1/4 or 1/8 scale (still at least twice what `fit` to `size` needs).

    Args: as `load_image`.
    """
    target = check_size(size)
    check_fit(fit)
    check_max_pixels(max_pixels)
    where = describe(source, name)
    with _open(source, where) as image:
        refuse_oversized(image.width, image.height, max_pixels, where)
        _draft(image, target, fit)
        try:
            image.load()
        except PILLOW_ERRORS as error:
            raise MediaError(
                f"{where}: cannot decode image ({error}); expected an intact, complete image file"
            ) from error
        _upright(image, where)
        return rgb_array(image, where)


def load_image(
    source: MediaSource,
    size: Size | None = None,
    *,
    fit: Fit = "center_crop",
    name: str | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> Tensor:
    """An image as float32 [3, H, W] in [-1, 1], upright (EXIF orientation applied).

    Args:
        source: a path, or the bytes of a PNG, JPEG, WebP, BMP, TIFF, GIF, ... (anything Pillow reads).
        size: resize to size x size, or to (height, width), by `fit`; None keeps the image's own size.
        fit: "center_crop", "pad" or "stretch" (see `zoo.media.resize`).
        name: what errors call a bytes source (e.g. the WebDataset sample key).
        max_pixels: images of more pixels are refused with `MediaError` before decoding.

    Refused with `MediaError` naming the source: unreadable, corrupt or truncated files, empty images,
    decompression bombs and images over `max_pixels`; a missing path raises `MissingMediaError` (both a
    `MediaError` and a `FileNotFoundError`).
    """
    where = describe(source, name)
    array = decode_image(source, size, fit=fit, name=name, max_pixels=max_pixels)
    return to_pixels(fit_frame(array, size, fit, where))
