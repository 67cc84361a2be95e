"""Neural audio codec: a convolutional encoder/decoder around a residual vector quantiser (RVQ) whose first
level is semantic (ERNIE 5.0 audio tokenizer; SpeechTokenizer, Zhang et al. 2023, section 3).

A 16 kHz mono waveform `[B, N]` becomes `F = ceil(N / hop)` frames of `Q` codes `[B, F, Q]`, and any prefix
of the levels decodes back to `[B, F * hop]` samples. The encoder is a SEANet-style stack (residual units,
strided convolutions whose product is the hop: 640 samples = 25 Hz, 320 = 50 Hz) or convolutions on the
log-magnitude STFT; the decoder mirrors the encoder with transposed convolutions or, as in Vocos (Siuzdak
2023), predicts an STFT's log-magnitude and phase and inverts it. The quantiser is vector-quantize-pytorch's
`ResidualVQ` (per-level codebook sizes, k-means initialisation, EMA codebooks with dead-code expiry,
quantiser dropout that always keeps level 1). Level 1's vectors, with straight-through gradients, are
returned as `semantic` so that a task can distil them toward a teacher (`zoo.tokenizers.audio_teacher`);
the codec itself holds no teacher.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from vector_quantize_pytorch import ResidualVQ

from zoo.publishing.component import PretrainedComponent
from zoo.tokenizers.precision import full_precision
from zoo.weights import load_weights_file


@dataclass
class CodecOutput:
    """What one training forward of the codec returns.

    reconstruction: `[B, F * hop]` decoded waveform (from the levels kept by quantiser dropout).
    codes: `[B, F, Q]` long; -1 marks levels skipped by quantiser dropout in training, and padded frames.
    semantic: `[B, F, codebook_dim]` level 1's quantised vectors with straight-through gradients to the
        encoder: the input of the distillation projection.
    commit_loss: `[Q]` commitment loss per level (zero for skipped levels).
    mask: `[B, F]` bool, frames that hold at least one valid sample.
    """

    reconstruction: Tensor
    codes: Tensor
    semantic: Tensor
    commit_loss: Tensor
    mask: Tensor


def _act(x: Tensor) -> Tensor:
    # LeakyReLU(0.1) as in HiFi-GAN: on a CPU it is ~5x faster than SEANet's ELU, which otherwise takes a
    # fifth of a training step at these widths.
    return F.leaky_relu(x, 0.1)


class ResidualUnit(nn.Module):
    """x + conv1x1(act(dilated conv3(act(x)))), as in SEANet / EnCodec."""

    def __init__(self, channels: int, dilation: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, 3, dilation=dilation, padding=dilation)
        self.proj = nn.Conv1d(channels, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.proj(_act(self.conv(_act(x))))


class Activation(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return _act(x)


def _stage_channels(channels: int, max_channels: int, stages: int) -> list[int]:
    return [min(channels * 2**i, max_channels) for i in range(stages + 1)]


class Encoder(nn.Module):
    """Waveform `[B, 1, N]` (N a multiple of the hop) to latents `[B, latent_dim, N / hop]`.

    Residual units sit after each down-sampling, never at the full sample rate, where they would cost most.
    """

    def __init__(
        self,
        strides: tuple[int, ...],
        channels: int,
        max_channels: int,
        latent_dim: int,
        dilations: tuple[int, ...],
    ) -> None:
        super().__init__()
        widths = _stage_channels(channels, max_channels, len(strides))
        layers: list[nn.Module] = [nn.Conv1d(1, widths[0], 7, padding=3)]
        for stride, c_in, c_out in zip(strides, widths[:-1], widths[1:], strict=True):
            # kernel 2s, padding ceil(s/2): exactly L / s outputs for an input length L divisible by s
            layers += [
                Activation(),
                nn.Conv1d(c_in, c_out, 2 * stride, stride=stride, padding=math.ceil(stride / 2)),
            ]
            layers += [ResidualUnit(c_out, d) for d in dilations]
        layers += [Activation(), nn.Conv1d(widths[-1], latent_dim, 3, padding=1)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class STFTEncoder(nn.Module):
    """Waveform `[B, 1, N]` (N a multiple of the hop) to latents `[B, latent_dim, N / hop]` from its log-
    magnitude STFT (Hann window, n_fft = 4 stft_hop), the way spectrogram codecs encode (Langman et al.
    2024, "Spectral Codecs"): residual units at the STFT's frame rate, one strided convolution down to the
    codec's, residual units there. The frequency analysis a waveform encoder has to learn from scratch
    (formants, pitch) is given; what remains is to compress it.
    """

    def __init__(
        self, latent_dim: int, hop: int, stft_hop: int, width: int, dilations: tuple[int, ...]
    ) -> None:
        super().__init__()
        if stft_hop < 1 or hop % stft_hop:
            raise ValueError(f"AudioCodec: istft_hop must divide the hop {hop}, got {stft_hop}")
        down, self.stft_hop, self.n_fft = hop // stft_hop, stft_hop, 4 * stft_hop
        layers: list[nn.Module] = [nn.Conv1d(self.n_fft // 2 + 1, width, 3, padding=1)]
        layers += [ResidualUnit(width, d) for d in dilations]
        if down > 1:
            layers += [
                Activation(),
                nn.Conv1d(width, width, 2 * down, stride=down, padding=math.ceil(down / 2)),
            ]
        layers += [ResidualUnit(width, d) for d in dilations]
        layers += [Activation(), nn.Conv1d(width, latent_dim, 3, padding=1)]
        self.net = nn.Sequential(*layers)
        self.register_buffer("window", torch.hann_window(self.n_fft), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        wave = x.squeeze(1).float()
        frames = wave.shape[-1] // self.stft_hop
        spectrum = torch.stft(
            wave, self.n_fft, self.stft_hop, window=self.window.float(), return_complex=True
        )
        # floor 1e-2: about ShapesWorld's noise floor (std 0.002) in this STFT; fainter detail is not speech
        features = (spectrum.abs()[..., :frames] + 1e-2).log().to(x.dtype)
        return self.net(features)


class Decoder(nn.Module):
    """Latents `[B, latent_dim, F]` to waveform `[B, 1, F * hop]`; the encoder's mirror."""

    def __init__(
        self,
        strides: tuple[int, ...],
        channels: int,
        max_channels: int,
        latent_dim: int,
        dilations: tuple[int, ...],
    ) -> None:
        super().__init__()
        widths = _stage_channels(channels, max_channels, len(strides))[::-1]
        layers: list[nn.Module] = [nn.Conv1d(latent_dim, widths[0], 7, padding=3)]
        for stride, c_in, c_out in zip(strides[::-1], widths[:-1], widths[1:], strict=True):
            # (L - 1) s - 2p + 2s + op = L s  <=>  2p - op = s
            padding, output_padding = (stride + 1) // 2, stride % 2
            layers += [ResidualUnit(c_in, d) for d in dilations]
            layers += [
                Activation(),
                nn.ConvTranspose1d(c_in, c_out, 2 * stride, stride, padding, output_padding),
            ]
        layers += [Activation(), nn.Conv1d(widths[-1], 1, 7, padding=3)]
        self.net = nn.Sequential(*layers)

    def forward(self, z: Tensor) -> Tensor:
        return self.net(z)


