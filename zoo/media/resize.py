"""How a picture of any size becomes the tokenizer's size: the resize policy shared by images and video.

`fit` chooses what happens when the picture's aspect ratio differs from the target's:

- "center_crop" (default): scale so that the picture covers the target (the short side meets it), then
  keep the centre. Nothing is distorted; the edges of the long side are lost. What CLIP, open_clip and
  the VAR/MAGVIT tokenizers train on.
- "pad": scale so that the whole picture fits inside the target, then pad the rest with black (the
  ShapesWorld background). Nothing is lost or distorted; the borders carry no content.
- "stretch": scale each side to the target independently. Nothing is lost; shapes are distorted.

Resizing uses Pillow's bicubic filter, which widens its support when it shrinks, so downscaling is
antialiased (no moire from dropping pixels). A picture already at the target size is returned unchanged.
That a policy was applied to a picture of another aspect ratio is said once per process at WARNING level
(a corpus of phone photos would otherwise print one line per file).
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from PIL import Image

from zoo.media.errors import warn_once

Fit = Literal["center_crop", "pad", "stretch"]
FITS: tuple[str, ...] = ("center_crop", "pad", "stretch")
Size = int | tuple[int, int]
"""A square side, or (height, width)."""

_FILTER = Image.Resampling.BICUBIC


def check_size(size: Size | None) -> tuple[int, int] | None:
    """`size` as (height, width), None kept; anything else is refused with what was expected."""
    if size is None:
        return None
    pair = (size, size) if isinstance(size, int) else tuple(size) if isinstance(size, list | tuple) else ()
    if len(pair) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in pair):
        raise ValueError(f"size must be None, an int >= 1 or (height, width) of ints >= 1, got {size!r}")
    return pair  # type: ignore[return-value]


def check_fit(fit: str) -> None:
    if fit not in FITS:
        raise ValueError(f"fit must be one of {', '.join(FITS)}, got {fit!r}")


def scaled_size(height: int, width: int, target: tuple[int, int], fit: Fit) -> tuple[int, int]:
    """The (height, width) a `height` x `width` picture is resized to before cropping or padding."""
    th, tw = target
    if fit == "stretch":
        return th, tw
    pick = max if fit == "center_crop" else min
    scale = pick(th / height, tw / width)
    # Rounded, then held to the target on the side that must meet it exactly.
    h, w = max(1, round(height * scale)), max(1, round(width * scale))
    if fit == "center_crop":
        return max(h, th), max(w, tw)
    return min(h, th), min(w, tw)


def needed_scale(height: int, width: int, target: tuple[int, int], fit: Fit) -> float:
    """The largest factor by which a `height` x `width` picture shrinks under `fit` (1 when it grows):
    what a decoder may skip, e.g. JPEG's reduced-scale decoding."""
    h, w = scaled_size(height, width, target, fit)
    return max(1.0, min(height / h, width / w))


def fit_frame(array: np.ndarray, size: Size | None, fit: Fit = "center_crop", where: str = "") -> np.ndarray:
    """uint8 [H, W, 3] -> uint8 [h, w, 3] at `size` by the `fit` policy (module docstring); None keeps it."""
    target = check_size(size)
    height, width = array.shape[:2]
    if target is None or (height, width) == target:
        return array
    th, tw = target
    if not math.isclose(height * tw, width * th, rel_tol=0.01):
        warn_once(
            f"fit {fit}",
            f"pictures whose aspect ratio differs from the target {tw}x{th} are resized by fit={fit!r} "
            f"(first: {where or 'a picture'}, {width}x{height}); said once",
        )
    h, w = scaled_size(height, width, target, fit)
    image = Image.fromarray(array)
    if (h, w) != (height, width):
        image = image.resize((w, h), _FILTER)
    resized = np.asarray(image, dtype=np.uint8)
    if (h, w) == target:
        return resized
    if fit == "center_crop":
        top, left = (h - th) // 2, (w - tw) // 2
        return resized[top : top + th, left : left + tw]
    canvas = np.zeros((th, tw, 3), np.uint8)
    top, left = (th - h) // 2, (tw - w) // 2
    canvas[top : top + h, left : left + w] = resized
    return canvas
