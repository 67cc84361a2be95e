"""Does the unified model learn from real paired data? (issue 14, "a real-media check of learning").

A small real corpus of transcribed speech is assembled from files a speech synthesizer speaks: English
phrases (a colour, an animal, a verb, a number: 12 x 10 x 8 x 10 combinations) spoken by espeak-ng (the
Debian package `espeak-ng`, 1.51) in four English voices at two speeds, written as 22.05 kHz WAV files
that `zoo.media` resamples to 16 kHz (soxr) on the way in. Held-out phrases are combinations never
heard in training (their words are all known).

Stages, each through `zoo fit` with the shipped configs (overlays written under `--out`):
1. the audio codec of `configs/demo/audio_codec.yaml` trained on the corpus (its semantic level distilled
   toward `MelStatisticsTeacher`: ShapesWorld's word teacher does not apply to real speech);
2. the unified model of `configs/pretrain/real_media.yaml` (no visual tokenizer) trained on the corpus
   through `PairedDataModule` (speech to transcript and transcript to speech), once per seed;
3. held-out losses on correctly paired samples against the same samples with their pairs shuffled (a
   fixed derangement): the transcript loss given the speech (ASR) and the speech loss given the transcript
   (TTS). Same targets, other conditioning, so the gap is what the model learned of the pairing.

    .venv/bin/python benchmarks/real_pairing.py --out runs/real_pairing --seeds 0 1 2 --steps 600

Progress on stderr; the last stdout line is one JSON object (per seed and the mean over seeds).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
COLOURS = [
    "red",
    "green",
    "blue",
    "yellow",
    "black",
    "white",
    "purple",
    "orange",
    "brown",
    "pink",
    "grey",
    "gold",
]
ANIMALS = ["cat", "dog", "horse", "mouse", "bird", "fish", "sheep", "goat", "lion", "bear"]
VERBS = ["runs", "jumps", "sleeps", "sings", "swims", "eats", "waits", "falls"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
VOICES = ["en-us", "en-gb", "en-gb-scotland", "en-029"]
SPEEDS = [140, 175]


def say(text: str, voice: str, speed: int, path: Path) -> None:
    subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(path), text], check=True)


def build_corpus(folder: Path, train: int, heldout: int, seed: int = 0) -> tuple[Path, Path]:
    """Speak `train` + `heldout` phrases into `folder` (kept if already there); returns the two manifests."""
    manifests = folder / "train.jsonl", folder / "heldout.jsonl"
    if all(m.is_file() for m in manifests):
        return manifests
    if shutil.which("espeak-ng") is None:
        raise SystemExit("espeak-ng is missing: `apt-get install espeak-ng` (Debian) speaks the corpus")
    phrases = [" ".join(p) for p in itertools.product(COLOURS, ANIMALS, VERBS, NUMBERS)]
    rng = random.Random(seed)
    rng.shuffle(phrases)
    splits = {"heldout": phrases[:heldout], "train": phrases[heldout : heldout + train]}
    (folder / "wav").mkdir(parents=True, exist_ok=True)
    for split, chosen in splits.items():
        lines = []
        for i, text in enumerate(chosen):
            voice, speed = VOICES[i % len(VOICES)], SPEEDS[(i // len(VOICES)) % len(SPEEDS)]
            name = f"wav/{split}_{i:04d}.wav"
            say(text, voice, speed, folder / name)
            lines.append(json.dumps({"audio": name, "text": text, "voice": voice, "speed": speed}))
            if i % 100 == 0:
                print(f"corpus: {split} {i}/{len(chosen)}", file=sys.stderr, flush=True)
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return manifests


def zoo_fit(*args: str) -> None:
    command = [sys.executable, "-m", "zoo.cli", "fit", *args, "--trainer.enable_progress_bar=false"]
    print("$ " + " ".join(command), file=sys.stderr, flush=True)
    subprocess.run(command, cwd=REPO, check=True)


def train_codec(out: Path, train: Path, heldout: Path, steps: int) -> Path:
    weights = out / "codec" / "latest" / "audio_codec.safetensors"
    if weights.is_file():
        return weights
    overlay = out / "codec_overlay.yaml"
    overlay.write_text(
        f"""trainer:
  max_steps: {steps}
  val_check_interval: {steps}
  default_root_dir: {out / "codec"}
model:
  init_args:
    teacher:
      class_path: zoo.tokenizers.audio_teacher.MelStatisticsTeacher
      init_args:
        dim: 64
data:
  class_path: zoo.datamodules.media_data.ManifestMediaDataModule
  init_args:
    train_manifest: {train}
    val_manifest: {heldout}
    kind: audio
    batch_size: 12
    num_workers: 1
"""
    )
    zoo_fit("--config", "configs/demo/audio_codec.yaml", "--config", str(overlay))
    return weights


def train_unified(out: Path, train: Path, heldout: Path, codec: Path, seed: int, steps: int) -> Path:
    root = out / f"unified_seed{seed}"
    checkpoint = root / "latest" / "checkpoints" / "last.ckpt"
    if checkpoint.is_file():
        return checkpoint
    overlay = out / f"unified_overlay_seed{seed}.yaml"
    overlay.write_text(
        f"""seed_everything: {seed}
