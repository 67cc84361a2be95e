"""ShapesWorld in pixels: image and video renderers and the verifiers that read scenes back from pixels.

DESIGN.md, "ShapesWorld": every scene renders as an image and a short video, and an exact verifier reads
colour, shape, size, cell and motion back from pixels, so that understanding and generation are
measurable and RL has verifiable rewards (ERNIE 5.0 report, RL stage; issue 3 item 6).

Pixel conventions (shared by the zoo): renderers return uint8 numpy arrays, images [H, W, 3] and videos
[T, H, W, 3]; tensors are float32 in [-1, 1], channels first ([3, H, W], video [3, T, H, W]); `to_tensor`
and `to_uint8` convert between the two.

Geometry. The image is a 3x3 grid of cells of side c = size / 3 on a black background. An object is drawn
around its cell's centre, rounded to a pixel corner, with hard edges (no antialiasing, so a colour is
exact inside its shape): a pixel belongs to the shape when its centre does. The half-extent is 0.30 c
("small") or 0.47 c ("large"): at 32 px a small object spans 6 px and a large one 10 px, and neighbouring
large objects never touch. In a video a moving object travels `pixels_per_frame(size)` pixels per frame
(1 at 32 px, 2 at 64 px) in its direction, about 0.4 of a cell over 5 frames; frame 0 is the image.

Reading back is tolerant of blur and noise, since generated images are blurry: each pixel is explained as
alpha * palette colour over black (the colour with the smallest residual), a cell's colour is the one with
the most alpha mass, and its (shape, size) is the template, rendered by this file at every small shift,
with the best soft IoU against the alpha map. Motion is read by analysis by synthesis: each object takes
the motion whose rendered video is closest to the frames (coordinate descent over objects).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

from zoo.world.scenes import (
    COLOURS,
    GRID_SIZE,
    MOTIONS,
    SHAPES,
    SIZES,
    CaptionScore,
    Scene,
    ShapeObject,
    score_objects,
)

# Pure-ish RGB so that every pair is at least ~115/255 apart and a blurred edge (alpha * colour) still
# reads as its own colour.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "purple": (150, 0, 255),
    "orange": (255, 128, 0),
    "white": (255, 255, 255),
    "cyan": (0, 255, 255),
}
BACKGROUND: tuple[int, int, int] = (0, 0, 0)
# Half-extent of a shape as a fraction of the cell side.
SIZE_EXTENT: dict[str, float] = {"small": 0.30, "large": 0.47}
# (dx, dy) per frame in units of `pixels_per_frame`; y grows downwards.
MOTION_DIRECTIONS: dict[str, tuple[int, int]] = {
    "still": (0, 0),
    "moving left": (-1, 0),
    "moving right": (1, 0),
    "moving up": (0, -1),
    "moving down": (0, 1),
}
MIN_SIZE = 12
_PALETTE_FLOAT = np.array([PALETTE[c] for c in COLOURS], dtype=np.float32) / 255.0  # [8, 3]


def pixels_per_frame(size: int) -> int:
    """How far a moving object travels per video frame at image side `size` (1 px at 32, 2 px at 64)."""
    return max(1, round(size / 32))


def _check_size(size: object, name: str = "size") -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < MIN_SIZE:
        raise ValueError(f"{name} must be an int >= {MIN_SIZE} (pixels per image side), got {size!r}")
    return size


def cell_bounds(size: int) -> list[int]:
    """Pixel boundaries of the grid's rows (and columns): cell i spans [b[i], b[i+1])."""
    return [round(i * size / GRID_SIZE) for i in range(GRID_SIZE + 1)]


def cell_centre(row: int, col: int, size: int) -> tuple[int, int]:
    """(y, x) of a cell's centre, rounded to a pixel corner so that shapes come out symmetric."""
    c = size / GRID_SIZE
    return round((row + 0.5) * c), round((col + 0.5) * c)


