"""The Whisper teacher as a specification, offline: a tiny randomly initialised Whisper saved the way real
ones are, loaded from its folder by path. Clips of any length are heard in 30 s windows; Whisper's 50 Hz
frames are averaged over each codec frame's span; a clip's features depend on its own samples alone; middle
layers are normalised per frame; and a codec trained through the task moves its level 1 toward them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("transformers")

from whisper_helpers import save_tiny_whisper  # noqa: E402

from zoo.config import to_config  # noqa: E402
from zoo.hub import build_from_config  # noqa: E402
from zoo.tasks.audio_tokenizer import AudioTokenizerTask  # noqa: E402
from zoo.tokenizers.audio import AudioCodec  # noqa: E402
from zoo.tokenizers.audio_teacher import WhisperTeacher, span_average  # noqa: E402
from zoo.world.speech import render_speech  # noqa: E402

SR = 16000
WINDOW = 30 * SR


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_whisper(tmp_path_factory.mktemp("whisper") / "tiny-whisper")


@pytest.fixture(scope="module")
def teacher(folder: Path) -> WhisperTeacher:
    return WhisperTeacher(str(folder))


def voiced(samples: int, seed: int) -> torch.Tensor:
    """A chirp with a wandering pitch and loudness: different content in every second (and window)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(samples) / SR
    pitch = 120 + 200 * torch.rand(1, generator=g) + 60 * torch.sin(2 * math.pi * 0.3 * t)
    phase = 2 * math.pi * torch.cumsum(pitch, 0) / SR
    envelope = 0.2 + 0.15 * torch.sin(2 * math.pi * (0.7 + torch.rand(1, generator=g)) * t)
    return (envelope * torch.sin(phase) + 0.01 * torch.randn(samples, generator=g)).float()


def whisper_frames(teacher: WhisperTeacher, piece: torch.Tensor) -> torch.Tensor:
    """Whisper's own 1500 frames of one <= 30 s piece, straight from its extractor and encoder."""
    mel = teacher.extractor([piece.numpy()], sampling_rate=SR, return_tensors="pt").input_features
    with torch.no_grad():
        return teacher.encoder(mel).last_hidden_state[0]


def pair_means(frames: torch.Tensor) -> torch.Tensor:
    return frames.reshape(-1, 2, frames.shape[-1]).mean(1)


def test_a_2_s_clip_gives_one_vector_per_codec_frame_the_mean_of_two_whisper_frames(teacher):
    clip = voiced(2 * SR, seed=0)
    features = teacher(clip[None], hop=640)
    assert features.shape == (1, 50, 32) and not features.requires_grad
    expected = pair_means(whisper_frames(teacher, clip)[:100])
    assert torch.allclose(features[0], expected, atol=1e-5)
    # at 50 codec frames a second (hop 320) each frame is one Whisper frame
    assert torch.allclose(teacher(clip[None], hop=320)[0], whisper_frames(teacher, clip)[:100], atol=1e-5)


def test_a_65_s_clip_is_heard_in_30_s_windows_each_aligned_with_its_own_codec_frames(teacher):
    clip = voiced(65 * SR, seed=1)
    features = teacher(clip[None], hop=640)[0]
    assert features.shape == (math.ceil(65 * SR / 640), 32)  # 1625 frames: nothing truncated at 30 s
    for window, (first, last) in enumerate([(0, 750), (750, 1500), (1500, 1625)]):
        piece = clip[window * WINDOW : (window + 1) * WINDOW]
        expected = pair_means(whisper_frames(teacher, piece))[: last - first]
        assert torch.allclose(features[first:last], expected, atol=1e-5), f"window {window}"
    # the third window holds 5 s of sound: its frames are not the first window's stretched or repeated
    assert not torch.allclose(features[1500:1625], features[:125], atol=1e-2)


