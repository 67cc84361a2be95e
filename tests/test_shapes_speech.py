"""ShapesWorld speech: every caption word a distinct sound, read back by the speech verifier."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zoo.datamodules.media_data import ShapesMediaDataModule
from zoo.world.scenes import ShapesWorld, caption_vocabulary, verify_caption
from zoo.world.speech import (
    SAMPLE_RATE,
    read_speech,
    render_speech,
    split_words,
    verify_speech,
    word_accuracy,
    word_patterns,
)

CAPTION = "a small red circle at the top left and a large blue square in the center moving up"


def test_speech_is_float32_mono_deterministic_per_seed_and_about_an_eighth_of_a_second_per_word():
    wave = render_speech(CAPTION, seed=5)
    assert wave.dtype == np.float32 and wave.ndim == 1
    assert np.array_equal(wave, render_speech(CAPTION, seed=5))
    assert not np.array_equal(wave[: len(wave) // 2], render_speech(CAPTION, seed=6)[: len(wave) // 2])
    assert np.abs(wave).max() <= 0.6
    seconds_per_word = len(wave) / SAMPLE_RATE / len(CAPTION.split())
    assert 0.12 <= seconds_per_word <= 0.2
    assert len(split_words(wave)) == len(CAPTION.split())


def test_every_vocabulary_word_has_its_own_pattern():
    patterns = word_patterns()
    assert set(patterns) == set(caption_vocabulary())
    assert len(set(patterns.values())) == len(patterns)


def test_variation_changes_timing_and_pitch_but_not_the_words_heard():
    lengths = {len(render_speech("a red circle", seed=s)) for s in range(5)}
    assert len(lengths) == 5
    for word in caption_vocabulary():
        assert read_speech(render_speech(word, seed=stable(word))) == word


def stable(word: str) -> int:
    return sum(map(ord, word))


def test_word_accuracy_on_100_held_out_seeds_is_at_least_98_percent():
    world = ShapesWorld(seed=0, max_objects=3, include_motion=True)
    accuracies, exact = [], []
    for i in range(100):
        scene = world.scene(i, "test")
        text = world.caption(scene)
        heard = read_speech(render_speech(text, seed=10_000 + i))
        accuracies.append(word_accuracy(text, heard))
        exact.append(verify_caption(heard, scene, include_motion=True).exact)
    assert np.mean(accuracies) >= 0.98, np.mean(accuracies)
    assert np.mean(exact) >= 0.9, np.mean(exact)


def test_reading_survives_noise_and_another_sample_rate():
    world = ShapesWorld(seed=2)
    scene = world.scene(3, "val")
    wave = render_speech(world.caption(scene), seed=1)
    noisy = wave + 0.03 * np.random.default_rng(0).standard_normal(len(wave)).astype(np.float32)
    assert verify_speech(torch.from_numpy(noisy), scene).exact
    wave_22k = render_speech(world.caption(scene), seed=1, sample_rate=22050)
    assert verify_speech(wave_22k, scene, sample_rate=22050).exact


def test_silence_reads_as_nothing_and_bad_input_is_refused_by_name():
    assert read_speech(np.zeros(16000, dtype=np.float32)) == ""
    assert not verify_speech(np.zeros(16000, dtype=np.float32), ShapesWorld().scene(0)).parsed
    with pytest.raises(ValueError, match="not in the ShapesWorld vocabulary"):
        render_speech("a red hexagon", seed=0)
    with pytest.raises(ValueError, match="empty"):
        render_speech("  ", seed=0)
    with pytest.raises(ValueError, match="mono"):
        read_speech(np.zeros((2, 100), dtype=np.float32))
    with pytest.raises(ValueError, match="non-finite"):
        read_speech(np.full(100, np.nan, dtype=np.float32))


def test_word_accuracy_counts_edits():
    assert word_accuracy("a b c d", "a b c d") == 1.0
    assert word_accuracy("a b c d", "a x c d") == 0.75
    assert word_accuracy("a b c d", "a c d") == 0.75
    assert word_accuracy("a b", "") == 0.0


def test_speech_datamodule_pads_clips_and_records_their_lengths():
    dm = ShapesMediaDataModule(kind="speech", train_size=6, val_size=3, batch_size=3, seed=1)
    batch = next(iter(dm.val_dataloader()))
    assert set(batch) == {"audio", "audio_lengths", "index"}
    assert batch["audio"].dtype == torch.float32 and batch["audio"].shape[0] == 3
    assert batch["audio"].shape[1] == int(batch["audio_lengths"].max())
    for wave, length, index in zip(batch["audio"], batch["audio_lengths"], batch["index"], strict=True):
        assert torch.all(wave[length:] == 0)
        scene = dm.scene(int(index), "val")
        assert read_speech(wave[:length]) == dm.caption(int(index), "val")
        assert verify_speech(wave, scene).exact
