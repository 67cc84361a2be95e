"""Training the audio codec (ERNIE 5.0 audio tokenizer; losses after SpeechTokenizer and DAC).

The codec (`zoo.tokenizers.audio.AudioCodec`) learns from these terms, weighted in YAML:
- multi-scale mel-spectrogram L1 (log-mel at several FFT sizes, DAC / SpeechTokenizer),
- optionally a multi-resolution STFT loss (spectral convergence + log magnitude, Parallel WaveGAN),
- waveform L1 (0 in the recipe: before the phase is learnt it pulls the output toward silence),
- the RVQ commitment loss (summed over levels),
- distillation of level 1 toward a frozen teacher (`zoo.tokenizers.audio_teacher`) through a linear
  projection: SpeechTokenizer's "D-axis" loss, -log sigmoid of the cosine along *time* for each feature
  dimension (its code, not its paper's formula: ZhangXInFD/SpeechTokenizer#2), or the plain per-frame
  cosine ("t_axis").
No adversarial losses: the tiny codec trains in minutes on a CPU, and the spectral losses keep it stable.

Validation and test (`val/...`, `test/...`) log mel distance, SI-SNR (torchmetrics) and codebook usage per
level; validation with a TensorBoard logger also writes audio samples and a spectrogram figure (original vs
decodes from 1..Q levels). At the end of `fit` the codec is written to
`<default_root_dir>/audio_codec.safetensors`.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import ClassVar, Literal

import lightning as L
import torch
import torch.nn.functional as F
import torchaudio
from torch import Tensor, nn

from zoo.config import save_config_hyperparameters
from zoo.parallel import Parallelism
from zoo.tasks.component_folders import write_component_folder
from zoo.tasks.metrics import audio_si_snr, split_metrics
from zoo.tasks.optim import (
    LRSchedulerCallable,
    OptimizerCallable,
    build_optimizer,
    lightning_optimizers,
    refuse_replaced_arguments,
)
from zoo.tasks.sharding import ShardedStage, ShardingPlan, plain_component, with_parameters
from zoo.tokenizers.audio import AudioCodec
from zoo.tokenizers.audio_teacher import AudioTeacher
from zoo.weights import save_weights_file

# The task stores its components' config, not the objects (see zoo/tasks/pretrain.py).
warnings.filterwarnings("ignore", message="Attribute '(codec|teacher)' is an instance of `nn.Module`")

CODEC_FILE = "audio_codec.safetensors"


class MultiScaleMelLoss(nn.Module):
    """Mean over FFT sizes of L1 between log-mel magnitude spectrograms (hop n_fft / 4).

    Args:
        sample_rate: waveform sample rate in Hz.
        fft_sizes: FFT size of each scale.
        n_mels: mel bands of each scale (None: max(16, n_fft / 8) each). DAC pairs small windows with few
            bands (5 bands at 32 samples ... 320 at 2048): the coarse scales ask for the spectral envelope
            and its timing, which a decoder can match long before it can match single harmonics.
        floor: added to the mel magnitudes before the log (how faint a band may be and still count).
        top_db: when set, the floor is instead this many dB below the loudest band of the target (per clip
            and scale), as `top_db` clips a log-spectrogram: bands fainter than that, the noise floor
            included, are all "silence". With an absolute floor far below the noise, the L1 between the logs
            of two noise spectra (independent draws, nothing a decoder can predict) dominates the loss: on
            ShapesWorld speech an oracle that keeps the exact spectral envelope and draws the rest at random
            scores 0.55-0.73 on the 1e-5 floor distance while the verifier reads every word from it.
    """

    def __init__(
        self,
        sample_rate: int,
        fft_sizes: tuple[int, ...],
        n_mels: tuple[int, ...] | None = None,
        floor: float = 1e-5,
        top_db: float | None = None,
    ) -> None:
        super().__init__()
        fft_sizes = tuple(fft_sizes)
        bands = tuple(max(16, n // 8) for n in fft_sizes) if n_mels is None else tuple(n_mels)
        if len(bands) != len(fft_sizes) or any(b < 1 for b in bands):
            raise ValueError(
                f"MultiScaleMelLoss: n_mels needs one band count >= 1 per FFT size {fft_sizes}, got {n_mels}"
            )
        if top_db is not None and top_db <= 0:
            raise ValueError(f"MultiScaleMelLoss: top_db must be > 0 dB, got {top_db}")
        self.floor, self.top_db = floor, top_db
        # torchaudio checks its filter banks with .item(): build them on the CPU even under a meta device
        with torch.device("cpu"):
            self.mels = nn.ModuleList(
                torchaudio.transforms.MelSpectrogram(
                    sample_rate=sample_rate, n_fft=n, hop_length=n // 4, n_mels=b, power=1.0
                )
                for n, b in zip(fft_sizes, bands, strict=True)
            )

    def forward(self, prediction: Tensor, target: Tensor) -> Tensor:
        losses = []
        for mel in self.mels:
            pred, ref = mel(prediction), mel(target)
            eps = log_floor(ref, self.floor, self.top_db)
            losses.append(((pred + eps).log() - (ref + eps).log()).abs().mean())
        return torch.stack(losses).mean()


def log_floor(reference: Tensor, floor: float, top_db: float | None) -> Tensor | float:
    """What a spectral loss adds before its log: `floor`, or `top_db` dB below the loudest bin of each row
    of `reference` `[B, bins, T]` (a magnitude), detached."""
    if top_db is None:
        return floor
    peak = reference.detach().amax(dim=(-2, -1), keepdim=True)
    return (peak * 10 ** (-top_db / 20)).clamp_min(floor)


class MultiResolutionSTFTLoss(nn.Module):
    """Mean over FFT sizes of spectral convergence plus log-magnitude L1 (Yamamoto et al. 2020, Parallel
    WaveGAN section 2.3; DAC's and EnCodec's multi-resolution spectral losses), hop n_fft / 4.

    Spectral convergence, ||S - S'||_F / ||S||_F, weighs the loud bins (harmonics, formants): the log terms
    weigh every bin alike, faint ones included, and on their own let a decoder trade the peaks that make a
    word for a matched noise floor.
    """

    def __init__(self, fft_sizes: tuple[int, ...], floor: float = 1e-5, top_db: float | None = None) -> None:
        super().__init__()
        if not fft_sizes or any(n < 8 for n in fft_sizes):
            raise ValueError(f"MultiResolutionSTFTLoss: fft_sizes must be >= 8 each, got {fft_sizes}")
        self.fft_sizes, self.floor, self.top_db = tuple(fft_sizes), floor, top_db
        for n in self.fft_sizes:
            self.register_buffer(f"window_{n}", torch.hann_window(n), persistent=False)

    def _magnitude(self, wave: Tensor, n: int) -> Tensor:
        window = getattr(self, f"window_{n}")
        spec = torch.stft(wave, n, n // 4, window=window.to(wave.dtype), return_complex=True)
        return spec.abs()

    def forward(self, prediction: Tensor, target: Tensor) -> Tensor:
        losses = []
        for n in self.fft_sizes:
            pred, ref = self._magnitude(prediction, n), self._magnitude(target, n)
            convergence = (pred - ref).norm() / ref.norm().clamp_min(self.floor)
            eps = log_floor(ref, self.floor, self.top_db)
            log_l1 = ((pred + eps).log() - (ref + eps).log()).abs().mean()
            losses.append(convergence + log_l1)
        return torch.stack(losses).mean()


def d_axis_distill_loss(features: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """SpeechTokenizer's D-axis loss: -log sigmoid(cos) along time, per feature dimension, averaged.

    features, target: `[B, F, D]`; mask `[B, F]`: padded frames are zeroed, which leaves the cosine over the
    valid frames unchanged.
    """
    m = mask.unsqueeze(-1).to(features.dtype)
    cos = F.cosine_similarity(features * m, target * m, dim=1, eps=1e-6)  # [B, D]
    return -F.logsigmoid(cos).mean()


def t_axis_distill_loss(features: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """-log sigmoid of the per-frame cosine between feature vectors, averaged over valid frames."""
    cos = F.cosine_similarity(features, target, dim=-1, eps=1e-6)  # [B, F]
    return -(F.logsigmoid(cos) * mask).sum() / mask.sum().clamp_min(1)


def codebook_usage(codes: Tensor, mask: Tensor, sizes: tuple[int, ...]) -> list[tuple[float, float]]:
    """Per level (fraction of the codebook used, perplexity of the code histogram) over valid frames."""
    result = []
    for level, size in enumerate(sizes[: codes.shape[-1]]):
        chosen = codes[..., level][mask]
        counts = torch.bincount(chosen[chosen >= 0], minlength=size).float()  # -1: dropped
        p = counts / counts.sum().clamp_min(1)
        perplexity = float(torch.exp(-(p * p.clamp_min(1e-12).log()).sum()))
        result.append((float((counts > 0).float().mean()), perplexity))
    return result


def spectrogram_figure(original: Tensor, decodes: dict[str, Tensor], sample_rate: int):  # noqa: ANN201
    """A matplotlib figure: the log-mel of `original` [N] above that of each decode [N] (titled by key)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mel = torchaudio.transforms.MelSpectrogram(sample_rate=sample_rate, n_fft=512, hop_length=128, n_mels=64)
    rows = {"original": original, **decodes}
    fig, axes = plt.subplots(len(rows), 1, figsize=(6, 1.3 * len(rows)), sharex=True, squeeze=False)
    for ax, (title, wave) in zip(axes[:, 0], rows.items(), strict=True):
        spec = (mel(wave.detach().float().cpu()) + 1e-5).log10()
        # vmax above vmin even for a near-silent decode (an untrained codec at the sanity check)
        vmax = max(float(spec.max()), -3.0)
        ax.imshow(spec.numpy(), origin="lower", aspect="auto", cmap="magma", vmin=-4, vmax=vmax)
        ax.set_ylabel(title, fontsize=7)
        ax.set_yticks([])
    axes[-1, 0].set_xlabel("frames (8 ms)")
    fig.tight_layout()
    return fig