trainer:
  max_steps: {steps}
  val_check_interval: {steps}
  default_root_dir: {root}
model:
  init_args:
    model:
      init_args:
        visual_tokenizer: null
        audio_codec:
          init_args:
            weights: {codec}
data:
  init_args:
    seed: {seed}
    sources:
    - class_path: zoo.datamodules.sources.ManifestSource
      init_args:
        manifests: [{train}]
        caption_keys: [text]
        tasks:
          caption: 0.0
          audio_to_text: 1.0
          text_to_audio: 1.0
    val_sources:
    - class_path: zoo.datamodules.sources.ManifestSource
      init_args:
        manifests: [{heldout}]
        caption_keys: [text]
        tasks:
          caption: 0.0
          audio_to_text: 1.0
          text_to_audio: 1.0
"""
    )
    zoo_fit("--config", "configs/pretrain/real_media.yaml", "--config", str(overlay))
    return checkpoint


@torch.no_grad()
def pairing_losses(checkpoint: Path, heldout: Path) -> dict[str, list[float]]:
    """Per held-out sample: transcript loss given its own speech and given another sample's speech (ASR),
    speech loss given its own transcript and given another's (TTS)."""
    from zoo.datamodules.sequence import AudioSegment, MediaLayout, SequenceBuilder, TextSegment
    from zoo.hub import load_lightning_checkpoint
    from zoo.media import load_audio

    model, tokenizer = load_lightning_checkpoint(checkpoint)
    vocab, folder = model.vocab, heldout.parent
    records = [json.loads(line) for line in heldout.read_text().splitlines()]
    waves = [load_audio(folder / r["audio"], model.audio_codec.sample_rate) for r in records]
    texts = [vocab.text_to_unified(tokenizer.encode(r["text"])).tolist() for r in records]
    other = [(i + 1) % len(records) for i in range(len(records))]  # a derangement: every pair broken
    builder = SequenceBuilder(vocab, model.backbone.max_seq_len, layout=MediaLayout.of(model))
    bos, eos = TextSegment([vocab.bos_id]), TextSegment([vocab.eos_id])

    def loss(document: list, head: str) -> float:
        return float(model(builder.collate([document])).heads[head].loss)

    out: dict[str, list[float]] = {
        k: [] for k in ("asr_paired", "asr_shuffled", "tts_paired", "tts_shuffled")
    }
    for i in range(len(records)):
        for name, speech in (("asr_paired", waves[i]), ("asr_shuffled", waves[other[i]])):
            out[name].append(
                loss(
                    [bos, AudioSegment(speech, predict=False), TextSegment([*texts[i], vocab.eos_id])], "text"
                )
            )
        for name, text in (("tts_paired", texts[i]), ("tts_shuffled", texts[other[i]])):
            prompt = TextSegment([vocab.bos_id, *text], predict=False)
            out[name].append(loss([prompt, AudioSegment(waves[i]), eos], "audio"))
    return out


def interval(differences: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(differences)
    half = 1.96 * statistics.stdev(differences) / math.sqrt(len(differences))
    return mean, half


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "real_pairing")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=600, help="unified-model training steps per seed")
    parser.add_argument("--codec-steps", type=int, default=450)
    parser.add_argument("--train", type=int, default=640, help="training clips")
    parser.add_argument("--heldout", type=int, default=96, help="held-out clips (unseen phrases)")
    args = parser.parse_args()
    out = args.out.resolve()
    train, heldout = build_corpus(out / "corpus", args.train, args.heldout)
    codec = train_codec(out, train, heldout, args.codec_steps)
    result: dict[str, object] = {"corpus": {"train": args.train, "heldout": args.heldout, "voices": VOICES}}
    gaps = {"asr": [], "tts": []}
    for seed in args.seeds:
        losses = pairing_losses(train_unified(out, train, heldout, codec, seed, args.steps), heldout)
        row = {}
        for task in ("asr", "tts"):
            paired, shuffled = losses[f"{task}_paired"], losses[f"{task}_shuffled"]
            gap, half = interval([s - p for p, s in zip(paired, shuffled, strict=True)])
            row[task] = {
                "paired": statistics.fmean(paired), "shuffled": statistics.fmean(shuffled),
                "gap": gap, "gap_ci95": half,
            }  # fmt: skip
            gaps[task].append(gap)
        result[f"seed{seed}"] = row
        print(f"seed {seed}: {json.dumps(row)}", file=sys.stderr, flush=True)
    for task, values in gaps.items():
        spread = statistics.stdev(values) if len(values) > 1 else float("nan")
        result[f"{task}_gap_mean"], result[f"{task}_gap_std_over_seeds"] = statistics.fmean(values), spread
    print(json.dumps(result))


if __name__ == "__main__":
    main()
