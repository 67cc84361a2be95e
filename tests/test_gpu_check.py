"""benchmarks/gpu_check.py as a specification: `--dry` runs every variant's code path (bf16 eager, compiled,
FlexAttention, FP8, the MoE-vs-dense layer) on the CPU at tiny sizes and prints one JSON line with a figure
for each; the CUDA path itself needs a GPU (docs/scale.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("bf16_sdpa_eager", "bf16_sdpa_compiled", "bf16_flex_compiled", "fp8_flex_compiled")


@pytest.mark.slow  # three compiled variants traced on the CPU: ~40 s idle, 90 s on a loaded machine
def test_the_gpu_check_dry_run_covers_every_variant_and_prints_one_json_line():
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/gpu_check.py"), "--dry"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["dry"] is True
    for variant in VARIANTS:
        assert result[f"tiny_{variant}_tokens_per_s"] > 0, variant
        assert result[f"tiny_{variant}_loss"] == pytest.approx(result["tiny_bf16_sdpa_eager_loss"], rel=0.02)
    assert result["tiny_bf16_flex_compiled_forward_only"] is True  # no FlexAttention backward on the CPU
    # FP8 experts have no CPU kernel (zoo/float8_experts.py): the dry run says so instead of a figure.
    assert "CUDA" in result["tiny_fp8_experts_flex_compiled_skipped"]
    assert result["tiny_moe_over_dense_time"] > 0

