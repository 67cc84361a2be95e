"""Frozen teachers for the semantic level of the audio codec (SpeechTokenizer section 3.2, ERNIE 5.0 audio).

The codec's first RVQ level is distilled toward a teacher's features, one vector per codec frame. The
teacher is a swappable component: every teacher maps waveforms `[B, N]` (16 kHz, zero-padded past
`lengths`) to features `[B, ceil(N / hop), dim]` aligned to the codec's frames, without gradients.

- `WhisperTeacher`: a Whisper encoder through `transformers` (ERNIE 5.0's and Baichuan-Audio's choice),
  loaded from a local folder, clips windowed in 30 s pieces; an optional extra, imported only when the
  teacher is built.
- `MelStatisticsTeacher`: a built-in, download-free teacher for tests and offline runs: normalised
  log-mel statistics per frame through a fixed random projection. It carries spectral shape, not words,
  so it makes level 1 "spectral" rather than semantic; use the Whisper teacher for real speech.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

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

    Words are found and recognised from the waveform itself by `zoo.world.speech`
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
        from zoo.world.scenes import caption_vocabulary

        self.dim, self.sample_rate = dim, sample_rate
        self.words = ("<silence>", *caption_vocabulary())
        generator = torch.Generator().manual_seed(seed)
        self.register_buffer(
            "embeddings", torch.randn(len(self.words), dim, generator=generator), persistent=False
        )
        self._cache: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}

    def _spans(self, clip: np.ndarray) -> list[tuple[int, int, int]]:
        """(start, end, word index) of each word recognised in a clip; cached by content."""
        from zoo.world.speech import read_speech, split_words

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


def span_average(features: Tensor, frame_samples: int, length: int, hop: int, frames: int) -> Tensor:
    """Average `[T, D]` features, frame t covering samples `[t * frame_samples, (t + 1) * frame_samples)`,
    over each codec frame's span `[f * hop, (f + 1) * hop)`, cut at `length`: `[frames, D]`.

    Each input frame counts by the samples it shares with the span, so any hop works; with hop 640 and
    Whisper's 320-sample frames, codec frame f is exactly the mean of Whisper frames 2f and 2f + 1. Samples
    at or past `length` (padding) never count; a codec frame with none left is zero.
    """
    starts = torch.arange(frames, device=features.device) * hop
    ends = (starts + hop).clamp(max=length)
    starts = starts.clamp(max=length)
    # a span of `hop` samples touches at most hop // frame_samples + 2 input frames
    index = starts[:, None] // frame_samples + torch.arange(hop // frame_samples + 2, device=features.device)
    lo = torch.maximum(index * frame_samples, starts[:, None])
    hi = torch.minimum((index + 1) * frame_samples, ends[:, None])
    weight = (hi - lo).clamp_min(0).to(features.dtype)  # [frames, K] samples shared with the span
    if features.shape[0] == 0:
        return features.new_zeros(frames, features.shape[1])
    picked = features[index.clamp(max=features.shape[0] - 1)]  # indices past the end carry weight 0
    return (picked * weight[..., None]).sum(1) / weight.sum(1, keepdim=True).clamp_min(1.0)


def check_whisper_folder(folder: Path) -> None:
    """Refuse, naming the file at fault, anything but a local Whisper folder with safetensors weights."""
    expected = "a Whisper model folder: config.json, preprocessor_config.json and model.safetensors"
    if not folder.is_dir():
        raise FileNotFoundError(
            f"WhisperTeacher: no folder at {folder} (expected {expected}). Whisper is loaded from a local "
            f"folder, never downloaded; on a machine with network: "
            f"huggingface-cli download openai/whisper-base --local-dir {folder}"
        )
    config = folder / "config.json"
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as err:
        raise ValueError(f"WhisperTeacher: cannot read {config} ({err}); expected {expected}") from err
    if model_type != "whisper":
        raise ValueError(f"WhisperTeacher: {config} has model_type {model_type!r}, expected 'whisper'")
    if not (folder / "preprocessor_config.json").is_file():
        raise ValueError(f"WhisperTeacher: {folder} has no preprocessor_config.json (expected {expected})")
    if not any(folder.glob("*.safetensors")):
        raise ValueError(
            f"WhisperTeacher: {folder} has no .safetensors weights (expected {expected}); pickled .bin "
            f"weights are never loaded"
        )


class WhisperTeacher(Configurable, AudioTeacher):
    """A frozen Whisper encoder (`transformers`), ERNIE 5.0's audio teacher, loaded from a local folder.

    Whisper hears 30 s at a time (its encoder accepts nothing else), so each clip is cut into 30 s windows,
    each zero-padded on its own by Whisper's feature extractor; the windows' 50 Hz frames (320 samples
    each at 16 kHz) are concatenated and averaged over each codec frame's span (`span_average`: hop 640
    is exactly two Whisper frames). A clip's features therefore depend only on its own samples: never on
    the rows it is batched with, nor on the padding past its length. Codec frames with no valid sample are
    zero (the task's frame mask leaves them out of the loss).

    Needs the optional extra `pip install multimodal-zoo[whisper]` (`transformers`, imported only here).
    A folder comes from `huggingface-cli download openai/whisper-base --local-dir PATH` on a machine with
    network; loading never goes online (`local_files_only`) and reads safetensors only.

    Args:
        path: local folder of a Whisper model (config.json, preprocessor_config.json, model.safetensors).
        layer: which hidden state, indexed as in `transformers`' `hidden_states` (0: the convolutional
            embeddings, k: after k encoder blocks, -1 or L: the encoder's output after its final LayerNorm).
            Any other layer is the un-normalised residual stream, whose scale grows with depth and from
            frame to frame; it is layer-normalised per frame (no learned scale or shift), as the last layer
            is, so that every layer enters the distillation loss on the same footing and no loud frame
            dominates SpeechTokenizer's cosine along time. Blocks after the chosen layer are dropped at
            load: never run, never stored.
        sample_rate: waveform sample rate in Hz (Whisper expects 16 kHz).
        window_batch_size: 30 s windows per encoder call (bounds memory on long clips and big batches).
    """

    def __init__(
        self, path: str, layer: int = -1, sample_rate: int = 16000, window_batch_size: int = 16
    ) -> None:
        super().__init__()
        try:
            from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperModel
        except ImportError as err:
            raise ImportError(
                "WhisperTeacher needs the `transformers` package, which is an optional extra: "
                "pip install multimodal-zoo[whisper]  "
                "(or use zoo.tokenizers.audio_teacher.MelStatisticsTeacher)"
            ) from err
        if sample_rate != 16000:
            raise ValueError(f"WhisperTeacher: Whisper expects 16000 Hz input, got sample_rate={sample_rate}")
        if window_batch_size < 1:
            raise ValueError(f"WhisperTeacher: window_batch_size must be >= 1, got {window_batch_size}")
        folder = Path(path).expanduser()
        check_whisper_folder(folder)
        self.path, self.layer, self.sample_rate = path, layer, sample_rate
        self.window_batch_size = window_batch_size
        self.extractor = WhisperFeatureExtractor.from_pretrained(folder, local_files_only=True)
        if torch.empty(()).device.type == "meta":
            # a meta build (config checks) holds no storage: the architecture alone, weights unread
            model = WhisperModel(WhisperConfig.from_pretrained(folder, local_files_only=True))
        else:
            model = WhisperModel.from_pretrained(folder, local_files_only=True, use_safetensors=True)
        encoder = model.get_encoder().float()
        blocks = len(encoder.layers)
        if not -(blocks + 1) <= layer <= blocks:
            raise ValueError(
                f"WhisperTeacher: {folder} has {blocks} encoder blocks, so layer must be in "
                f"[{-(blocks + 1)}, {blocks}] (hidden_states indexing), got {layer}"
            )
        index = layer % (blocks + 1)
        self.normalise = index < blocks
        if self.normalise:
            encoder.layers = encoder.layers[:index]
            encoder.layer_norm = nn.Identity()
        self.encoder = encoder.requires_grad_(False)
        self.dim = int(encoder.config.d_model)
        # Whisper frames: the mel hop times the encoder's two convolution strides (160 * 1 * 2 = 320)
        self.frame_samples = self.extractor.hop_length * encoder.conv1.stride[0] * encoder.conv2.stride[0]
        self.window = self.extractor.n_samples
        if self.window != encoder.config.max_source_positions * self.frame_samples:
            raise ValueError(
                f"WhisperTeacher: {folder}: the feature extractor's {self.window}-sample window does not "
                f"give the encoder's {encoder.config.max_source_positions} frames of {self.frame_samples}"
            )
        self.eval()

    def _encode_windows(self, windows: list[np.ndarray]) -> Tensor:
        """Hidden states `[W, 1500, dim]` of 30 s windows (each zero-padded to 30 s on its own)."""
        parameter = next(self.encoder.parameters())
        out = []
        for first in range(0, len(windows), self.window_batch_size):
            chunk = windows[first : first + self.window_batch_size]
            inputs = self.extractor(chunk, sampling_rate=self.sample_rate, return_tensors="pt")
            mel = inputs.input_features.to(device=parameter.device, dtype=parameter.dtype)
            hidden = self.encoder(mel).last_hidden_state.float()
            out.append(F.layer_norm(hidden, hidden.shape[-1:]) if self.normalise else hidden)
        return torch.cat(out)

    def features(self, wave: Tensor, lengths: Tensor, hop: int) -> Tensor:
        frames = frame_count(wave.shape[1], hop)
        clips = [w[: int(n)].float().cpu().numpy() for w, n in zip(wave, lengths, strict=True)]
        windows, owner = [], []
        for row, clip in enumerate(clips):
            for start in range(0, clip.size, self.window):
                windows.append(clip[start : start + self.window])
                owner.append(row)
        out = torch.zeros(wave.shape[0], frames, self.dim, device=wave.device)
        if not windows:
            return out
        hidden = self._encode_windows(windows).to(wave.device)
        owners = torch.tensor(owner, device=hidden.device)
        for row, clip in enumerate(clips):
            if clip.size:  # the clip's windows, in order: one 50 Hz sequence covering all its samples
                sequence = hidden[owners == row].reshape(-1, self.dim)
                out[row] = span_average(sequence, self.frame_samples, clip.size, hop, frames)
        return out
