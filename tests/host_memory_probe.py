"""The probe of tests/test_host_memory.py and tests/test_parallel.py: how much of a freed tensor of tens of
MB leaves the resident set. Imports torch only, so that a fresh process runs it in seconds."""

from __future__ import annotations

from pathlib import Path

BLOCK_MB = 24  # a block of `small`'s size class: an FSDP2 all-gather of one transformer block is 27 MB


def resident_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def freed_block_leaves_resident_set() -> float:
    """MB the resident set shrinks by when a written BLOCK_MB tensor is freed, after a 30 MB tensor was
    freed first (which raises glibc's dynamic threshold above BLOCK_MB) and with a small tensor allocated
    after the block (so that the block is not at the top of the heap, where glibc would trim it)."""
    import torch

    raised = torch.ones(30 << 18)  # 30 MB of float32
    del raised
    block = torch.ones(BLOCK_MB << 18)
    later = torch.ones(1024)
    before = resident_mb()
    del block
    freed = before - resident_mb()
    del later
    return freed
