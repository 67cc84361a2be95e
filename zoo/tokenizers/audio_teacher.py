"""Frozen teachers for the semantic level of the audio codec (SpeechTokenizer section 3.2, ERNIE 5.0 audio).

The codec's first RVQ level is distilled toward a teacher's features, one vector per codec frame. The
teacher is a swappable component: every teacher maps waveforms `[B, N]` (16 kHz, zero-padded past
`lengths`) to features `[B, ceil(N / hop), dim]` aligned to the codec's frames, without gradients.

- `WhisperTeacher`: a Whisper encoder through `transformers` (ERNIE 5.0's and Baichuan-Audio's choice);
  an optional extra, imported only when the teacher is built.
- `MelStatisticsTeacher`: a built-in, download-free teacher for tests and offline runs: normalised
  log-mel statistics per frame through a fixed random projection. It carries spectral shape, not words,
  so it makes level 1 "spectral" rather than semantic; use the Whisper teacher for real speech.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
import torchaudio
from torch import Tensor, nn

from zoo.config import Configurable

_CACHE_SIZE = 65536  # utterances whose word spans WordIdentityTeacher keeps


def frame_count(samples: int, hop: int) -> int:
    """Codec frames of a waveform of `samples` samples: the last partial frame counts (zero-padded)."""
    return math.ceil(samples / hop)


def to_frames(features: Tensor, frames: int) -> Tensor:
    """Resample `[B, T, D]` features along time to `[B, frames, D]` (linear, ends aligned)."""
    if features.shape[1] == frames:
        return features
    resampled = F.interpolate(features.transpose(1, 2), size=frames, mode="linear", align_corners=False)
    return resampled.transpose(1, 2)


def check_waveforms(wave: Tensor, what: str) -> None:
    if wave.dim() != 2 or not wave.is_floating_point():
        raise ValueError(f"{what}: expected float waveforms [B, N], got {tuple(wave.shape)} {wave.dtype}")


class AudioTeacher(nn.Module):
    """Base of the codec's teachers: frozen, `dim` features per codec frame.

    Subclasses set `self.dim` and implement `features(wave, lengths, hop)`; `forward` runs it without
    gradients, so a teacher never trains, whatever optimiser the task builds.
    """

    dim: int
    sample_rate: int

    def features(self, wave: Tensor, lengths: Tensor, hop: int) -> Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def forward(self, wave: Tensor, lengths: Tensor | None = None, hop: int = 640) -> Tensor:
        """Teacher features `[B, ceil(N / hop), dim]` of waveforms `[B, N]` (`lengths` [B]: valid samples)."""
        check_waveforms(wave, type(self).__name__)
        if lengths is None:
            lengths = torch.full((wave.shape[0],), wave.shape[1], dtype=torch.long, device=wave.device)
        out = self.features(wave, lengths, hop)
        expected = (wave.shape[0], frame_count(wave.shape[1], hop), self.dim)
        if tuple(out.shape) != expected:
            raise RuntimeError(f"{type(self).__name__} returned {tuple(out.shape)}, expected {expected}")
        return out.detach()

    def train(self, mode: bool = True) -> AudioTeacher:
        return super().train(False)  # frozen: no dropout, no running statistics, ever


class MelStatisticsTeacher(Configurable, AudioTeacher):
    """Frozen log-mel statistics through a fixed random projection, one vector per codec frame.

    Per 10 ms window: the log-mel spectrum, normalised per utterance (mean and variance over its valid
    frames, so loudness does not matter), and its time difference; averaged over each codec frame and
    multiplied by a seeded Gaussian matrix. Deterministic, needs no download.

    Args:
        dim: feature size.
        n_mels: mel bands of the underlying spectrogram.
        sample_rate: waveform sample rate in Hz.
        seed: seed of the projection matrix.
    """

    def __init__(self, dim: int = 64, n_mels: int = 40, sample_rate: int = 16000, seed: int = 0) -> None:
        super().__init__()
        if dim < 1 or n_mels < 1:
            raise ValueError(f"MelStatisticsTeacher: dim and n_mels must be >= 1, got {dim}, {n_mels}")
        self.dim, self.n_mels, self.sample_rate = dim, n_mels, sample_rate
        self.window_hop = sample_rate // 100
        with torch.device("cpu"):  # torchaudio checks its filter bank with .item(), impossible on meta
            self.mel = torchaudio.transforms.MelSpectrogram(
                sample_rate=sample_rate, n_fft=4 * self.window_hop, hop_length=self.window_hop, n_mels=n_mels
            )
        generator = torch.Generator().manual_seed(seed)
        projection = torch.randn(2 * n_mels, dim, generator=generator) / math.sqrt(2 * n_mels)
        self.register_buffer("projection", projection, persistent=False)

    def features(self, wave: Tensor, lengths: Tensor, hop: int) -> Tensor:
        frames = frame_count(wave.shape[1], hop)
        padded = F.pad(wave, (0, frames * hop - wave.shape[1]))
        mel = self.mel(padded)
        # a floor relative to each clip's peak keeps the features independent of loudness
        floor = 1e-6 * mel.amax(dim=(1, 2), keepdim=True).clamp_min(1e-10)
        log_mel = (mel + floor).log().transpose(1, 2)  # [B, T, n_mels], T = N / window_hop + 1
        log_mel = log_mel[:, : frames * hop // self.window_hop]
        starts = torch.arange(log_mel.shape[1], device=wave.device) * self.window_hop
        valid = starts[None] < lengths[:, None]
        weight = valid.unsqueeze(-1).float()
        count = weight.sum(1, keepdim=True).clamp_min(1.0)
        mean = (log_mel * weight).sum(1, keepdim=True) / count
        std = (((log_mel - mean) ** 2 * weight).sum(1, keepdim=True) / count).sqrt().clamp_min(1e-3)
        normalised = (log_mel - mean) / std * weight
        delta = torch.diff(normalised, dim=1, prepend=normalised[:, :1])
        stats = torch.cat([normalised, delta], dim=-1) @ self.projection
        if hop % self.window_hop == 0:  # exact: average the windows inside each codec frame
            return stats.reshape(stats.shape[0], frames, hop // self.window_hop, self.dim).mean(2)
        return to_frames(stats, frames)


class WordIdentityTeacher(Configurable, AudioTeacher):
    """ShapesWorld's frozen word recogniser as a teacher: each frame gets a fixed embedding of the word
    heard there, so level 1 learns *which word*, not how it sounded (the role Whisper/HuBERT features play
    for real speech).

    Words are found and recognised from the waveform itself by `zoo.datamodules.shapes_speech`
    (`split_words` cuts at pauses, `read_speech` matches templates), so the teacher needs no labels. A
    frame takes the embedding of the word covering most of it, or the "silence" embedding. Embeddings are
    seeded Gaussian vectors, one per vocabulary word plus silence: deterministic and near-orthogonal.
    Runs on the CPU in numpy (tens of milliseconds per utterance), so word ids are cached per distinct
    waveform: a training run sees the same utterances every epoch.

    Args:
        dim: embedding size.
        sample_rate: waveform sample rate in Hz.
        seed: seed of the embeddings.
    """

    def __init__(self, dim: int = 64, sample_rate: int = 16000, seed: int = 0) -> None:
        super().__init__()
        from zoo.datamodules.shapes import caption_vocabulary

        self.dim, self.sample_rate = dim, sample_rate
        self.words = ("<silence>", *caption_vocabulary())
        generator = torch.Generator().manual_seed(seed)
        self.register_buffer(
            "embeddings", torch.randn(len(self.words), dim, generator=generator), persistent=False
        )
        self._cache: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}

    def _spans(self, clip: np.ndarray) -> list[tuple[int, int, int]]:
        """(start, end, word index) of each word recognised in a clip; cached by content."""
        from zoo.datamodules.shapes_speech import read_speech, split_words

        key = (hash(clip.tobytes()), clip.size, self.sample_rate)
        if key not in self._cache:
            index = {w: i for i, w in enumerate(self.words)}
            spans = []
            if clip.size and abs(clip).max() > 0:
                # read_speech names one word per split_words segment, in order; recognising each cut piece
                # on its own instead would re-cut it, and a two-syllable word can then split in two.
                segments, words = (
                    split_words(clip, self.sample_rate),
                    read_speech(clip, self.sample_rate).split(),
                )
                if len(segments) == len(words):
                    spans = [
                        (a, b, index[w]) for (a, b), w in zip(segments, words, strict=True) if w in index
                    ]
            if len(self._cache) >= _CACHE_SIZE:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = spans
        return self._cache[key]

    def word_ids(self, wave: Tensor, lengths: Tensor, hop: int) -> Tensor:
        """`[B, ceil(N / hop)]` long: per frame the index into `self.words` of the word heard (0: silence)."""
        ids = torch.zeros(wave.shape[0], frame_count(wave.shape[1], hop), dtype=torch.long)
        for row, (w, n) in enumerate(zip(wave.detach().float().cpu().numpy(), lengths.tolist(), strict=True)):
            for start, end, word in self._spans(w[: int(n)]):
                # the frames whose centre lies inside the word
                first, last = round(start / hop), round(end / hop)
                ids[row, first : max(last, first + 1)] = word
        return ids.to(wave.device)

    def features(self, wave: Tensor, lengths: Tensor, hop: int) -> Tensor:
        return self.embeddings[self.word_ids(wave, lengths, hop)]


class WhisperTeacher(Configurable, AudioTeacher):
    """A frozen Whisper encoder (`transformers`), ERNIE 5.0's audio teacher; its 50 Hz hidden states are
    resampled to the codec's frames. Needs the optional extra: `pip install multimodal-zoo[whisper]`.

    Args:
        model_name_or_path: a hub id (e.g. "openai/whisper-base") or a local folder.
        layer: which hidden state to return (-1: the encoder output; SpeechTokenizer averages HuBERT
            layers, Whisper's last layer is the usual choice).
        sample_rate: waveform sample rate in Hz (Whisper expects 16 kHz).
    """

    def __init__(self, model_name_or_path: str, layer: int = -1, sample_rate: int = 16000) -> None:
        super().__init__()
        try:
            from transformers import WhisperFeatureExtractor, WhisperModel
        except ImportError as err:
            raise ImportError(
                "WhisperTeacher needs the `transformers` package, which is an optional extra: "
                "pip install multimodal-zoo[whisper]  "
                "(or use zoo.tokenizers.audio_teacher.MelStatisticsTeacher)"
            ) from err
        if sample_rate != 16000:
            raise ValueError(f"WhisperTeacher: Whisper expects 16000 Hz input, got sample_rate={sample_rate}")
        self.model_name_or_path, self.layer, self.sample_rate = model_name_or_path, layer, sample_rate
        self.extractor = WhisperFeatureExtractor.from_pretrained(model_name_or_path)
        self.encoder = WhisperModel.from_pretrained(model_name_or_path).get_encoder()
        self.encoder.requires_grad_(False)
        self.dim = int(self.encoder.config.d_model)
        self.eval()

    def features(self, wave: Tensor, lengths: Tensor, hop: int) -> Tensor:
        frames = frame_count(wave.shape[1], hop)
        clips = [w[: int(n)].float().cpu().numpy() for w, n in zip(wave, lengths, strict=True)]
        inputs = self.extractor(clips, sampling_rate=self.sample_rate, return_tensors="pt")
        features = inputs.input_features.to(device=wave.device, dtype=next(self.encoder.parameters()).dtype)
        out = self.encoder(features, output_hidden_states=True)
        hidden = out.hidden_states[self.layer].float()  # [B, 1500, D] at 50 Hz for the padded 30 s
        whisper_frames = math.ceil(wave.shape[1] * 50 / self.sample_rate)
        return to_frames(hidden[:, :whisper_frames], frames)
