"""Real media files: loaders convert explicitly and refuse bad files by name; manifests feed a datamodule."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image

from zoo.datamodules.manifests import read_manifest
from zoo.datamodules.media_data import ManifestMediaDataModule
from zoo.media import MediaError, load_audio, load_image, load_video, save_gif, save_png, save_wav
from zoo.media.errors import reset_notices
from zoo.world.render import render_image, render_video, to_tensor, verify_image, verify_video
from zoo.world.scenes import ShapesWorld
from zoo.world.speech import render_speech, verify_speech


@pytest.fixture(autouse=True)
def fresh_notices():
    """Notices are said once per process; each test starts as a fresh process would."""
    reset_notices()


def tone(n=16000, rate=16000, amplitude=0.3) -> np.ndarray:
    return (amplitude * np.sin(2 * np.pi * 440 * np.arange(n) / rate)).astype(np.float32)


# ---------------------------------------------------------------- images


def test_png_round_trip_keeps_a_rendered_scene_readable(tmp_path):
    scene = ShapesWorld(seed=0).scene(4)
    path = save_png(to_tensor(render_image(scene, 32)), tmp_path / "out" / "scene.png")
    image = load_image(path)
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32
    assert torch.equal(image, to_tensor(render_image(scene, 32)))
    assert verify_image(image, scene).exact


def test_grayscale_is_replicated_and_rgba_is_composited_on_black(tmp_path):
    Image.fromarray(np.full((8, 8), 255, np.uint8), mode="L").save(tmp_path / "grey.png")
    grey = load_image(tmp_path / "grey.png")
    assert grey.shape == (3, 8, 8) and torch.all(grey == 1)
    rgba = np.zeros((8, 8, 4), np.uint8)
    rgba[..., 0], rgba[..., 3] = 255, 0
    rgba[:4, :, 3] = 255
    Image.fromarray(rgba, mode="RGBA").save(tmp_path / "rgba.png")
    x = load_image(tmp_path / "rgba.png")
    assert torch.all(x[0, :4] == 1) and torch.all(x[:, 4:] == -1)  # transparent half is black


def test_wrong_size_is_resized_only_when_asked(tmp_path):
    Image.fromarray(np.zeros((40, 40, 3), np.uint8)).save(tmp_path / "a.png")
    assert load_image(tmp_path / "a.png").shape == (3, 40, 40)
    assert load_image(tmp_path / "a.png", size=32).shape == (3, 32, 32)
    Image.fromarray(np.zeros((20, 40, 3), np.uint8)).save(tmp_path / "wide.png")
    assert load_image(tmp_path / "wide.png", size=16).shape == (3, 16, 16)


def test_corrupt_truncated_and_missing_images_are_refused_by_name(tmp_path):
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\nthis is not a png")
    with pytest.raises(MediaError, match="corrupt.png"):
        load_image(tmp_path / "corrupt.png")
    Image.fromarray(np.zeros((32, 32, 3), np.uint8) + 50).save(tmp_path / "full.png")
    data = (tmp_path / "full.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(MediaError, match="cut.png"):
        load_image(tmp_path / "cut.png")
    with pytest.raises(FileNotFoundError, match="nothere.png"):
        load_image(tmp_path / "nothere.png")


# ---------------------------------------------------------------- videos


def test_gif_round_trip_keeps_frames_even_when_consecutive_frames_are_identical(tmp_path):
    world = ShapesWorld(seed=1, include_motion=True)
    scene = world.scene(0)
    video = to_tensor(render_video(scene, frames=5, size=32))
    load = load_video(save_gif(video, tmp_path / "v.gif", fps=4))
    assert load.shape == (3, 5, 32, 32)
    assert torch.equal(load, video)
    assert verify_video(load, scene).exact
    still = video[:, :1].repeat(1, 4, 1, 1)
    assert load_video(save_gif(still, tmp_path / "still.gif")).shape == (3, 4, 32, 32)


def test_folder_of_png_frames_loads_in_numeric_order(tmp_path):
    for t in (0, 1, 2, 10):
        frame = np.zeros((16, 16, 3), np.uint8) + t * 20
        Image.fromarray(frame).save(tmp_path / f"frame_{t}.png")
    video = load_video(tmp_path, size=8)
    assert video.shape == (3, 4, 8, 8)
    levels = ((video[0, :, 0, 0] + 1) * 127.5).round().tolist()
    assert levels == [0, 20, 40, 200]


def test_empty_short_and_corrupt_videos_are_refused_by_name(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(MediaError, match="empty video"):
        load_video(tmp_path / "empty")
    video = torch.zeros(3, 2, 8, 8)
    save_gif(video, tmp_path / "short.gif")
    with pytest.raises(MediaError, match=r"short.gif.*2 frames; expected at least 5"):
        load_video(tmp_path / "short.gif", frames=5)
    (tmp_path / "bad.gif").write_bytes(b"GIF89a garbage")
    with pytest.raises(MediaError, match="bad.gif"):
        load_video(tmp_path / "bad.gif")


# ---------------------------------------------------------------- audio


def test_wav_and_flac_round_trip_speech_that_still_reads_back(tmp_path):
    world = ShapesWorld(seed=0)
    scene = world.scene(1)
    wave = render_speech(world.caption(scene), seed=3)
    for name in ("s.wav", "s.flac"):
        loaded = load_audio(save_wav(wave, tmp_path / name))
        assert loaded.dtype == torch.float32 and loaded.shape == (len(wave),)
        assert torch.allclose(loaded, torch.from_numpy(wave), atol=1e-4)
        assert verify_speech(loaded, scene).exact


def test_other_rates_are_resampled_and_said_once_and_stereo_is_downmixed(tmp_path, caplog):
    sf.write(tmp_path / "a.wav", tone(44100, 44100), 44100)
    sf.write(tmp_path / "b.wav", tone(44100, 44100), 44100)
    stereo = np.stack([tone(), -0.5 * tone()], axis=1)
    sf.write(tmp_path / "stereo.wav", stereo, 16000)
    with caplog.at_level(logging.INFO, logger="zoo.media"):
        a = load_audio(tmp_path / "a.wav")
        load_audio(tmp_path / "b.wav")
        mono = load_audio(tmp_path / "stereo.wav")
    assert a.shape == (16000,)
    resampled = [r for r in caplog.records if "resampling audio from 44100 Hz" in r.message]
    assert len(resampled) == 1 and resampled[0].levelno == logging.WARNING
    downmixed = [r for r in caplog.records if "downmixing 2-channel" in r.message]
    assert len(downmixed) == 1 and downmixed[0].levelno == logging.WARNING
    assert torch.allclose(mono, torch.from_numpy(stereo.mean(1)).float(), atol=1e-4)


def test_bad_audio_files_are_refused_naming_the_file(tmp_path):
    sf.write(tmp_path / "ok.wav", tone(), 16000, subtype="PCM_16")
    data = (tmp_path / "ok.wav").read_bytes()
    (tmp_path / "truncated.wav").write_bytes(data[: len(data) // 2])
    (tmp_path / "corrupt.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunk")
    sf.write(tmp_path / "empty.wav", np.zeros(0, np.float32), 16000)
    sf.write(tmp_path / "silent.wav", np.zeros(16000, np.float32), 16000)
    sf.write(tmp_path / "clipped.wav", np.clip(tone(amplitude=2.0), -1, 1), 16000)
    nan = tone()
    nan[10] = np.nan
    sf.write(tmp_path / "nan.wav", nan, 16000, subtype="FLOAT")
    cases = {
        "truncated.wav": "truncated",
        "corrupt.wav": "cannot read audio",
        "empty.wav": "empty",
        "silent.wav": "silent",
        "clipped.wav": "clipped",
        "nan.wav": "non-finite",
    }
    for name, reason in cases.items():
        with pytest.raises(MediaError, match=rf"{name}.*{reason}"):
            load_audio(tmp_path / name)


# ---------------------------------------------------------------- manifests


def write_manifest(path, lines) -> None:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")


def test_manifest_paths_are_relative_to_the_manifest_and_bad_lines_name_file_and_line(tmp_path):
    (tmp_path / "media").mkdir()
    save_png(torch.zeros(3, 8, 8), tmp_path / "media" / "a.png")
    write_manifest(tmp_path / "m.jsonl", [{"image": "media/a.png", "text": "a red circle"}, ""])
    [sample] = read_manifest(tmp_path / "m.jsonl")
    assert sample["image"] == str((tmp_path / "media" / "a.png").resolve())
    assert sample["kind"] == "image" and sample["text"] == "a red circle" and sample["line"] == 1
    bad = {
        "{not json": "not valid JSON",
        json.dumps({"text": "no media"}): "exactly one of",
        json.dumps({"image": "media/a.png", "audio": "x.wav"}): "exactly one of",
        json.dumps({"image": "missing.png"}): "does not exist",
        json.dumps({"image": "media/a.png", "text": 3}): "'text' must be a string",
        json.dumps([1, 2]): "expected a JSON object",
    }
    for line, reason in bad.items():
        write_manifest(tmp_path / "bad.jsonl", [{"image": "media/a.png"}, line])
        with pytest.raises(MediaError, match=rf"bad.jsonl:2: .*{reason}"):
            read_manifest(tmp_path / "bad.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(MediaError, match="empty.jsonl.*empty"):
        read_manifest(tmp_path / "empty.jsonl")


def test_manifest_datamodule_batches_images_videos_and_audio(tmp_path):
    world = ShapesWorld(seed=0, include_motion=True)
    scenes = world.scenes("train", 3)
    lines = {"image": [], "video": [], "audio": []}
    for i, scene in enumerate(scenes):
        save_png(render_image(scene, 32), tmp_path / f"{i}.png")
        save_gif(render_video(scene, 5, 32), tmp_path / f"{i}.gif")
        save_wav(render_speech(world.caption(scene), seed=i), tmp_path / f"{i}.wav")
        text = world.caption(scene)
        lines["image"].append({"image": f"{i}.png", "text": text})
        lines["video"].append({"video": f"{i}.gif", "text": text})
        lines["audio"].append({"audio": f"{i}.wav", "text": text})
    for kind, entries in lines.items():
        write_manifest(tmp_path / f"{kind}.jsonl", entries)
        dm = ManifestMediaDataModule(str(tmp_path / f"{kind}.jsonl"), kind=kind, batch_size=3)
        dm.setup("fit")
        batch = next(iter(dm.val_dataloader()))
        assert batch["index"].tolist() == [0, 1, 2]
        assert batch["text"] == [world.caption(s) for s in scenes]
        if kind == "image":
            assert batch["pixels"].shape == (3, 3, 32, 32)
            assert all(verify_image(p, s).exact for p, s in zip(batch["pixels"], scenes, strict=True))
        elif kind == "video":
            assert batch["pixels"].shape == (3, 3, 5, 32, 32)
            assert all(verify_video(p, s).exact for p, s in zip(batch["pixels"], scenes, strict=True))
        else:
            assert batch["audio"].shape[0] == 3 and batch["audio_lengths"].max() == batch["audio"].shape[1]
    dm = ManifestMediaDataModule(str(tmp_path / "audio.jsonl"), kind="image")
    with pytest.raises(MediaError, match=r"audio.jsonl:1: expected a 'image' sample"):
        dm.setup("fit")