def _inside(shape: str, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Whether normalised coordinates (u right, v down, the shape's half-extent = 1) lie in the shape."""
    au, av = np.abs(u), np.abs(v)
    if shape == "circle":
        return u * u + v * v <= 1.0
    if shape == "square":  # smaller than its box so its area stays apart from the circle's
        return (au <= 0.78) & (av <= 0.78)
    if shape == "diamond":
        return au + av <= 1.05
    if shape == "cross":
        return ((au <= 0.36) & (av <= 1.0)) | ((av <= 0.36) & (au <= 1.0))
    if shape == "triangle":  # apex up
        return (v >= -1.0) & (v <= 0.85) & (au <= (v + 1.0) * 0.54)
    raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")


@functools.lru_cache(maxsize=4096)
def object_mask(shape: str, size_name: str, cy: int, cx: int, size: int) -> np.ndarray:
    """Boolean [size, size] mask of a shape of `size_name` centred at pixel corner (cy, cx) (read-only)."""
    if size_name not in SIZE_EXTENT:
        raise ValueError(f"size_name must be one of {SIZES}, got {size_name!r}")
    extent = SIZE_EXTENT[size_name] * size / GRID_SIZE
    ys = (np.arange(size, dtype=np.float32) + 0.5 - cy) / extent
    xs = (np.arange(size, dtype=np.float32) + 0.5 - cx) / extent
    mask = _inside(shape, xs[None, :], ys[:, None])
    mask.setflags(write=False)
    return mask


def _check_scene(scene: object) -> Scene:
    if not isinstance(scene, Scene):
        raise TypeError(f"scene must be a ShapesWorld Scene, got {type(scene).__name__}")
    return scene


def _draw(objects: tuple[ShapeObject, ...], size: int, t: int) -> np.ndarray:
    image = np.zeros((size, size, 3), dtype=np.uint8)
    image[:] = BACKGROUND
    step = pixels_per_frame(size) * t
    for o in objects:  # reading order: a later object covers an earlier one where they overlap
        cy, cx = cell_centre(o.row, o.col, size)
        dx, dy = MOTION_DIRECTIONS[o.motion]
        image[object_mask(o.shape, o.size, cy + dy * step, cx + dx * step, size)] = PALETTE[o.colour]
    return image


def render_image(scene: Scene, size: int = 32) -> np.ndarray:
    """The scene as a uint8 [size, size, 3] image (deterministic; motion is ignored)."""
    _check_scene(scene)
    return _draw(scene.objects, _check_size(size), 0)


def render_video(scene: Scene, frames: int = 5, size: int = 32) -> np.ndarray:
    """The scene as a uint8 [frames, size, size, 3] video: frame 0 is `render_image(scene, size)`, and each
    moving object travels `pixels_per_frame(size)` pixels per frame in its direction (clipped at the
    image border); still objects stay."""
    _check_scene(scene)
    _check_size(size)
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
        raise ValueError(f"frames must be an int >= 1, got {frames!r}")
    return np.stack([_draw(scene.objects, size, t) for t in range(frames)])


# ---------------------------------------------------------------- tensors


def to_tensor(array: np.ndarray) -> Tensor:
    """uint8 [H, W, 3] -> float32 [3, H, W] in [-1, 1]; uint8 [T, H, W, 3] -> float32 [3, T, H, W]."""
    if not isinstance(array, np.ndarray) or array.dtype != np.uint8:
        what = f"{type(array).__name__} of dtype {getattr(array, 'dtype', None)}"
        raise TypeError(f"to_tensor expects a uint8 numpy array [H, W, 3] or [T, H, W, 3], got {what}")
    if array.ndim not in (3, 4) or array.shape[-1] != 3:
        raise ValueError(f"to_tensor expects shape [H, W, 3] or [T, H, W, 3], got {list(array.shape)}")
    x = torch.from_numpy(np.ascontiguousarray(array)).float() / 127.5 - 1.0
    return x.permute(2, 0, 1).contiguous() if array.ndim == 3 else x.permute(3, 0, 1, 2).contiguous()


def to_uint8(tensor: Tensor) -> np.ndarray:
    """float [3, H, W] -> uint8 [H, W, 3]; float [3, T, H, W] -> uint8 [T, H, W, 3] (the inverse of
    `to_tensor`; values outside [-1, 1] are clipped)."""
    if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
        what = type(tensor).__name__ + (f" of dtype {tensor.dtype}" if isinstance(tensor, Tensor) else "")
        raise TypeError(f"to_uint8 expects a float tensor [3, H, W] or [3, T, H, W] in [-1, 1], got {what}")
    if tensor.dim() not in (3, 4) or tensor.shape[0] != 3:
        raise ValueError(f"to_uint8 expects shape [3, H, W] or [3, T, H, W], got {list(tensor.shape)}")
    x = ((tensor.detach().float().cpu().clamp(-1.0, 1.0) + 1.0) * 127.5).round().to(torch.uint8)
    x = x.permute(1, 2, 0) if tensor.dim() == 3 else x.permute(1, 2, 3, 0)
    return x.contiguous().numpy()


def _as_float_frames(pixels: np.ndarray | Tensor, video: bool) -> np.ndarray:
    """Any accepted pixel layout -> float32 [T, H, W, 3] in [0, 1] (T = 1 for an image)."""
    what = "video" if video else "image"
    layouts = (
        "uint8 [T, H, W, 3] or float [3, T, H, W] in [-1, 1]"
        if video
        else ("uint8 [H, W, 3] or float [3, H, W] in [-1, 1]")
    )
    if isinstance(pixels, Tensor):
        if pixels.dtype == torch.uint8:
            pixels = pixels.cpu().numpy()
        else:
            pixels = pixels.detach().float().cpu().numpy()
    if not isinstance(pixels, np.ndarray):
        raise TypeError(f"{what} must be a numpy array or tensor ({layouts}), got {type(pixels).__name__}")
    ndim = 4 if video else 3
    if pixels.ndim != ndim:
        raise ValueError(f"{what} must be {layouts}, got shape {list(pixels.shape)}")
    if pixels.dtype == np.uint8:
        if pixels.shape[-1] != 3:
            raise ValueError(f"a uint8 {what} must be channels last ({layouts}), got {list(pixels.shape)}")
        x = pixels.astype(np.float32) / 255.0
    elif np.issubdtype(pixels.dtype, np.floating):
        if pixels.shape[0] != 3:
            raise ValueError(f"a float {what} must be channels first ({layouts}), got {list(pixels.shape)}")
        x = (np.moveaxis(pixels.astype(np.float32), 0, -1) + 1.0) / 2.0
    else:
        raise TypeError(f"{what} must be {layouts}, got dtype {pixels.dtype}")
    if not np.isfinite(x).all():
        raise ValueError(f"{what} holds non-finite values")
    x = np.clip(x, 0.0, 1.0)
    if not video:
        x = x[None]
    if x.shape[1] != x.shape[2] or x.shape[1] < MIN_SIZE:
        raise ValueError(
            f"{what} frames must be square and at least {MIN_SIZE} px, got {x.shape[1]}x{x.shape[2]}"
        )
    return x


# ---------------------------------------------------------------- reading pixels back


def _explain(frame: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per pixel of a [H, W, 3] frame in [0, 1]: the palette index that best explains it as alpha * colour
    over black, and that alpha."""
    norms = (_PALETTE_FLOAT**2).sum(1)  # [8]
    alpha = np.clip(frame @ _PALETTE_FLOAT.T / norms, 0.0, 1.0)  # [H, W, 8]
    residual = ((frame[..., None, :] - alpha[..., None] * _PALETTE_FLOAT) ** 2).sum(-1)
    label = residual.argmin(-1)
    return label, np.take_along_axis(alpha, label[..., None], -1)[..., 0]


def _blur(mask: np.ndarray) -> np.ndarray:
    """A [1, 2, 1] / 4 binomial blur along both axes (zero outside)."""
    padded = np.pad(mask, 1)
    rows = (padded[:-2] + 2 * padded[1:-1] + padded[2:]) / 4
    return (rows[:, :-2] + 2 * rows[:, 1:-1] + rows[:, 2:]) / 4


@functools.lru_cache(maxsize=64)
def _templates(row: int, col: int, size: int) -> tuple[np.ndarray, list[tuple[str, str]]]:
    """Every (shape, size) mask of a cell at every shift up to `pixels_per_frame` and three blur levels,
    cropped to the cell: float [K, h, w] and the (shape, size) of each."""
    b = cell_bounds(size)
    cy, cx = cell_centre(row, col, size)
    reach = pixels_per_frame(size)
    masks, labels = [], []
    for shape in SHAPES:
        for size_name in SIZES:
            for dy in range(-reach, reach + 1):
                for dx in range(-reach, reach + 1):
                    m = object_mask(shape, size_name, cy + dy, cx + dx, size).astype(np.float32)
                    # Sharp and blurred versions: a generated image is rarely sharp, and blur makes a
                    # thin cross look like a sharp diamond.
                    for version in (m, _blur(m), _blur(_blur(m))):
                        masks.append(version[b[row] : b[row + 1], b[col] : b[col + 1]])
                        labels.append((shape, size_name))
    stacked = np.stack(masks)
    stacked.setflags(write=False)
    return stacked, labels


def _read_frame(frame: np.ndarray) -> list[ShapeObject]:
    size = frame.shape[0]
    b = cell_bounds(size)
    label, alpha = _explain(frame)
    cell_area = (size / GRID_SIZE) ** 2
    objects = []
    for row in range(GRID_SIZE):
        for col in range(GRID_SIZE):
            ys, xs = slice(b[row], b[row + 1]), slice(b[col], b[col + 1])
            cell_label, cell_alpha = label[ys, xs], alpha[ys, xs]
            lit = cell_alpha >= 0.2  # below this a pixel is background, noise or a faint edge
            mass = np.bincount(cell_label[lit], weights=cell_alpha[lit], minlength=len(COLOURS))
            colour = int(mass.argmax())
            # The smallest object (a small square) covers ~0.14 of the cell; blur spreads but keeps mass.
            if mass[colour] < 0.05 * cell_area:
                continue
            soft = np.where(cell_label == colour, cell_alpha, 0.0).astype(np.float32)
            masks, names = _templates(row, col, size)
            iou = np.minimum(masks, soft).sum((1, 2)) / np.maximum(masks, soft).sum((1, 2)).clip(1e-6)
            shape, size_name = names[int(iou.argmax())]
            objects.append(ShapeObject(COLOURS[colour], shape, size_name, row, col))
    return objects


def read_image_objects(image: np.ndarray | Tensor) -> tuple[ShapeObject, ...] | None:
    """The objects an image shows (colour, shape, size, cell; motion "still"), None when it shows none.

    Args:
        image: uint8 [H, W, 3], or float [3, H, W] in [-1, 1] (numpy or torch); square, any side >= 12.
    """
    objects = _read_frame(_as_float_frames(image, video=False)[0])
    return tuple(objects) or None


def _motion_error(frames: np.ndarray, objects: tuple[ShapeObject, ...]) -> float:
    scene = Scene(objects=objects, index=0, split="train")
    rendered = render_video(scene, frames=frames.shape[0], size=frames.shape[1]).astype(np.float32) / 255.0
    return float(((rendered[1:] - frames[1:]) ** 2).sum())


def read_video_objects(video: np.ndarray | Tensor) -> tuple[ShapeObject, ...] | None:
    """The objects a video shows, with their motion; None when its first frame shows none.

    Colour, shape, size and cell come from frame 0; each object's motion is the one whose rendered video
    best matches frames 1.. (sum of squared differences), chosen object by object, twice over, so that
    objects that meet mid-video are explained together.

    Args:
        video: uint8 [T, H, W, 3], or float [3, T, H, W] in [-1, 1] (numpy or torch).
    """
    frames = _as_float_frames(video, video=True)
    objects = _read_frame(frames[0])
    if not objects or frames.shape[0] == 1:
        return tuple(objects) or None
    for _ in range(2):
        for i, o in enumerate(objects):
            errors = []
            for motion in MOTIONS:
                trial = list(objects)
                trial[i] = ShapeObject(o.colour, o.shape, o.size, o.row, o.col, motion)
                errors.append(_motion_error(frames, tuple(trial)))
            best = MOTIONS[int(np.argmin(errors))]
            objects[i] = ShapeObject(o.colour, o.shape, o.size, o.row, o.col, best)
    return tuple(objects)


def verify_image(image: np.ndarray | Tensor, scene: Scene) -> CaptionScore:
    """Score the objects read from an image against the scene (motion ignored)."""
    return score_objects(read_image_objects(image), _check_scene(scene).objects)


def verify_video(video: np.ndarray | Tensor, scene: Scene) -> CaptionScore:
    """Score the objects read from a video, motion included, against the scene."""
    return score_objects(read_video_objects(video), _check_scene(scene).objects, include_motion=True)


def _blur_pixels(pixels: Tensor) -> Tensor:
    """[1, 2, 1] binomial blur of a [3, H, W] tensor: a stand-in for a generator's soft output."""
    kernel = torch.tensor([1.0, 2.0, 1.0])
    kernel = (kernel[:, None] * kernel[None]) / 16
    padded = torch.nn.functional.pad(pixels[None], (1, 1, 1, 1), mode="replicate")
    return torch.nn.functional.conv2d(padded, kernel.expand(3, 1, 3, 3), groups=3)[0]


def readback_accuracy(n: int = 200, seed: int = 0, max_objects: int = 6) -> dict[str, float]:
    """Share of `n` "val" scenes read back exactly: images at 32 and 64 px, clean, with Gaussian noise
    (sigma 0.05 in [-1, 1] units) and blurred; videos (5 frames, motion included) at 32 and 64 px."""
    from zoo.world.scenes import ShapesWorld

    world = ShapesWorld(seed=seed, max_objects=max_objects, include_motion=True)
    scenes = world.scenes("val", n)
    g = torch.Generator().manual_seed(seed)
    result: dict[str, float] = {"scenes": n}
    for size in (32, 64):
        images = [to_tensor(render_image(s, size)) for s in scenes]
        noisy = [x + 0.05 * torch.randn(x.shape, generator=g) for x in images]
        for name, pixels in (("clean", images), ("noisy", noisy), ("blurred", map(_blur_pixels, images))):
            exact = [verify_image(x, s).exact for x, s in zip(pixels, scenes, strict=True)]
            result[f"image{size}_{name}_exact"] = float(np.mean(exact))
        exact = [verify_video(render_video(s, 5, size), s).exact for s in scenes]
        result[f"video{size}_exact"] = float(np.mean(exact))
    return result


if __name__ == "__main__":  # python -m zoo.world.render: the figures in docs/world_media.md
    import json

    torch.set_num_threads(1)
    print(json.dumps(readback_accuracy()))