def test_batched_clips_of_different_lengths_get_exactly_their_features_alone(teacher):
    lengths = [2 * SR, 65 * SR, 31 * SR + 123]
    clips = [voiced(n, seed=10 + i) for i, n in enumerate(lengths)]
    # the padding is loud noise, not zeros: none of it may reach any clip's features
    batch = 0.5 * torch.randn(3, max(lengths), generator=torch.Generator().manual_seed(0))
    for row, clip in enumerate(clips):
        batch[row, : clip.numel()] = clip
    features = teacher(batch, torch.tensor(lengths), hop=640)
    assert features.shape == (3, math.ceil(max(lengths) / 640), 32)
    for row, clip in enumerate(clips):
        alone = teacher(clip[None], hop=640)[0]
        valid = alone.shape[0]
        assert torch.allclose(features[row, :valid], alone, atol=1e-5), f"row {row}"
        assert (features[row, valid:] == 0).all(), f"row {row}: frames past the clip are not zero"


def test_span_average_weights_each_whisper_frame_by_the_samples_it_shares_with_the_codec_frame():
    whisper = torch.arange(10.0)[:, None] * torch.tensor([[1.0, -2.0]])  # Whisper frame t is (t, -2t)
    # hop 640: exact pairs
    assert torch.equal(span_average(whisper, 320, 3200, 640, 5), pair_means(whisper))
    # hop 480 = 1.5 Whisper frames: frame 1 spans samples 480..960, half of Whisper frame 1 and all of 2
    pooled = span_average(whisper, 320, 3200, 480, 7)
    assert torch.allclose(pooled[1], (0.5 * whisper[1] + whisper[2]) / 1.5)
    # a clip ending at sample 1000: codec frame 1 (640..1280) averages samples 640..1000 only (Whisper
    # frames 2 and 3 by 320 and 40 samples), and frame 2 holds no sample at all
    cut = span_average(whisper, 320, 1000, 640, 3)
    assert torch.allclose(cut[1], (320 * whisper[2] + 40 * whisper[3]) / 360)
    assert (cut[2] == 0).all()