class AudioTokenizerTask(ShardedStage, L.LightningModule):
    """Trains an `AudioCodec` on batches `{"audio": [B, N], "audio_lengths": [B]}` (zero-padded waveforms).

    Args:
        codec: the codec to train.
        teacher: frozen teacher of the semantic level (None: no distillation).
        distill_loss: "d_axis" (SpeechTokenizer: cosine along time per dimension) or "t_axis"
            (per-frame cosine).
        mel_weight: weight of the multi-scale log-mel L1.
        wave_weight: weight of the waveform L1.
        commit_weight: weight of the summed RVQ commitment losses.
        distill_weight: weight of the distillation loss.
        stft_weight: weight of the multi-resolution STFT loss (spectral convergence + log magnitude);
            0 leaves it out.
        mel_fft_sizes: FFT sizes of the multi-scale mel loss.
        mel_bands: mel bands at each of those FFT sizes (None: max(16, n_fft / 8)).
        spectral_top_db: dynamic range of the log terms of the mel and STFT losses: bins more than this
            many dB below a clip's loudest count as silence (None: an absolute floor of 1e-5, which makes
            the unpredictable noise floor dominate; see `MultiScaleMelLoss`).
        stft_fft_sizes: FFT sizes of the multi-resolution STFT loss.
        lr: AdamW learning rate (linear warm-up, then cosine decay to `min_lr_ratio` of it over the run).
        betas: AdamW betas (DAC uses (0.8, 0.99)).
        warmup_steps: linear warm-up steps.
        min_lr_ratio: learning rate at the end of the run, relative to `lr` (1.0: constant after warm-up).
        segment_seconds: train on a random window of this length from each clip (whole clips when None or
            longer; validation always sees whole clips). Rounded to whole frames.
        num_logged_samples: audio clips written to TensorBoard per validation.
        optimizer: builds the optimizer from one group (the codec and the distillation projection, no
            weight decay); None: AdamW with `lr` and `betas` (zoo/tasks/optim.py).
        lr_scheduler: builds the schedule from the optimizer, stepped every step; None: warm-up-cosine with
            `warmup_steps` and `min_lr_ratio`.
        parallel: FSDP2, FP8, activation checkpointing and compile, applied in `configure_model` along
            `sharding_plan` (zoo.tasks.sharding).
    """

    # Built on `meta` under parallel.fsdp (zoo.meta_init), the codec and any teacher with it: both replay bit
    # for bit, a Whisper teacher's loaded weights included (tests/test_sharding_plans.py).
    meta_init_with_fsdp: ClassVar[bool] = True

    def __init__(
        self,
        codec: AudioCodec,
        teacher: AudioTeacher | None = None,
        distill_loss: Literal["d_axis", "t_axis"] = "d_axis",
        mel_weight: float = 1.0,
        wave_weight: float = 1.0,
        commit_weight: float = 1.0,
        distill_weight: float = 1.0,
        stft_weight: float = 0.0,
        mel_fft_sizes: tuple[int, ...] = (256, 512, 1024),
        mel_bands: tuple[int, ...] | None = None,
        spectral_top_db: float | None = None,
        stft_fft_sizes: tuple[int, ...] = (2048, 512, 128),
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.8, 0.99),
        warmup_steps: int = 20,
        min_lr_ratio: float = 1.0,
        segment_seconds: float | None = None,
        num_logged_samples: int = 2,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        parallel: Parallelism = Parallelism(),
    ) -> None:
        super().__init__()
        save_config_hyperparameters(self)  # configs, never pickled modules (zoo.config)
        self.parallel = parallel
        refuse_replaced_arguments(AudioTokenizerTask, "optimizer", optimizer, {"lr": lr, "betas": betas})
        schedule = {"warmup_steps": warmup_steps, "min_lr_ratio": min_lr_ratio}
        refuse_replaced_arguments(AudioTokenizerTask, "lr_scheduler", lr_scheduler, schedule)
        self.optimizer_callable, self.lr_scheduler_callable = optimizer, lr_scheduler
        if distill_loss not in ("d_axis", "t_axis"):
            raise ValueError(f"distill_loss must be 'd_axis' or 't_axis', got {distill_loss!r}")
        self.codec = codec
        self.teacher = teacher
        self.distill_loss = distill_loss
        self.weights = {
            "mel": mel_weight,
            "wave": wave_weight,
            "commit": commit_weight,
            "distill": distill_weight,
            "stft": stft_weight,
        }
        self.lr, self.betas, self.warmup_steps = lr, tuple(betas), warmup_steps
        self.min_lr_ratio = min_lr_ratio
        self.num_logged_samples = num_logged_samples
        self.segment_frames = (
            None if segment_seconds is None else max(1, round(segment_seconds * codec.frame_rate))
        )
        self.mel_loss = MultiScaleMelLoss(
            codec.sample_rate,
            tuple(mel_fft_sizes),
            None if mel_bands is None else tuple(mel_bands),
            top_db=spectral_top_db,
        )
        self.stft_loss = (
            MultiResolutionSTFTLoss(tuple(stft_fft_sizes), top_db=spectral_top_db)
            if stft_weight > 0
            else None
        )
        # The projection of level 1 into the teacher's space (SpeechTokenizer's `transform`) trains with the
        # codec but belongs to the task: the codec's safetensors file holds the codec alone.
        self.distill_proj = None if teacher is None else nn.Linear(codec.codebook_dim, teacher.dim)
        if teacher is not None:
            teacher.requires_grad_(False)
            if getattr(teacher, "sample_rate", codec.sample_rate) != codec.sample_rate:
                raise ValueError(
                    f"teacher sample_rate {teacher.sample_rate} differs from the codec's {codec.sample_rate}"
                )
        self.eval_metrics = split_metrics(["si_snr"], audio_si_snr)
        self._val_usage: list[Tensor] = []
        self._val_masks: list[Tensor] = []
        self._val_example: tuple[Tensor, Tensor] | None = None

    def sharding_plan(self) -> ShardingPlan:
        """The codec's blocks are the layers of its encoder and decoder stacks (strided conv stages with their
        residual units); the encoder, the decoder (with any STFT head), the two quantiser projections and the
        distillation projection are groups. Those three linears stay high precision (the quantiser's input and
        output, and a regression head), so FP8 converts nothing in this stage. The teacher is frozen
        (replicated on every rank)."""
        codec = self.codec
        blocks = with_parameters([*codec.encoder.net, *codec.decoder.net])
        projections = (codec.quantizer.project_in, codec.quantizer.project_out)
        heads = projections + ((self.distill_proj,) if self.distill_proj is not None else ())
        groups = with_parameters((codec.encoder, codec.decoder, *heads))
        frozen = (self.teacher,) if self.teacher is not None else ()
        return ShardingPlan(blocks=blocks, groups=groups, high_precision=heads, frozen=frozen)

    def _unpack(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        if "audio" not in batch:
            raise KeyError(
                f"AudioTokenizerTask: batch needs 'audio' [B, N] (and 'audio_lengths'), got {sorted(batch)}"
            )
        wave = batch["audio"]
        lengths = batch.get("audio_lengths")
        if lengths is None:
            lengths = torch.full((wave.shape[0],), wave.shape[1], dtype=torch.long, device=wave.device)
        return wave, lengths

    def _crop(
        self, wave: Tensor, lengths: Tensor, target: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """A random `segment_frames`-frame window of each clip (within its valid frames), in training."""
        hop, frames = self.codec.hop, self.segment_frames
        if frames is None or wave.shape[1] <= frames * hop:
            return wave, lengths, target
        valid_frames = (lengths + hop - 1) // hop
        first = (
            torch.rand(wave.shape[0], device=wave.device) * (valid_frames - frames + 1).clamp_min(1)
        ).long()
        starts = first * hop
        samples = starts[:, None] + torch.arange(frames * hop, device=wave.device)[None]
        padded = F.pad(wave, (0, frames * hop))
        cropped = padded.gather(1, samples)
        new_lengths = (lengths - starts).clamp(0, frames * hop)
        if target is not None:
            rows = first[:, None] + torch.arange(frames, device=wave.device)[None]
            target = F.pad(target, (0, 0, 0, frames)).gather(
                1, rows[..., None].expand(-1, -1, target.shape[-1])
            )
        return cropped, new_lengths, target

    def _losses(
        self, wave: Tensor, lengths: Tensor, crop: bool = False
    ) -> tuple[dict[str, Tensor], Tensor, Tensor, Tensor, object]:
        # The teacher hears the whole clip (a word cut by the crop would be misheard), then is cropped alike.
        target = None if self.teacher is None else self.teacher(wave, lengths, self.codec.hop)
        if crop:
            wave, lengths, target = self._crop(wave, lengths, target)
        out = self.codec(wave, lengths)
        n = wave.shape[1]
        sample_mask = (torch.arange(n, device=wave.device)[None] < lengths[:, None]).to(wave.dtype)
        recon = out.reconstruction[:, :n] * sample_mask  # padding is not the codec's to reproduce
        losses = {
            "mel": self.mel_loss(recon, wave),
            "wave": (recon - wave).abs().sum() / sample_mask.sum().clamp_min(1),
            "commit": out.commit_loss.sum(),
        }
        if self.stft_loss is not None:
            losses["stft"] = self.stft_loss(recon, wave)
        if target is not None:
            features = self.distill_proj(out.semantic)
            loss_fn = d_axis_distill_loss if self.distill_loss == "d_axis" else t_axis_distill_loss
            losses["distill"] = loss_fn(features, target, out.mask)
        return losses, wave, lengths, recon, out

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        wave, lengths = self._unpack(batch)
        losses, wave, _, _, _ = self._losses(wave, lengths, crop=True)
        loss = sum(self.weights[k] * v for k, v in losses.items())
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"non-finite codec loss at step {self.global_step}: "
                + ", ".join(f"{k}={float(v):.4g}" for k, v in losses.items())
            )
        logs = {f"train/{k}_loss": v.detach() for k, v in losses.items()}
        logs["train/loss"] = loss.detach()
        self.log_dict(logs, on_step=True, on_epoch=False, batch_size=wave.shape[0])
        self.log("loss", loss.detach(), prog_bar=True, logger=False, batch_size=wave.shape[0])
        return loss

    def _evaluate(self, batch: dict[str, Tensor], batch_idx: int, split: str) -> Tensor:
        wave, lengths = self._unpack(batch)
        losses, _, _, recon, out = self._losses(wave, lengths)
        loss = sum(self.weights[k] * v for k, v in losses.items())
        b = wave.shape[0]
        logs = {f"{split}/{k}_loss": v for k, v in losses.items()}
        logs[f"{split}/loss"] = loss
        self.log_dict(logs, on_step=False, on_epoch=True, batch_size=b, sync_dist=True)
        metric = self.eval_metrics[f"{split}__si_snr"]
        metric.update(recon, wave)
        self.log(f"{split}/si_snr", metric, batch_size=b)
        self._val_usage.append(out.codes.detach().cpu())
        self._val_masks.append(out.mask.detach().cpu())
        if batch_idx == 0 and split == "val":
            k = self.num_logged_samples
            self._val_example = (wave[:k].detach(), lengths[:k].detach())
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self._evaluate(batch, batch_idx, "val")
        b = batch["audio"].shape[0]
        self.log("val_loss", loss, prog_bar=True, logger=False, batch_size=b, sync_dist=True)
        return loss

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._evaluate(batch, batch_idx, "test")

    def _log_usage(self, split: str) -> None:
        if self._val_usage:
            frames = max(c.shape[1] for c in self._val_usage)
            codes = torch.cat([F.pad(c, (0, 0, 0, frames - c.shape[1]), value=-1) for c in self._val_usage])
            mask = torch.cat([F.pad(m, (0, frames - m.shape[1])) for m in self._val_masks])
            for level, (used, perplexity) in enumerate(
                codebook_usage(codes, mask, self.codec.codebook_sizes)
            ):
                self.log(f"{split}/usage_level{level + 1}", used, sync_dist=True)
                self.log(f"{split}/perplexity_level{level + 1}", perplexity, sync_dist=True)
        self._val_usage, self._val_masks = [], []

    def on_validation_epoch_end(self) -> None:
        self._log_usage("val")
        if self._val_example is not None and self.trainer.is_global_zero:
            self._log_media(*self._val_example)
        self._val_example = None

    def on_test_epoch_end(self) -> None:
        self._log_usage("test")

    def _log_media(self, wave: Tensor, lengths: Tensor) -> None:
        experiment = getattr(self.logger, "experiment", None)
        if experiment is None or not hasattr(experiment, "add_audio"):
            return
        sr, step = self.codec.sample_rate, self.global_step
        with torch.no_grad():
            codes = self.codec.encode(wave)
            decodes = [
                self.codec.decode(codes[..., :q])[:, : wave.shape[1]] for q in range(1, codes.shape[-1] + 1)
            ]
        for i in range(wave.shape[0]):
            n = int(lengths[i])
            experiment.add_audio(f"audio/{i}/original", wave[i, :n].cpu()[None], step, sample_rate=sr)
            experiment.add_audio(
                f"audio/{i}/decoded", decodes[-1][i, :n].clamp(-1, 1).cpu()[None], step, sample_rate=sr
            )
        n = int(lengths[0])
        figure = spectrogram_figure(
            wave[0, :n], {f"{q + 1} level(s)": d[0, :n] for q, d in enumerate(decodes)}, sr
        )
        experiment.add_figure("spectrogram", figure, step)

    def on_fit_end(self) -> None:
        codec = plain_component(self.codec)  # gathers FSDP2 shards: every rank calls
        if self.trainer.is_global_zero:
            weights = save_weights_file(codec, Path(self.trainer.default_root_dir) / CODEC_FILE)
            write_component_folder(self.trainer, codec, weights)

    def configure_optimizers(self):  # noqa: ANN201 (Lightning's union of return types)
        params = [p for p in self.codec.parameters() if p.requires_grad]
        if self.distill_proj is not None:
            params += list(self.distill_proj.parameters())
        groups = [{"params": params, "weight_decay": 0.0}]
        adamw = lambda g: torch.optim.AdamW(g, lr=self.lr, betas=self.betas)
        optimizer = build_optimizer(groups, self.optimizer_callable, adamw, type(self).__name__)
        total = lambda: self.trainer.estimated_stepping_batches  # lazily: Lightning#20550, see schedules.py
        schedule, warmup = self.lr_scheduler_callable, max(1, self.warmup_steps)
        return lightning_optimizers(optimizer, schedule, warmup, total, self.min_lr_ratio)
