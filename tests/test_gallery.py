"""The gallery page the demo ends with: every sample's media written next to a Markdown page that shows it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from zoo.media import save_spectrogram_png
from zoo.tasks.multimodal_eval import Evaluation, Sample, interval95, write_gallery
from zoo.world.render import render_image, render_video, to_tensor, verify_image
from zoo.world.scenes import ShapesWorld, verify_caption
from zoo.world.speech import render_speech, verify_speech


def _evaluation() -> Evaluation:
    world = ShapesWorld(seed=0)
    scene = world.scene(0, "val")
    text = world.caption(scene)
    image = to_tensor(render_image(scene))
    wave = torch.from_numpy(render_speech(text, seed=0))
    samples = [
        Sample("text_to_image", scene, text, media=image, score=verify_image(image, scene)),
        Sample("text_to_video", scene, text, media=to_tensor(render_video(scene))),
        Sample("text_to_audio", scene, text, media=wave, score=verify_speech(wave, scene)),
        Sample("image_to_text", scene, text, output=text, media=image, score=verify_caption(text, scene)),
    ]
    metrics = {}
    for task in ("text_to_image", "text_to_video", "text_to_audio", "image_to_text"):
        metrics |= {f"{task}/{k}": 0.5 for k in ("exact", "attribute_accuracy")}
        metrics |= {f"{task}/baseline_{k}": 0.0 for k in ("exact", "attribute_accuracy")}
    return Evaluation(metrics, samples)


def test_gallery_page_links_every_sample_to_a_file_that_exists(tmp_path):
    page = write_gallery(_evaluation(), tmp_path / "gallery")
    text = page.read_text()
    for name in ("text_to_image_000.png", "text_to_video_000.gif", "text_to_audio_000.wav",
                 "text_to_audio_000_spectrogram.png", "image_to_text_000.png"):
        assert (tmp_path / "gallery" / name).is_file(), name
        assert f"({name})" in text, name
    assert "| text_to_audio | 0.50 | 0.50 |  | 0.00 | 0.00 |" in text
    assert "exact, attributes 1.00" in text  # the rendered scene verifies exactly
    assert json.loads((tmp_path / "gallery" / "metrics.json").read_text())["text_to_image/exact"] == 0.5


def test_gallery_shows_every_task_at_a_glance_and_the_held_out_split_with_intervals(tmp_path):
    evaluation = _evaluation()
    evaluation.metrics |= {"image_to_text/exact_ci95_low": 0.3, "image_to_text/exact_ci95_high": 0.7}
    evaluation.metrics |= {f"test/image_to_text/{k}": 0.25 for k in ("exact", "attribute_accuracy")}
    evaluation.metrics |= {f"test/image_to_text/baseline_{k}": 0.0 for k in ("exact", "attribute_accuracy")}
    text = write_gallery(evaluation, tmp_path).read_text()
    assert "| image_to_text | 0.50 [0.30, 0.70] | 0.50 |" in text
    assert "| test/image_to_text | 0.25 | 0.25 |" in text
    overview = Image.open(tmp_path / "overview.png")
    assert overview.width > 400 and overview.height > 4 * 100  # a row per task
    pixels = np.asarray(overview.convert("RGB")).reshape(-1, 3).astype(int)
    green = (abs(pixels - (0x1A, 0x98, 0x50)).sum(1) < 30).sum()  # the exact frames' colour
    assert green > 50


@pytest.mark.parametrize(
    "values, proportion", [([0.0] * 64, True), ([1.0] * 64, True), ([0.5, 1.0] * 32, False)]
)
def test_intervals_hold_the_mean_and_never_collapse_to_a_point_for_proportions(values, proportion):
    low, high = interval95(values, proportion)
    mean = sum(values) / len(values)
    assert 0.0 <= low <= mean <= high <= 1.0
    if proportion:
        assert high - low > 0.02  # Wilson's interval stays open at 0 and 1


def test_spectrogram_picture_shows_a_tone_at_its_height(tmp_path):
    t = np.arange(16000) / 16000
    low = save_spectrogram_png(np.sin(2 * np.pi * 300 * t).astype(np.float32), tmp_path / "low.png")
    high = save_spectrogram_png(np.sin(2 * np.pi * 4000 * t).astype(np.float32), tmp_path / "high.png")

    def brightest_row(path):
        pixels = np.asarray(Image.open(path).convert("L"), dtype=np.float32)
        return int(pixels.mean(axis=1).argmax())

    # Low frequencies are drawn at the bottom (high row index).
    assert brightest_row(low) > brightest_row(high) + 20


def test_spectrogram_refuses_a_stereo_array(tmp_path):
    with pytest.raises(ValueError, match="mono wave"):
        save_spectrogram_png(np.zeros((2, 100), dtype=np.float32), tmp_path / "x.png")


def test_exact_is_also_given_by_the_number_of_objects_and_the_page_shows_it(tmp_path):
    from zoo.tasks.multimodal_eval import _scored

    world = ShapesWorld(seed=0, max_objects=2)
    scenes = world.scenes("val", 24)
    ones = [s for s in scenes if len(s.objects) == 1][:3]
    twos = [s for s in scenes if len(s.objects) == 2][:2]
    # One-object scenes verified against their own render (exact), two-object ones against another's.
    scores = [verify_image(to_tensor(render_image(s)), s) for s in ones]
    scores += [verify_image(to_tensor(render_image(ones[0])), s) for s in twos]
    metrics = _scored("text_to_image", scores, scores, ones + twos)
    assert metrics["text_to_image/exact_objects_1"] == 1.0 and metrics["text_to_image/scenes_objects_1"] == 3
    assert metrics["text_to_image/exact_objects_2"] == 0.0 and metrics["text_to_image/scenes_objects_2"] == 2
    assert metrics["text_to_image/exact"] == pytest.approx(3 / 5)
    text = write_gallery(Evaluation(metrics, []), tmp_path).read_text()
    assert "| 1: 1.00 of 3; 2: 0.00 of 2 |" in text