def test_middle_layers_are_cut_there_and_layer_normalised_per_frame(folder, teacher):
    clip = voiced(3 * SR, seed=2)
    mel = teacher.extractor([clip.numpy()], sampling_rate=SR, return_tensors="pt").input_features
    from transformers import WhisperModel

    full = WhisperModel.from_pretrained(folder, local_files_only=True).get_encoder().eval()
    with torch.no_grad():
        states = full(mel, output_hidden_states=True).hidden_states  # embeddings, block 1, final (normed)
    assert torch.allclose(teacher(clip[None], hop=320)[0], states[-1][0, :150], atol=1e-5)
    for layer in (0, 1, -2):
        middle = WhisperTeacher(str(folder), layer=layer)
        assert len(middle.encoder.layers) == layer % 3  # blocks past the chosen layer are never run
        features = middle(clip[None], hop=320)[0]
        raw = states[layer][0, :150]
        std = (raw.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
        expected = (raw - raw.mean(-1, keepdim=True)) / std
        assert torch.allclose(features, expected, atol=1e-4), f"layer {layer}"
    with pytest.raises(ValueError, match=r"2 encoder blocks.*\[-3, 2\].*got 3"):
        WhisperTeacher(str(folder), layer=3)


def test_a_missing_or_foreign_folder_is_refused_with_what_was_expected_and_nothing_downloaded(tmp_path):
    missing = r"no folder at openai/whisper-base.*huggingface-cli download"
    with pytest.raises(FileNotFoundError, match=missing):
        WhisperTeacher("openai/whisper-base")  # a hub id is not a folder: never fetched
    foreign = tmp_path / "bert"
    foreign.mkdir()
    with pytest.raises(ValueError, match=r"cannot read .*config\.json"):
        WhisperTeacher(str(foreign))
    (foreign / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match=r"model_type 'bert', expected 'whisper'"):
        WhisperTeacher(str(foreign))
    unweighted = tmp_path / "no-weights"
    save_tiny_whisper(unweighted)
    for weights in unweighted.glob("*.safetensors"):
        weights.rename(weights.with_suffix(".bin"))
    with pytest.raises(ValueError, match=r"no \.safetensors weights"):
        WhisperTeacher(str(unweighted))


def test_the_teacher_config_rebuilds_the_same_teacher_from_its_folder(folder):
    teacher = WhisperTeacher(str(folder), layer=1, window_batch_size=2)
    config = to_config(teacher)
    assert config == {
        "class_path": "zoo.tokenizers.audio_teacher.WhisperTeacher",
        "init_args": {"path": str(folder), "layer": 1, "sample_rate": 16000, "window_batch_size": 2},
    }
    clip = voiced(SR, seed=4)[None]
    assert torch.equal(build_from_config(config)(clip), teacher(clip))


def test_a_teacher_built_on_meta_materialises_the_weights_of_its_folder(folder):
    """Under FSDP the audio stage is built under zoo.meta_init; the teacher's loaded Whisper weights must come
    back, not the random init transformers gives the weights it believes were never loaded."""
    from zoo.meta_init import deferred_init, deferred_plan, materialize

    plain = WhisperTeacher(str(folder))
    with deferred_init():
        deferred = WhisperTeacher(str(folder))
    assert all(p.is_meta for p in deferred.parameters())
    materialize(deferred, deferred_plan(deferred))
    expected = plain.state_dict()
    different = [name for name, got in deferred.state_dict().items() if not torch.equal(got, expected[name])]
    assert different == []
    clip = voiced(SR, seed=5)[None]
    assert torch.equal(deferred(clip), plain(clip))


# --- distillation through the training task ---------------------------------------------------------


TEXTS = (
    "a small red circle at the top left",
    "a large blue square in the center",
    "a green triangle at the bottom right",
    "a small yellow square at the top",
)


def speech_batch(seed: int) -> dict[str, torch.Tensor]:
    clips = [render_speech(text, seed=seed * 10 + i) for i, text in enumerate(TEXTS)]
    lengths = torch.tensor([c.size for c in clips])
    wave = torch.zeros(len(clips), int(lengths.max()))
    for row, clip in enumerate(clips):
        wave[row, : clip.size] = torch.from_numpy(clip)
    return {"audio": wave, "audio_lengths": lengths}


def held_out_distill_loss(task: AudioTokenizerTask, batch: dict[str, torch.Tensor]) -> float:
    task.eval()
    with torch.no_grad():
        losses, *_ = task._losses(batch["audio"], batch["audio_lengths"])
    return float(losses["distill"])


def distil(teacher: WhisperTeacher, distill_weight: float, root: Path, steps: int) -> tuple[float, float]:
    """Held-out distillation loss before and after `steps` optimiser steps of the task on ShapesWorld
    speech (the real training path: Lightning, crops, quantiser dropout, the task's own loss)."""
    torch.manual_seed(0)
    codec = AudioCodec(channels=4, max_channels=32, latent_dim=16, codebook_sizes=(32, 16), codebook_dim=8)
    task = AudioTokenizerTask(
        codec,
        teacher,
        distill_loss="t_axis",
        distill_weight=distill_weight,
        wave_weight=0.0,
        mel_fft_sizes=(256, 512),
        lr=1e-2,
        warmup_steps=1,
        segment_seconds=1.0,
    )
    held_out = speech_batch(seed=99)
    train = [speech_batch(seed=0), speech_batch(seed=1)]
    task.codec.train()  # the first forward initialises the codebooks by k-means, as training would
    task.codec(train[0]["audio"], train[0]["audio_lengths"])
    before = held_out_distill_loss(task, held_out)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    task.train()  # Lightning keeps the modes it is given
    trainer.fit(task, DataLoader(train * steps, batch_size=None))
    return before, held_out_distill_loss(task, held_out)


def test_level_one_moves_toward_the_whisper_features_when_distilled_and_not_otherwise(teacher, tmp_path):
    steps = 12
    before, after = distil(teacher, 1.0, tmp_path / "distilled", steps)
    control_before, control_after = distil(teacher, 0.0, tmp_path / "control", steps)
    assert control_before == pytest.approx(before)  # same seed, same start
    # the t_axis loss is -log sigmoid(cos): 0.69 at cosine 0, 0.47 at cosine 0.5
    assert after < before - 0.1, (before, after)
    assert after < control_after - 0.1, (after, control_after)
