"""zoo.host_memory as a specification: with glibc's default (dynamic) mmap threshold, a freed tensor of tens
of MB stays in the resident set once a larger one has been freed before it (as in every training step);
after `return_large_blocks_to_os` it leaves at once. Each is measured in a fresh process of its own (the
setting is per process and cannot be undone, and a first probe's freed block would serve the second's).
`FSDP2Strategy` applying it in its ranks is checked by tests/test_parallel.py's two-process run
(`freed_block_leaves_rank`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from host_memory_probe import BLOCK_MB

from zoo.host_memory import return_large_blocks_to_os

REPO = Path(__file__).resolve().parent.parent


def freed_in_a_fresh_process(large_blocks_to_os: bool) -> float:
    """`freed_block_leaves_resident_set` in a fresh process that imports torch and zoo/host_memory.py alone
    (not the zoo package: its imports take most of a minute on a loaded machine), under glibc's defaults or
    after `return_large_blocks_to_os(4)`. One process a setting: after a probe under the defaults the freed
    block sits in the heap's free lists, and a second probe's block could be served from it whatever the
    threshold, so the two must not share a heap."""
    code = (
        "import importlib.util, json, sys; sys.path.insert(0, 'tests');"
        "from host_memory_probe import freed_block_leaves_resident_set as probe;"
        "spec = importlib.util.spec_from_file_location('host_memory', 'zoo/host_memory.py');"
        "host_memory = importlib.util.module_from_spec(spec); spec.loader.exec_module(host_memory);"
        f"applied = host_memory.return_large_blocks_to_os(4) if {large_blocks_to_os} else True;"
        "print(json.dumps([applied, probe()]))"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("GLIBC_TUNABLES", None)  # glibc's defaults, whatever the calling shell set
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    applied, freed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert applied, "glibc refused the mmap threshold"
    return freed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and /proc/self/status")
def test_a_freed_block_stays_resident_by_default_and_leaves_once_large_blocks_go_back_to_the_os():
    assert freed_in_a_fresh_process(False) < BLOCK_MB / 4, "glibc's default should keep the freed block"
    assert freed_in_a_fresh_process(True) > BLOCK_MB * 0.9


def test_a_threshold_glibc_cannot_take_is_refused_with_the_range():
    with pytest.raises(ValueError, match=r"threshold_mb=64: expected 1\.\.32 MiB"):
        return_large_blocks_to_os(64)
    with pytest.raises(ValueError, match="threshold_mb=0"):
        return_large_blocks_to_os(0)
