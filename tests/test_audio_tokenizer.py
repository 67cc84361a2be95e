"""The audio codec as a specification: shapes and frame rates, any prefix of the RVQ levels decodes, level 1
survives quantiser dropout and carries gradients for distillation, teachers give one frozen vector per
codec frame, and the task trains, logs media and writes a safetensors codec that loads back."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from zoo.tasks.audio_tokenizer import (
    CODEC_FILE,
    AudioTokenizerTask,
    MultiResolutionSTFTLoss,
    MultiScaleMelLoss,
    codebook_usage,
    d_axis_distill_loss,
    spectrogram_figure,
    t_axis_distill_loss,
)
from zoo.tasks.metrics import per_clip_si_snr as si_snr
from zoo.tokenizers.audio import AudioCodec
from zoo.tokenizers.audio_teacher import MelStatisticsTeacher, WhisperTeacher, WordIdentityTeacher
from zoo.world.speech import render_speech

SR = 16000


def tiny_codec(**overrides) -> AudioCodec:
    torch.manual_seed(0)
    args = dict(channels=4, max_channels=32, latent_dim=16, codebook_sizes=(32, 16, 8), codebook_dim=8)
    return AudioCodec(**{**args, **overrides})


def tones(batch: int = 4, samples: int = 8000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Chirps of random pitch and length, zero-padded past their lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(samples // 2, samples + 1, (batch,), generator=g)
    lengths[0] = samples
    t = torch.arange(samples) / SR
    f0 = 150 + 300 * torch.rand(batch, 1, generator=g)
    phase = 2 * math.pi * (f0 * t + 200 * t**2)
    wave = 0.4 * torch.sin(phase) * (torch.arange(samples)[None] < lengths[:, None])
    return wave.float(), lengths


def trained(codec: AudioCodec, steps: int = 2) -> AudioCodec:
    """Every codebook initialised by k-means (training forwards on chirps, no level dropped)."""
    codec.train()
    dropout, codec.quantizer.quantize_dropout = codec.quantizer.quantize_dropout, False
    for i in range(steps):
        codec(*tones(seed=i))
    codec.quantizer.quantize_dropout = dropout
    return codec.eval()


# --- the codec ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("strides,rate", [((4, 4, 5, 8), 25.0), ((2, 4, 5, 8), 50.0)])
def test_frame_rate_is_the_sample_rate_over_the_product_of_the_strides(strides, rate):
    codec = tiny_codec(strides=strides)
    assert codec.hop == math.prod(strides) and codec.frame_rate == rate
    wave = torch.randn(2, 5000) * 0.1
    codes = codec.encode(wave)
    assert codes.shape == (2, math.ceil(5000 / codec.hop), 3) and codes.dtype == torch.long
    assert codec.decode(codes).shape == (2, codes.shape[1] * codec.hop)


def test_every_prefix_of_the_levels_decodes_and_codes_respect_per_level_codebook_sizes():
    codec = trained(tiny_codec())
    codes = codec.encode(tones()[0])
    for level, size in enumerate(codec.codebook_sizes):
        assert 0 <= int(codes[..., level].min()) and int(codes[..., level].max()) < size
    outputs = [codec.decode(codes[..., :q]) for q in range(1, 4)]
    assert all(o.shape == outputs[0].shape for o in outputs)
    assert not torch.allclose(outputs[0], outputs[-1])  # later levels add detail
    assert codec.bits_per_second() == pytest.approx(25.0 * (5 + 4 + 3))
    assert codec.bits_per_second(1) == pytest.approx(25.0 * 5)


def test_encode_is_deterministic_and_never_updates_the_codebooks_even_in_training_mode():
    codec = trained(tiny_codec())
    before = {k: v.clone() for k, v in codec.state_dict().items()}
    codec.train()  # encode must not apply quantiser dropout or EMA updates in any mode
    wave = tones(seed=5)[0]
    first, second = codec.encode(wave), codec.encode(wave)
    assert torch.equal(first, second) and (first >= 0).all()
    for key, value in codec.state_dict().items():
        assert torch.equal(value, before[key]), f"encode changed {key}"
    assert codec.quantizer.training  # the mode is restored


def test_quantiser_dropout_always_keeps_the_semantic_level_and_sometimes_drops_the_rest():
    codec = tiny_codec()
    codec.train()
    dropped_any = False
    for i in range(12):
        out = codec(*tones(seed=i))
        codes = out.codes[out.mask]  # padded frames are -1 at every level
        assert (codes[:, 0] >= 0).all(), "level 1 was dropped"
        dropped_any |= bool((codes[:, 1:] == -1).any())
    assert dropped_any


def test_the_semantic_level_passes_gradients_to_the_encoder_for_distillation():
    codec = trained(tiny_codec())
    codec.train()
    out = codec(*tones(seed=3))
    assert out.semantic.shape == (4, out.codes.shape[1], codec.codebook_dim)
    out.semantic.pow(2).sum().backward()
    grad = codec.encoder.net[0].weight.grad
    assert grad is not None and grad.abs().sum() > 0
    # its values are level 1's code vectors (straight-through only changes the gradient)
    vectors = codec.level_vectors(out.codes[..., :1])[:, :, 0]
    assert torch.allclose(out.semantic[out.mask], vectors[out.mask], atol=1e-5)


def test_level_one_alone_is_among_the_prefixes_quantiser_dropout_trains():
    codec = tiny_codec()
    codec.train()
    kept = set()
    for i in range(24):
        out = codec(*tones(seed=i))
        codes = out.codes[out.mask]
        kept.add(int((codes >= 0).all(0).sum()))
    assert kept == {1, 2, 3}, kept


def test_quantiser_dropout_prob_sets_the_share_of_steps_that_drop_levels():
    never = tiny_codec(quantize_dropout_prob=0.0)
    never.train()
    for i in range(6):
        out = never(*tones(seed=i))
        assert (out.codes[out.mask] >= 0).all()
    assert never.quantizer.quantize_dropout  # the flag is restored after each forward
    with pytest.raises(ValueError, match="quantize_dropout_prob"):
        tiny_codec(quantize_dropout_prob=1.5)


@pytest.mark.parametrize("strides", [(4, 4, 5, 8), (2, 4, 5, 8)])
def test_stft_encoder_and_istft_decoder_keep_the_frame_layout_and_start_quiet(strides):
    codec = tiny_codec(strides=strides, encoder="stft", decoder="istft", istft_hop=64, decoder_channels=16)
    wave = tones()[0]
    latents = codec._latents(wave)
    assert latents.shape == (4, math.ceil(wave.shape[1] / codec.hop), 16)
    assert latents.std(dim=(0, 1)).mean() > 0.3 * latents.abs().mean()  # frames differ: no collapse
    codec = trained(codec)
    codes = codec.encode(wave)
    decoded = codec.decode(codes)
    assert decoded.shape == (4, codes.shape[1] * codec.hop) and torch.isfinite(decoded).all()
    assert decoded.pow(2).mean().sqrt() < 0.01  # starts near silence (speech is ~0.1), not at full scale


def test_istft_decoder_passes_gradients_from_its_waveform_to_the_encoder():
    codec = tiny_codec(encoder="stft", decoder="istft", istft_hop=64, decoder_channels=16)
    codec.train()
    out = codec(*tones())
    out.reconstruction.pow(2).sum().backward()
    for part in (codec.encoder.net[0], codec.decoder.head):
        assert part.weight.grad is not None and part.weight.grad.abs().sum() > 0


def test_new_codec_parts_refuse_bad_settings_by_name():
    with pytest.raises(ValueError, match="decoder must be 'conv' or 'istft'"):
        tiny_codec(decoder="wavenet")
    with pytest.raises(ValueError, match="encoder must be 'conv' or 'stft'"):
        tiny_codec(encoder="mel")
    with pytest.raises(ValueError, match="istft_hop must divide the hop 640"):
        tiny_codec(decoder="istft", istft_hop=100)


def test_initial_latents_vary_from_frame_to_frame_so_the_codebooks_cannot_collapse_at_once():
    # With PyTorch's default init every frame's latent was nearly the same vector (std over frames 0.003,
    # magnitude 0.03), and one optimiser step put every frame on a single code.
    codec = tiny_codec()
    latents = codec._latents(tones()[0])
    assert latents.std(dim=(0, 1)).mean() > 0.3 * latents.abs().mean()


def test_frames_past_the_lengths_are_masked():
    codec = tiny_codec()
    wave, lengths = tones()
    out = codec(wave, lengths)
    expected = torch.arange(out.codes.shape[1])[None] * codec.hop < lengths[:, None]
    assert torch.equal(out.mask, expected)
    assert out.reconstruction.shape == (4, out.codes.shape[1] * codec.hop)
    assert out.commit_loss.shape == (3,)


def test_bad_inputs_are_refused_with_what_was_expected(tmp_path: Path):
    codec = tiny_codec()
    with pytest.raises(ValueError, match=r"\[B, N\]"):
        codec.encode(torch.zeros(100))
    with pytest.raises(ValueError, match="1..3"):
        codec.decode(torch.zeros(1, 4, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="out of range"):
        codec.decode(torch.full((1, 4, 2), 20, dtype=torch.long))  # level 2 has 16 codes
    with pytest.raises(ValueError, match="integer codes"):
        codec.decode(torch.zeros(1, 4, 2))
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        tiny_codec(weights=str(missing))
    with pytest.raises(ValueError, match="codebook_sizes"):
        AudioCodec(codebook_sizes=(256, 1))


# --- distillation losses and metrics ---------------------------------------------------------------


def test_d_axis_loss_compares_each_dimension_along_time_and_ignores_padded_frames():
    g = torch.Generator().manual_seed(0)
    target = torch.randn(2, 10, 6, generator=g)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 7:] = False
    best = -torch.nn.functional.logsigmoid(torch.tensor(1.0))
    # a positive scale per dimension keeps every cosine along time at 1 ...
    scaled = target * torch.linspace(0.5, 3.0, 6)
    assert d_axis_distill_loss(scaled, target, mask) == pytest.approx(float(best), abs=1e-5)
    # ... which a per-frame cosine does not reward
    assert t_axis_distill_loss(scaled, target, mask) > best + 1e-3
    noisy = scaled.clone()
    noisy[1, 7:] = 100.0  # padding
    assert d_axis_distill_loss(noisy, target, mask) == pytest.approx(float(best), abs=1e-5)
    assert d_axis_distill_loss(torch.randn(2, 10, 6, generator=g), target, mask) > best + 0.1


def test_stft_loss_is_zero_for_a_perfect_copy_and_grows_as_the_tone_goes_missing():
    loss = MultiResolutionSTFTLoss((512, 128), top_db=60.0)
    wave = tones()[0]
    assert float(loss(wave, wave)) < 1e-4
    ramp = torch.linspace(0, 1, wave.shape[1])
    costs = [float(loss(wave * ramp**k, wave)) for k in (0.5, 1, 2, 4)]  # fading in later and later
    assert costs == sorted(costs) and costs[0] > 0.05, costs
    with pytest.raises(ValueError, match="fft_sizes"):
        MultiResolutionSTFTLoss((4,))


def test_a_top_db_floor_makes_spectral_losses_ignore_the_noise_floor_but_not_the_signal():
    g = torch.Generator().manual_seed(0)
    wave = tones()[0]
    target = wave + 1e-4 * torch.randn(wave.shape, generator=g)
    other_noise = wave + 1e-4 * torch.randn(wave.shape, generator=g)  # same tone, another noise draw
    silent = 1e-4 * torch.randn(wave.shape, generator=g)
    absolute = MultiScaleMelLoss(SR, (256, 512))
    clipped = MultiScaleMelLoss(SR, (256, 512), top_db=40.0)
    # with an absolute floor far below the noise, two draws of the same noise look far apart ...
    assert float(absolute(other_noise, target)) > 5 * float(clipped(other_noise, target))
    # ... with the floor 40 dB below the peak they do not, while a missing tone still costs a lot
    assert float(clipped(silent, target)) > 10 * float(clipped(other_noise, target))
    stft = MultiResolutionSTFTLoss((512,), top_db=40.0)
    assert float(stft(silent, target)) > 10 * float(stft(other_noise, target))
    with pytest.raises(ValueError, match="top_db"):
        MultiScaleMelLoss(SR, (256,), top_db=0.0)
    with pytest.raises(ValueError, match="n_mels"):
        MultiScaleMelLoss(SR, (256, 512), n_mels=(16,))


def test_si_snr_is_scale_invariant_and_falls_with_noise():
    wave = tones()[0]
    assert torch.all(si_snr(wave, wave) > 60)
    assert torch.allclose(
        si_snr(0.5 * wave + 0.01 * torch.randn_like(wave), wave),
        si_snr(wave + 0.02 * torch.randn_like(wave), wave),
        atol=1.5,
    )
    assert (
        si_snr(wave + 0.3 * torch.randn_like(wave), wave) < si_snr(wave + 0.03 * torch.randn_like(wave), wave)
    ).all()


def test_the_spectrogram_figure_draws_a_near_silent_decode(tmp_path: Path):
    # an untrained iSTFT decoder is ~60 dB below speech: the figure at the sanity check must not fail
    wave = tones(batch=1)[0][0]
    figure = spectrogram_figure(wave, {"1 level": 1e-6 * torch.randn_like(wave)}, SR)
    figure.savefig(tmp_path / "spectrogram.png")
    assert (tmp_path / "spectrogram.png").stat().st_size > 0


def test_codebook_usage_counts_valid_frames_only():
    codes = torch.tensor([[[0, 1], [1, 1], [2, 3]]])
    mask = torch.tensor([[True, True, False]])
    (used1, ppl1), (used2, ppl2) = codebook_usage(codes, mask, (4, 4))
    assert used1 == 0.5 and ppl1 == pytest.approx(2.0)
    assert used2 == 0.25 and ppl2 == pytest.approx(1.0)


# --- teachers ----------------------------------------------------------------------------------------


def test_mel_statistics_teacher_gives_one_frozen_vector_per_codec_frame_whatever_the_loudness():
    teacher = MelStatisticsTeacher(dim=12)
    wave, lengths = tones(samples=7000)
    features = teacher(wave, lengths, hop=640)
    assert features.shape == (4, math.ceil(7000 / 640), 12) and not features.requires_grad
    assert torch.allclose(teacher(3 * wave, lengths, hop=640), features, atol=1e-3)
    assert teacher(wave, lengths, hop=320).shape == (4, math.ceil(7000 / 320), 12)
    teacher.train()
    assert not teacher.training


def test_word_identity_teacher_hears_the_caption_words_in_order():
    text = "a small red circle at the top left"
    wave = torch.from_numpy(render_speech(text, seed=3))[None]
    teacher = WordIdentityTeacher(dim=8)
    ids = teacher.word_ids(wave, torch.tensor([wave.shape[1]]), hop=320)[0].tolist()
    runs = [i for j, i in enumerate(ids) if i != 0 and (j == 0 or ids[j - 1] != i)]
    assert [teacher.words[i] for i in runs] == text.split()
    features = teacher(wave, hop=320)
    assert features.shape == (1, math.ceil(wave.shape[1] / 320), 8)
    assert torch.equal(features[0, ids.index(0)], teacher.embeddings[0])  # silence has its own vector


def test_whisper_teacher_without_transformers_says_which_extra_to_install():
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install multimodal-zoo\[whisper\]"):
            WhisperTeacher("openai/whisper-base")
    else:
        pytest.skip("transformers is installed")


# --- the training task -------------------------------------------------------------------------------


def tone_batches(n: int, batch: int, seed: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(n):
        wave, lengths = tones(batch, 6400, seed * 1000 + i)
        out.append({"audio": wave, "audio_lengths": lengths, "index": torch.arange(batch)})
    return out


class Losses(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(float(trainer.callback_metrics["train/mel_loss"]))


def test_task_trains_logs_media_and_writes_a_codec_that_loads_back(tmp_path: Path):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    codec = tiny_codec()
    task = AudioTokenizerTask(
        codec, MelStatisticsTeacher(dim=8), lr=3e-3, warmup_steps=1, mel_fft_sizes=(256, 512)
    )
    losses = Losses()
    train = tone_batches(1, 4, 0) * 16  # one batch, repeated: the codec must fit it
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        default_root_dir=tmp_path,
        logger=TensorBoardLogger(tmp_path, name="logs"),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[losses],
    )
    trainer.fit(task, DataLoader(train, batch_size=None), DataLoader(tone_batches(1, 2, 1), batch_size=None))
    assert min(losses.values[-5:]) < losses.values[0] - 0.3, losses.values
    logged = set(trainer.logged_metrics)
    for key in (
        "train/distill_loss",
        "train/commit_loss",
        "val/si_snr",
        "val/usage_level1",
        "val/perplexity_level3",
    ):
        assert key in logged, sorted(logged)

    events = EventAccumulator(
        str(Path(trainer.logger.log_dir)), size_guidance={"audio": 0, "images": 0}
    ).Reload()
    assert "audio/0/original" in events.Tags()["audio"] and "spectrogram" in events.Tags()["images"]

    path = tmp_path / CODEC_FILE
    assert path.is_file()
    loaded = tiny_codec(weights=str(path)).eval()
    wave = tones(seed=9)[0]
    assert torch.equal(loaded.encode(wave), codec.eval().encode(wave))

    trainer.save_checkpoint(tmp_path / "task.ckpt")
    checkpoint = torch.load(tmp_path / "task.ckpt", weights_only=True)
    assert checkpoint["hyper_parameters"]["codec"]["class_path"] == "zoo.tokenizers.audio.AudioCodec"
    restored = AudioTokenizerTask.load_from_checkpoint(tmp_path / "task.ckpt")
    assert torch.equal(restored.codec.eval().encode(wave), loaded.encode(wave))
