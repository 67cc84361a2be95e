"""ShapesWorld in pixels: renderers, pixel verifiers and the image/video datamodule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from zoo.datamodules.media_data import ShapesMediaDataModule
from zoo.world.render import (
    PALETTE,
    cell_bounds,
    object_mask,
    pixels_per_frame,
    read_image_objects,
    read_video_objects,
    render_image,
    render_video,
    to_tensor,
    to_uint8,
    verify_image,
    verify_video,
)
from zoo.world.scenes import COLOURS, SHAPES, SIZES, Scene, ShapeObject, ShapesWorld


def one(colour="red", shape="circle", size="large", row=1, col=1, motion="still") -> Scene:
    return Scene(objects=(ShapeObject(colour, shape, size, row, col, motion),), index=0, split="train")


def centroid(frame: np.ndarray, colour: str) -> np.ndarray:
    ys, xs = np.nonzero((frame == PALETTE[colour]).all(-1))
    return np.array([xs.mean(), ys.mean()])


def blur(x: torch.Tensor) -> torch.Tensor:
    k = torch.tensor([1.0, 2.0, 1.0])
    k = (k[:, None] * k[None]) / 16
    return F.conv2d(F.pad(x[None], (1, 1, 1, 1), mode="replicate"), k.expand(3, 1, 3, 3), groups=3)[0]


@pytest.mark.parametrize("size", [32, 64])
def test_render_image_is_deterministic_uint8_on_black_with_exact_palette_colours(size):
    scene = ShapesWorld(seed=3, max_objects=5).scene(7, "val")
    image = render_image(scene, size)
    assert image.shape == (size, size, 3) and image.dtype == np.uint8
    assert np.array_equal(image, render_image(scene, size))
    colours = {tuple(int(v) for v in p) for p in image.reshape(-1, 3)}
    assert colours == {(0, 0, 0)} | {PALETTE[o.colour] for o in scene.objects}


@pytest.mark.parametrize("size", [32, 64])
def test_every_shape_and_size_draws_a_different_mask_and_large_is_at_least_twice_small(size):
    masks = {}
    for shape in SHAPES:
        for s in SIZES:
            masks[(shape, s)] = object_mask(shape, s, size // 2, size // 2, size)
        assert masks[(shape, "large")].sum() >= 2 * masks[(shape, "small")].sum()
    keys = list(masks)
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            assert (masks[a] != masks[b]).sum() >= 4, (a, b)


@pytest.mark.parametrize("size", [32, 64])
def test_large_objects_stay_inside_their_cell(size):
    b = cell_bounds(size)
    for row in range(3):
        for col in range(3):
            image = render_image(one(shape="circle", size="large", row=row, col=col), size)
            ys, xs = np.nonzero(image.any(-1))
            assert b[row] <= ys.min() and ys.max() < b[row + 1]
            assert b[col] <= xs.min() and xs.max() < b[col + 1]


def test_video_starts_with_the_image_and_moves_objects_a_fixed_step_per_frame():
    objects = (
        ShapeObject("red", "square", "small", 1, 1, "moving left"),
        ShapeObject("cyan", "cross", "large", 0, 0, "moving down"),
        ShapeObject("white", "circle", "small", 2, 2, "still"),
    )
    scene = Scene(objects=objects, index=0, split="train")
    video = render_video(scene, frames=5, size=64)
    assert video.shape == (5, 64, 64, 3) and video.dtype == np.uint8
    assert np.array_equal(video[0], render_image(scene, 64))
    step = pixels_per_frame(64)
    for t in range(5):
        np.testing.assert_allclose(centroid(video[t], "red") - centroid(video[0], "red"), [-step * t, 0])
        np.testing.assert_allclose(centroid(video[t], "cyan") - centroid(video[0], "cyan"), [0, step * t])
        np.testing.assert_allclose(centroid(video[t], "white"), centroid(video[0], "white"))


def test_to_tensor_and_to_uint8_are_inverse_and_channels_first_in_minus_one_one():
    video = render_video(ShapesWorld(seed=1, include_motion=True).scene(2), frames=3, size=32)
    x = to_tensor(video)
    assert x.shape == (3, 3, 32, 32) and x.dtype == torch.float32
    assert x.min() >= -1 and x.max() <= 1 and x.min() == -1
    assert np.array_equal(to_uint8(x), video)
    image = video[1]
    assert to_tensor(image).shape == (3, 32, 32)
    assert np.array_equal(to_uint8(to_tensor(image)), image)


def test_conversions_and_readers_refuse_wrong_layouts_naming_what_was_expected():
    image = render_image(one(), 32)
    with pytest.raises(TypeError, match="uint8"):
        to_tensor(image.astype(np.float32))
    with pytest.raises(ValueError, match=r"\[H, W, 3\]"):
        to_tensor(image[..., :2])
    with pytest.raises(ValueError, match=r"\[3, H, W\]"):
        to_uint8(torch.zeros(4, 32, 32))
    with pytest.raises(ValueError, match="channels first"):
        read_image_objects(image.astype(np.float32))
    with pytest.raises(ValueError, match="square"):
        read_image_objects(image[:, :20])
    with pytest.raises(ValueError, match="size must be an int"):
        render_image(one(), 8)


def test_reading_a_blank_image_gives_none_and_scores_as_unparsed():
    blank = np.zeros((32, 32, 3), dtype=np.uint8)
    assert read_image_objects(blank) is None
    assert not verify_image(blank, one()).parsed


def test_every_colour_shape_size_reads_back_in_every_cell():
    for colour in COLOURS:
        for shape in SHAPES:
            for s in SIZES:
                for size in (32, 64):
                    cell = (len(colour) + len(shape)) % 9  # vary the cell without a 9x loop
                    scene = one(colour, shape, s, cell // 3, cell % 3)
                    assert read_image_objects(render_image(scene, size)) == scene.objects


def test_image_read_back_is_exact_on_200_scenes_and_survives_noise_and_blur():
    world = ShapesWorld(seed=0, min_objects=1, max_objects=6)
    scenes = world.scenes("val", 200)
    clean = np.mean([verify_image(render_image(s), s).exact for s in scenes])
    g = torch.Generator().manual_seed(0)
    noisy = np.mean(
        [
            verify_image(to_tensor(render_image(s)) + 0.05 * torch.randn(3, 32, 32, generator=g), s).exact
            for s in scenes
        ]
    )
    blurred = np.mean([verify_image(blur(to_tensor(render_image(s))), s).exact for s in scenes[:100]])
    swapped = np.mean(
        [verify_image(render_image(s), t).exact for s, t in zip(scenes, scenes[1:], strict=False)]
    )
    assert clean >= 0.99, clean
    assert swapped == 0.0, swapped
    assert noisy >= 0.95, noisy
    assert blurred >= 0.9, blurred


def test_video_read_back_recovers_motion_and_a_wrong_motion_is_not_exact():
    world = ShapesWorld(seed=0, min_objects=1, max_objects=5, include_motion=True)
    scenes = world.scenes("val", 60)
    assert np.mean([verify_video(render_video(s), s).exact for s in scenes]) >= 0.97
    scene = one(motion="moving up")
    assert read_video_objects(to_tensor(render_video(scene)))[0].motion == "moving up"
    assert not verify_video(render_video(one(motion="moving down")), scene).exact


@pytest.mark.parametrize("kind", ["image", "video"])
def test_shapes_media_datamodule_batches_rendered_scenes_that_map_back_by_index(kind):
    dm = ShapesMediaDataModule(kind=kind, size=32, frames=3, train_size=10, val_size=6, batch_size=4, seed=0)
    batch = next(iter(dm.train_dataloader()))
    expected = (4, 3, 32, 32) if kind == "image" else (4, 3, 3, 32, 32)
    assert batch["pixels"].shape == expected and batch["pixels"].dtype == torch.float32
    assert batch["index"].shape == (4,)
    for pixels, index in zip(batch["pixels"], batch["index"].tolist(), strict=True):
        scene = dm.scene(index, "train")
        if kind == "image":
            assert verify_image(pixels, scene).exact
        else:
            assert verify_video(pixels, scene).exact
    val = next(iter(dm.val_dataloader()))
    assert val["index"].tolist() == [0, 1, 2, 3]
    assert torch.equal(val["pixels"][0], dm.render(0, "val")["pixels"])
    with pytest.raises(ValueError, match="kind"):
        ShapesMediaDataModule(kind="sound")
