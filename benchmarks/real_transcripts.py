"""Does the model trained on real speech transcribe unseen phrases? Through `zoo.pipeline`, as a user would.

After `benchmarks/real_pairing.py` (its espeak-ng corpus and one unified model per seed under `--out`), each
seed's last checkpoint is opened with `zoo.pipeline` and transcribes every held-out clip greedily
(`pipe(audio=path, temperature=0)`): phrases of four words (colour, animal, verb, number) whose combination
was never heard in training. Scored per word in place, and whole phrases exactly, beside a baseline that
knows the training transcripts: the most frequent training word in each of the four places.

    .venv/bin/python benchmarks/real_transcripts.py --out runs/real_pairing

Progress on stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, log, machine_info  # noqa: E402


def read_manifest(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def word_accuracy(reference: str, hypothesis: str) -> float:
    """The share of the reference's words that the hypothesis has in the same place."""
    ref, hyp = reference.split(), hypothesis.split()
    return sum(a == b for a, b in zip(ref, hyp, strict=False)) / len(ref)


def majority_phrase(train: list[dict]) -> str:
    """The most frequent training word in each place (what a model that ignores the speech could say)."""
    places = list(zip(*(row["text"].split() for row in train), strict=False))
    return " ".join(Counter(words).most_common(1)[0][0] for words in places)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/real_pairing", help="the folder real_pairing.py wrote")
    parser.add_argument("--clips", type=int, default=None, help="the first N held-out clips (default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()

    import torch

    import zoo

    torch.manual_seed(0)
    out = Path(args.out)
    corpus = out / "corpus"
    heldout = read_manifest(corpus / "heldout.jsonl")[: args.clips]
    baseline = majority_phrase(read_manifest(corpus / "train.jsonl"))
    result: dict[str, object] = {
        "benchmark": "real_transcripts",
        "clips": len(heldout),
        "baseline_phrase": baseline,
        "baseline_word_accuracy": statistics.mean(word_accuracy(r["text"], baseline) for r in heldout),
        "baseline_exact": statistics.mean(float(r["text"] == baseline) for r in heldout),
    }
    seeds = sorted(out.glob("unified_seed*/latest/checkpoints/last.ckpt"))
    if not seeds:
        raise SystemExit(f"no unified_seed*/latest/checkpoints/last.ckpt under {out}: run real_pairing.py")
    words, exact = [], []
    for checkpoint in seeds:
        name = checkpoint.parts[-4]
        pipe = zoo.pipeline(checkpoint)
        scores, hits, examples = [], 0, []
        for i, row in enumerate(heldout):
            heard = pipe(audio=corpus / row["audio"], temperature=0, max_new_tokens=args.max_new_tokens)
            heard = heard.strip()
            scores.append(word_accuracy(row["text"], heard))
            hits += heard == row["text"]
            if i < 5:
                examples.append([row["text"], heard])
            log(f"{name} {i + 1}/{len(heldout)}: {row['text']!r} -> {heard!r}")
        words.append(statistics.mean(scores))
        exact.append(hits / len(heldout))
        result[f"{name}_word_accuracy"] = round(words[-1], 4)
        result[f"{name}_exact"] = round(exact[-1], 4)
        result[f"{name}_examples"] = examples
    result["word_accuracy_mean"] = round(statistics.mean(words), 4)
    result["word_accuracy_std"] = round(statistics.stdev(words), 4) if len(words) > 1 else 0.0
    result["exact_mean"] = round(statistics.mean(exact), 4)
    result["machine"] = machine_info(torch.get_num_threads())
    emit(result)


if __name__ == "__main__":
    main()