class ISTFTDecoder(nn.Module):
    """Latents `[B, latent_dim, F]` to waveform `[B, 1, F * hop]` through an inverse STFT (Vocos, Siuzdak
    2023, section 3; WavTokenizer's decoder).

    Residual units at the frame rate, one transposed convolution up to the STFT's frame rate (x hop /
    istft_hop), residual units there, then a 1x1 convolution to a log-magnitude and a phase per frequency
    bin; the waveform is their inverse STFT (Hann window, n_fft = 4 istft_hop). The magnitude, where a word
    lives, is predicted directly instead of being built up from samples by a stack of up-sampling
    convolutions, and there is no full-rate layer, so the decoder is also faster.
    """

    def __init__(
        self, latent_dim: int, hop: int, istft_hop: int, width: int, dilations: tuple[int, ...]
    ) -> None:
        super().__init__()
        if istft_hop < 1 or hop % istft_hop:
            raise ValueError(f"AudioCodec: istft_hop must divide the hop {hop}, got {istft_hop}")
        up, self.istft_hop, self.n_fft = hop // istft_hop, istft_hop, 4 * istft_hop
        layers: list[nn.Module] = [nn.Conv1d(latent_dim, width, 7, padding=3)]
        layers += [ResidualUnit(width, d) for d in dilations]
        if up > 1:
            layers += [
                Activation(),
                nn.ConvTranspose1d(width, width, 2 * up, up, (up + 1) // 2, up % 2),
            ]
        layers += [ResidualUnit(width, d) for d in dilations]
        layers += [Activation()]
        self.net = nn.Sequential(*layers)
        self.head = nn.Conv1d(width, 2 * (self.n_fft // 2 + 1), 1)
        self.register_buffer("window", torch.hann_window(self.n_fft), persistent=False)

    def forward(self, z: Tensor) -> Tensor:
        h = self.head(self.net(z))  # [B, 2 * bins, T]
        frames = h.shape[-1]
        # T frames centred on multiples of istft_hop give (T - 1) istft_hop samples: one more (a copy of the
        # last) makes exactly T istft_hop = F hop.
        h = F.pad(h, (0, 1), mode="replicate")
        log_magnitude, phase = h.float().chunk(2, dim=1)
        spectrum = torch.polar(log_magnitude.clamp(max=8.0).exp(), phase)
        wave = torch.istft(
            spectrum,
            self.n_fft,
            self.istft_hop,
            window=self.window.float(),
            center=True,
            length=frames * self.istft_hop,
        )
        return wave.to(z.dtype).unsqueeze(1)


class AudioCodec(PretrainedComponent, nn.Module):
    """RVQ audio codec with a semantic first level: `encode` waveforms to codes, `decode` any level prefix.

    Args:
        sample_rate: waveform sample rate in Hz (16000 throughout the zoo).
        strides: down-sampling factor of each encoder stage; their product is the hop (samples per frame):
            (4, 4, 5, 8) = 640 = 25 Hz at 16 kHz, (2, 4, 5, 8) = 320 = 50 Hz.
        channels: width of the first (full-rate) stage; doubled at every stage up to `max_channels`.
        max_channels: widest stage.
        latent_dim: width of the encoder output that the quantiser sees.
        dilations: dilations of the residual units after each down-sampling (and before each up-sampling).
        codebook_sizes: codebook size of each RVQ level, level 1 (semantic) first; sizes may differ.
        codebook_dim: dimension of the code vectors (ResidualVQ projects the latent in and out when it
            differs from `latent_dim`; low-dimensional codes use codebooks better, as in DAC).
            None: latent_dim.
        cosine_codes: L2-normalise latents and code vectors and match them by cosine similarity (DAC's
            recipe against codebook collapse: the encoder cannot shrink its latents onto a few codes).
        kmeans_init: initialise each codebook by k-means on the first training batch.
        kmeans_iters: k-means iterations of that initialisation.
        ema_decay: EMA decay of the codebook updates.
        threshold_ema_dead_code: codes whose EMA usage falls below this are replaced by batch vectors.
        commitment_weight: weight of the commitment loss inside each level's loss.
        quantize_dropout: in training, drop all levels after a random one (>= level 1), so that every
            prefix of the levels decodes (EnCodec/SoundStream); level 1 is always kept, and decoding from
            level 1 alone is one of the cases trained.
        quantize_dropout_prob: share of training steps that apply quantiser dropout; the others train all
            levels (DAC applies it to half of each batch: always dropping under-trains the full codec).
        decoder: "conv" (the encoder's mirror: transposed convolutions up to the sample rate) or "istft"
            (Vocos: predict an STFT's log-magnitude and phase, then invert it; `ISTFTDecoder`).
        istft_hop: STFT hop of the "istft" decoder (n_fft = 4 istft_hop); must divide the hop.
        decoder_channels: width of the "istft" decoder and the "stft" encoder (None: max_channels).
        encoder: "conv" (SEANet: strided convolutions on the waveform) or "stft" (convolutions on the log-
            magnitude STFT with hop `istft_hop`; `STFTEncoder`).
        weights: optional safetensors file (or folder with model.safetensors) loaded after construction.
    """

    hub_title = "Audio codec"
    hub_tags = ("audio-codec", "rvq", "speech")
    hub_usage = "codes = model.encode(wave)  # [B, N] at model.sample_rate -> [B, F, Q]; model.decode(codes)"
    hub_pipeline_tag = "audio-to-audio"

    def card_facts(self) -> list[str]:
        return [
            f"- {self.sample_rate} Hz, hop {self.hop} samples ({self.frame_rate:g} frames/s)",
            f"- RVQ codebooks {list(self.codebook_sizes)} (level 1 semantic), "
            f"{self.bits_per_second():.0f} bit/s",
        ]

    construction_only = ("weights",)

    def __init__(
        self,
        sample_rate: int = 16000,
        strides: tuple[int, ...] = (4, 4, 5, 8),
        channels: int = 8,
        max_channels: int = 128,
        latent_dim: int = 64,
        dilations: tuple[int, ...] = (1, 3),
        codebook_sizes: tuple[int, ...] = (256, 256, 256, 256),
        codebook_dim: int | None = 16,
        cosine_codes: bool = False,
        kmeans_init: bool = True,
        kmeans_iters: int = 10,
        ema_decay: float = 0.95,
        threshold_ema_dead_code: float = 2.0,
        commitment_weight: float = 1.0,
        quantize_dropout: bool = True,
        quantize_dropout_prob: float = 1.0,
        decoder: str = "conv",
        istft_hop: int = 128,
        decoder_channels: int | None = None,
        encoder: str = "conv",
        weights: str | None = None,
    ) -> None:
        super().__init__()
        strides, codebook_sizes = tuple(strides), tuple(codebook_sizes)
        if not strides or any(s < 1 for s in strides):
            raise ValueError(f"AudioCodec: strides must be positive integers, got {strides}")
        if not codebook_sizes or any(c < 2 for c in codebook_sizes):
            raise ValueError(f"AudioCodec: codebook_sizes must be >= 2 each, got {codebook_sizes}")
        if channels < 1 or max_channels < channels or latent_dim < 1:
            raise ValueError(
                f"AudioCodec: need 1 <= channels <= max_channels and latent_dim >= 1, got "
                f"channels={channels}, "
                f"max_channels={max_channels}, latent_dim={latent_dim}"
            )
        self.sample_rate = sample_rate
        self.strides = strides
        self.hop = math.prod(strides)
        self.frame_rate = sample_rate / self.hop
        self.codebook_sizes = codebook_sizes
        self.num_levels = len(codebook_sizes)
        self.latent_dim = latent_dim
        self.codebook_dim = codebook_dim or latent_dim
        dilations = tuple(dilations)
        if encoder == "conv":
            self.encoder = Encoder(strides, channels, max_channels, latent_dim, dilations)
        elif encoder == "stft":
            width = decoder_channels or max_channels
            self.encoder = STFTEncoder(latent_dim, self.hop, istft_hop, width, dilations)
        else:
            raise ValueError(f"AudioCodec: encoder must be 'conv' or 'stft', got {encoder!r}")
        if decoder == "conv":
            self.decoder = Decoder(strides, channels, max_channels, latent_dim, dilations)
        elif decoder == "istft":
            width = decoder_channels or max_channels
            self.decoder = ISTFTDecoder(latent_dim, self.hop, istft_hop, width, dilations)
        else:
            raise ValueError(f"AudioCodec: decoder must be 'conv' or 'istft', got {decoder!r}")
        self.quantizer = ResidualVQ(
            dim=latent_dim,
            codebook_size=codebook_sizes,
            codebook_dim=self.codebook_dim,
            use_cosine_sim=cosine_codes,
            kmeans_init=kmeans_init,
            kmeans_iters=kmeans_iters,
            decay=ema_decay,
            threshold_ema_dead_code=threshold_ema_dead_code,
            commitment_weight=commitment_weight,
            quantize_dropout=quantize_dropout,
            # levels after a random index in [0, Q - 1] are dropped: level 1 (index 0) always stays. (Index 1
            # here, the first version, never trained the decoder on level 1 alone.)
            quantize_dropout_cutoff_index=0,
        )
        if not 0.0 <= quantize_dropout_prob <= 1.0:
            raise ValueError(
                f"AudioCodec: quantize_dropout_prob must be in [0, 1], got {quantize_dropout_prob}"
            )
        self.quantize_dropout_prob = quantize_dropout_prob
        self._init_weights()
        if weights is not None:
            load_weights_file(self, weights, what="AudioCodec weights")

    def _init_weights(self) -> None:
        # PyTorch's default conv init shrinks a 0.1-amplitude waveform stage by stage until biases dominate:
        # every frame's latent is then nearly the same vector, one optimiser step moves them all past the
        # k-means codebook, and every frame lands on one code (measured: perplexity 1 after a single step).
        # He init for LeakyReLU with zero biases keeps frame-to-frame variation of the order of the latents.
        for module in self.modules():
            if isinstance(module, nn.Conv1d | nn.ConvTranspose1d):
                fan = "fan_in" if isinstance(module, nn.Conv1d) else "fan_out"
                nn.init.kaiming_normal_(module.weight, a=0.1, mode=fan, nonlinearity="leaky_relu")
                nn.init.zeros_(module.bias)
        with torch.no_grad():  # start quiet: speech is ~0.1 in amplitude
            if isinstance(self.decoder, ISTFTDecoder):
                # magnitudes of white noise of std 1e-3 (|X| ~ std sqrt(3 n_fft / 8) under a Hann window):
                # about ShapesWorld's faint noise floor, not a tone
                head, bins = self.decoder.head, self.decoder.head.out_channels // 2
                head.weight.mul_(0.1)
                head.weight[:bins].mul_(0.1)
                head.bias[:bins].fill_(math.log(1e-3 * math.sqrt(3 * self.decoder.n_fft / 8)))
            else:
                self.decoder.net[-1].weight.mul_(0.1)

    def bits_per_second(self, levels: int | None = None) -> float:
        """Bitrate of the first `levels` levels (None: all): frame_rate * sum of log2(codebook size)."""
        return self.frame_rate * sum(math.log2(c) for c in self.codebook_sizes[: levels or self.num_levels])

    def frame_mask(self, lengths: Tensor, frames: int) -> Tensor:
        """`[B, frames]` bool: frame f holds valid samples iff f * hop < length."""
        starts = torch.arange(frames, device=lengths.device) * self.hop
        return starts[None] < lengths[:, None]

    def _check_wave(self, wave: Tensor) -> None:
        if wave.dim() != 2 or not wave.is_floating_point() or wave.shape[1] == 0:
            raise ValueError(
                f"AudioCodec: expected float waveforms [B, N] with N > 0 at {self.sample_rate} Hz, "
                f"got {tuple(wave.shape)} {wave.dtype}"
            )

    def _latents(self, wave: Tensor) -> Tensor:
        frames = math.ceil(wave.shape[1] / self.hop)
        padded = F.pad(wave, (0, frames * self.hop - wave.shape[1]))
        return self.encoder(padded.unsqueeze(1)).transpose(1, 2)  # [B, F, latent_dim]

    def forward(self, wave: Tensor, lengths: Tensor | None = None) -> CodecOutput:
        """Encode, quantise (EMA updates, dead-code expiry and quantiser dropout in training) and decode.

        Args:
            wave: `[B, N]` float waveforms, zero-padded past `lengths`.
            lengths: `[B]` valid samples per row (None: all N). Padded frames neither train the codebooks
                nor count in the commitment loss.
        """
        self._check_wave(wave)
        latents = self._latents(wave)
        mask = None if lengths is None else self.frame_mask(lengths.to(wave.device), latents.shape[1])
        dropout = self.quantizer.quantize_dropout
        if dropout and self.training and self.quantize_dropout_prob < 1.0:
            self.quantizer.quantize_dropout = bool(torch.rand(()) < self.quantize_dropout_prob)
        try:
            quantized, codes, commit, all_codes = self.quantizer(latents, mask=mask, return_all_codes=True)
        finally:
            self.quantizer.quantize_dropout = dropout
        # ResidualVQ rebuilds all_codes from the indices (no gradient to the encoder); level 1's input is the
        # projected latent itself, so a straight-through estimator gives the distillation its gradient.
        level1_in = self.quantizer.project_in(latents)
        semantic = level1_in + (all_codes[0] - level1_in).detach()
        reconstruction = self.decoder(quantized.transpose(1, 2)).squeeze(1)
        if mask is None:
            mask = torch.ones(latents.shape[:2], dtype=torch.bool, device=wave.device)
        return CodecOutput(reconstruction, codes, semantic, commit.reshape(-1), mask)

    @contextlib.contextmanager
    def _quantizer_frozen(self) -> Iterator[None]:
        # encode must not update the EMA codebooks, expire codes or drop levels, whatever the module's mode
        was_training = self.quantizer.training
        self.quantizer.eval()
        try:
            yield
        finally:
            self.quantizer.train(was_training)

    @full_precision
    def encode(self, wave: Tensor) -> Tensor:
        """Codes `[B, ceil(N / hop), Q]` (long) of waveforms `[B, N]`; no EMA updates, dead-code expiry or
        quantiser dropout, whatever the mode (an untrained codec with `kmeans_init` still initialises its
        codebooks from the first batch it sees, as vector-quantize-pytorch does)."""
        self._check_wave(wave)
        with self._quantizer_frozen():
            _, codes, _ = self.quantizer(self._latents(wave))
        return codes.long()

    def level_vectors(self, codes: Tensor) -> Tensor:
        """Code vectors `[B, F, q, codebook_dim]` of codes `[B, F, q]`; -1 entries give zeros."""
        self._check_codes(codes)
        codebooks = self.quantizer.codebooks
        vectors = []
        for level in range(codes.shape[-1]):
            index = codes[..., level]
            vector = codebooks[level][index.clamp_min(0)]
            vectors.append(vector.masked_fill((index < 0).unsqueeze(-1), 0.0))
        return torch.stack(vectors, dim=2)

    @full_precision
    def decode(self, codes: Tensor) -> Tensor:
        """Waveforms `[B, F * hop]` from codes `[B, F, q]` of the first q <= Q levels."""
        quantized = self.quantizer.project_out(self.level_vectors(codes).sum(2))
        return self.decoder(quantized.transpose(1, 2)).squeeze(1)

    def _check_codes(self, codes: Tensor) -> None:
        if codes.dim() != 3 or codes.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"AudioCodec: expected integer codes [B, F, q], got {tuple(codes.shape)} {codes.dtype}"
            )
        q = codes.shape[-1]
        if not 1 <= q <= self.num_levels:
            raise ValueError(f"AudioCodec: codes hold {q} levels; expected 1..{self.num_levels} (a prefix)")
        high = torch.tensor(self.codebook_sizes[:q], device=codes.device)
        if codes.numel() and ((codes < -1) | (codes >= high)).any():
            raise ValueError(
                f"AudioCodec: codes out of range; level l takes -1 (dropped) or 0..size-1, "
                f"sizes {self.codebook_sizes}"
            )
