"""The demo's verifier scores over seeds: the mean, lowest and highest of every key the galleries'
`metrics.json` files share (issue 19: one run's 64 scenes move by several hundredths from seed to seed, so
the headline is the mean of three runs, with their range beside it).

    make demo                                  # seed 0: runs/demo/multimodal/latest/gallery/metrics.json
    for S in 1 2; do                           # the same stage 4 on stages 1-3's weights, seeds 1 and 2
        .venv/bin/zoo fit --config configs/demo/multimodal.yaml --seed_everything $S \
            --data.init_args.seed $S --trainer.default_root_dir runs/demo/seed$S
    done
    .venv/bin/python benchmarks/demo_seeds.py runs/demo/multimodal/latest/gallery/metrics.json \
        runs/demo/seed1/latest/gallery/metrics.json runs/demo/seed2/latest/gallery/metrics.json

Intervals (`*_ci95_*` keys) are one run's and are left out. The result is the last stdout line, one JSON
object: `runs`, then `mean`, `min` and `max`, each keyed as metrics.json is (`image_to_text/exact`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def aggregate(runs: list[dict[str, float]]) -> dict[str, object]:
    """Mean, min and max over `runs` of each numeric key all of them have, intervals left out."""
    if not runs:
        raise ValueError("aggregate needs at least one metrics.json")
    shared = set.intersection(*(set(run) for run in runs))
    keys = sorted(k for k in shared if "_ci95_" not in k and all(isinstance(r[k], int | float) for r in runs))
    values = {k: [float(run[k]) for run in runs] for k in keys}
    return {
        "runs": len(runs),
        "mean": {k: round(sum(v) / len(v), 4) for k, v in values.items()},
        "min": {k: round(min(v), 4) for k, v in values.items()},
        "max": {k: round(max(v), 4) for k, v in values.items()},
    }


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("metrics", nargs="+", help="gallery metrics.json files, one per run")
    args = parser.parse_args()
    runs = []
    for path in args.metrics:
        try:
            runs.append(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as error:
            parser.error(f"{path}: {error}")
    # Printed here rather than by _common.emit, which would import torch to add up a few JSON files.
    print(json.dumps({"files": args.metrics, **aggregate(runs)}), flush=True)


if __name__ == "__main__":
    main()
