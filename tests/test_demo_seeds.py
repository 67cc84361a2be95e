"""`benchmarks/demo_seeds.py`: the demo's headline is the mean of three runs' gallery metrics.json, each key
with its lowest and highest run, one run's intervals left out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "demo_seeds.py"


def run(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, paths)], capture_output=True, text=True)


def test_each_shared_key_is_averaged_with_its_range_and_intervals_are_left_out(tmp_path):
    runs = [
        {"text_to_image/exact": 0.125, "text_to_image/exact_ci95_low": 0.06, "image_to_text/exact": 0.5},
        {"text_to_image/exact": 0.25, "text_to_image/exact_ci95_low": 0.1, "image_to_text/exact": 0.75},
        {"text_to_image/exact": 0.1875, "text_to_image/exact_ci95_low": 0.1, "only/here": 1.0},
    ]
    paths = []
    for i, metrics in enumerate(runs):
        paths.append(tmp_path / f"metrics{i}.json")
        paths[-1].write_text(json.dumps(metrics))
    done = run(*paths)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["runs"] == 3 and result["files"] == [str(p) for p in paths]
    assert result["mean"] == {"text_to_image/exact": 0.1875}  # the one key every run has, not an interval
    assert (result["min"]["text_to_image/exact"], result["max"]["text_to_image/exact"]) == (0.125, 0.25)


def test_a_missing_or_broken_file_is_named(tmp_path):
    broken = tmp_path / "metrics.json"
    broken.write_text("{not json")
    for path in (broken, tmp_path / "absent.json"):
        done = run(path)
        assert done.returncode == 2 and str(path) in done.stderr
