"""Benchmark of the audio codec (zoo/tokenizers/audio.py) on held-out ShapesWorld speech.

Per number of RVQ levels decoded (1..Q): multi-scale mel distance, SI-SNR and the word accuracy of
ShapesWorld's speech verifier (`read_speech`) on the reconstructions, against a baseline at the same
bitrate measured in the same run (resample to bitrate / 8 Hz, 8-bit mu-law, resample back) and an 8-bit
mu-law reference at 16 kHz (128 kbit/s). Also: codebook usage per level, bitrate, encode+decode speed
(`realtime_factor`: seconds of audio per second of compute, one CPU thread; target >= 20 for the tiny
codec) against mu-law's, and a semantic probe: word identity per frame predicted by a logistic regression
from one level's codes (frames t-1, t, t+1), level 1 vs the last level (the distillation should make
level 1 the semantic one), with the majority class as the trivial baseline.

"Held-out" is the ShapesWorld "test" split (colour-shape pairs never seen in training); the probe trains on
"train" clips and is scored on those. Progress goes to stderr; the last stdout line is one JSON object.

    .venv/bin/python benchmarks/audio_codec.py [--weights runs/audio_codec/latest/audio_codec.safetensors]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import torchaudio.functional as AF
import yaml
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, emit, log, machine_info, time_interleaved  # noqa: E402

from zoo.datamodules.media_data import ShapesMediaDataModule, collate_media  # noqa: E402
from zoo.tasks.audio_tokenizer import MultiScaleMelLoss, codebook_usage, spectrogram_figure  # noqa: E402
from zoo.tasks.metrics import per_clip_si_snr as si_snr  # noqa: E402
from zoo.tokenizers.audio import AudioCodec  # noqa: E402
from zoo.tokenizers.audio_teacher import WordIdentityTeacher  # noqa: E402
from zoo.world.speech import read_speech, word_accuracy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SR = 16000


def build_codec(config: Path, weights: Path) -> AudioCodec:
    """The codec of a training YAML (`model.init_args.codec`) with trained weights."""
    if not weights.is_file():
        raise SystemExit(
            f"{weights} does not exist: train the codec first (zoo fit --config {config}) or pass --weights"
        )
    spec = yaml.safe_load(config.read_text())["model"]["init_args"]["codec"]
    args = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.get("init_args", {}).items()}
    return AudioCodec(**args, weights=str(weights)).eval()


def mulaw_roundtrip(wave: Tensor, rate: int, bits: int = 8) -> Tensor:
    """Resample to `rate` Hz, quantise to `bits`-bit mu-law, decode and resample back to 16 kHz."""
    low = AF.resample(wave, SR, rate) if rate != SR else wave
    channels = 2**bits
    decoded = AF.mu_law_decoding(AF.mu_law_encoding(low.clamp(-1, 1), channels), channels)
    back = AF.resample(decoded, rate, SR) if rate != SR else decoded
    return F.pad(back, (0, max(0, wave.shape[-1] - back.shape[-1])))[..., : wave.shape[-1]]


def clips(data: ShapesMediaDataModule, split: str, n: int) -> tuple[dict[str, Tensor], list[str]]:
    items = [{**data.render(i, split), "index": i} for i in range(n)]
    return collate_media(items), [data.caption(i, split) for i in range(n)]


def quality(
    decoded: Tensor, wave: Tensor, lengths: Tensor, captions: list[str], mel: MultiScaleMelLoss
) -> dict[str, float]:
    """Mel distance, SI-SNR and verifier word accuracy of decodes [B, >= N] of waves [B, N]."""
    mels, snrs, words = [], [], []
    for i, n in enumerate(lengths.tolist()):
        rec, ref = decoded[i, :n].clamp(-1, 1), wave[i, :n]
        mels.append(float(mel(rec[None], ref[None])))
        snrs.append(float(si_snr(rec[None], ref[None])))
        words.append(word_accuracy(captions[i], read_speech(rec)))
    return {
        "mel_distance": round(sum(mels) / len(mels), 4),
        "si_snr_db": round(sum(snrs) / len(snrs), 2),
        "word_accuracy": round(sum(words) / len(words), 4),
    }


def probe_features(codes: Tensor, size: int) -> Tensor:
    """One-hot codes of frames t-1, t, t+1 (zeros beyond the ends): [B, F, 3 * size]."""
    onehot = F.one_hot(codes.clamp_min(0), size).float() * (codes >= 0).unsqueeze(-1)
    before = F.pad(onehot, (0, 0, 1, 0))[:, :-1]
    after = F.pad(onehot, (0, 0, 0, 1))[:, 1:]
    return torch.cat([before, onehot, after], dim=-1)


def word_probe(train: tuple[Tensor, Tensor], test: tuple[Tensor, Tensor], classes: int, steps: int) -> float:
    """Accuracy on `test` of a softmax regression fitted on `train`; each is (features [M, D], labels [M])."""
    x, y = train
    linear = torch.nn.Linear(x.shape[1], classes)
    optimizer = torch.optim.Adam(linear.parameters(), lr=0.05)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(linear(x), y) + 1e-4 * linear.weight.pow(2).sum()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        return float((linear(test[0]).argmax(-1) == test[1]).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=REPO / "configs/tokenizers/audio.yaml")
    parser.add_argument(
        "--weights", type=Path, default=REPO / "runs/audio_codec/latest/audio_codec.safetensors",
    )
    parser.add_argument("--clips", type=int, default=48, help="held-out clips scored")
    parser.add_argument("--probe-clips", type=int, default=192, help="training clips of the word probe")
    parser.add_argument("--probe-steps", type=int, default=300)
    parser.add_argument(
        "--figure", type=Path, default=None, help="write a spectrogram PNG of one held-out clip"
    )
    parser.add_argument("--speed-seconds", type=float, default=10.0, help="audio length of the speed test")
    add_common_args(parser, repeats=5)
    args = parser.parse_args()
    machine = machine_info(args.threads)
    torch.manual_seed(args.seed)
    codec = build_codec(args.config, args.weights)
    data = ShapesMediaDataModule(kind="speech", seed=args.seed)
    mel = MultiScaleMelLoss(SR, (256, 512, 1024))
    Q = codec.num_levels

    batch, captions = clips(data, "test", args.clips)
    wave, lengths = batch["audio"], batch["audio_lengths"]
    log(f"{args.clips} held-out clips, {float(lengths.sum()) / SR:.1f} s; codec hop {codec.hop}, Q={Q}")
    with torch.no_grad():
        codes = codec.encode(wave)
        mask = codec.frame_mask(lengths, codes.shape[1])
        per_level, baseline = [], []
        for q in range(1, Q + 1):
            bps = codec.bits_per_second(q)
            per_level.append(
                {
                    "levels": q,
                    "bits_per_second": bps,
                    **quality(codec.decode(codes[..., :q]), wave, lengths, captions, mel),
                }
            )
            rate = max(1, round(bps / 8))
            baseline.append(
                {
                    "levels": q,
                    "bits_per_second": 8 * rate,
                    "sample_rate": rate,
                    **quality(mulaw_roundtrip(wave, rate), wave, lengths, captions, mel),
                }
            )
            log(f"  {q} level(s): codec {per_level[-1]}  baseline {baseline[-1]}")
        reference = quality(mulaw_roundtrip(wave, SR), wave, lengths, captions, mel)
        original = quality(wave, wave, lengths, captions, mel)
    usage = codebook_usage(codes, mask, codec.codebook_sizes)
    if args.figure is not None:
        n = int(lengths[0])
        with torch.no_grad():
            decodes = {
                f"{q} level{'s' if q > 1 else ''}": codec.decode(codes[:1, :, :q])[0, :n]
                for q in range(1, Q + 1)
            }
        figure = spectrogram_figure(wave[0, :n], decodes, SR)
        figure.suptitle(f'"{captions[0]}"', fontsize=8)
        figure.tight_layout(rect=(0, 0, 1, 0.97))
        figure.savefig(args.figure, dpi=60)
        log(f"wrote {args.figure}")

    # Speed: one clip of --speed-seconds, encode + decode, interleaved with mu-law on the same audio.
    long_wave = torch.cat([wave[i, : int(n)] for i, n in enumerate(lengths.tolist())])
    repeats = math.ceil(args.speed_seconds * SR / long_wave.shape[0])
    long_wave = long_wave.repeat(repeats)[None, : int(args.speed_seconds * SR)]

    def codec_roundtrip() -> Tensor:
        with torch.no_grad():
            return codec.decode(codec.encode(long_wave))

    seconds, _, spread = time_interleaved(
        {"codec": codec_roundtrip, "mulaw": lambda: mulaw_roundtrip(long_wave, SR)}, args.warmup, args.repeats
    )
    rtf = {name: args.speed_seconds / s for name, s in seconds.items()}

    # Semantic probe: word identity per frame from one level's codes.
    teacher = WordIdentityTeacher()
    probe_batch, _ = clips(data, "train", args.probe_clips)
    with torch.no_grad():
        probe_codes = codec.encode(probe_batch["audio"])
    sets = {}
    for name, (w, n, c) in {
        "train": (probe_batch["audio"], probe_batch["audio_lengths"], probe_codes),
        "test": (wave, lengths, codes),
    }.items():
        labels = teacher.word_ids(w, n, codec.hop)
        sets[name] = (c, labels, codec.frame_mask(n, c.shape[1]))
    classes = len(teacher.words)
    probe = {}
    for level in sorted({1, Q}):
        size = codec.codebook_sizes[level - 1]
        data_sets = [(probe_features(c[..., level - 1], size)[m], y[m]) for c, y, m in sets.values()]
        probe[f"level{level}"] = round(word_probe(data_sets[0], data_sets[1], classes, args.probe_steps), 4)
    train_labels = sets["train"][1][sets["train"][2]]
    majority = int(torch.bincount(train_labels, minlength=classes).argmax())
    test_labels = sets["test"][1][sets["test"][2]]
    probe["majority_baseline"] = round(float((test_labels == majority).float().mean()), 4)
    log(f"probe {probe}; speed {rtf}")

    emit(
        {
            "benchmark": "audio_codec",
            "realtime_factor": round(rtf["codec"], 2),
            "mulaw_realtime_factor": round(rtf["mulaw"], 2),
            "speed_vs_mulaw": round(rtf["codec"] / rtf["mulaw"], 4),
            "realtime_target": 20,
            "timing_spread": spread,
            "frame_rate": codec.frame_rate,
            "codebook_sizes": list(codec.codebook_sizes),
            "bits_per_second": codec.bits_per_second(),
            "per_levels": per_level,
            "baseline_same_bitrate_mulaw": baseline,
            "reference_mulaw8_16khz": {"bits_per_second": 8 * SR, **reference},
            "original": original,
            "codebook_usage": [round(u, 4) for u, _ in usage],
            "codebook_perplexity": [round(p, 2) for _, p in usage],
            "word_probe_accuracy": probe,
            "clips": args.clips,
            "audio_seconds": round(float(lengths.sum()) / SR, 2),
            "weights": str(args.weights),
            "parameters": sum(p.numel() for p in codec.parameters()),
            **machine,
        }
    )


if __name__ == "__main__":
    main()
