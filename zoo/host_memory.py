"""Host (CPU) memory that a training process frees goes back to the operating system (issue 17, per-rank peak
memory under FSDP2; docs/scale.md, "Where a rank's memory goes").

glibc's malloc serves a block of at least its mmap threshold with its own `mmap`, which `free` unmaps at
once; smaller blocks come from the heap, whose freed pages mostly stay resident. The threshold starts at
128 KiB and is *dynamic*: each time an mmapped block is freed, the threshold rises to that block's size (up to
32 MiB). Training frees weight-sized tensors all the time, so within one step the threshold is at 32 MiB and
every later tensor below it (FSDP2's per-block all-gather outputs, unsharded gradients and reduce-scatter
buffers, tens of MB each on CPU) lands on the heap, where freed blocks of many sizes fragment it. Measured
on `small`, FSDP2 on two gloo ranks: 0.74 GB in use at the end of a step, 1.06 GB freed but still resident.

`return_large_blocks_to_os` fixes the threshold (which also turns the dynamic rise off): blocks of at least
that size are mapped and unmapped by themselves, so a freed gather buffer leaves the resident set at once.
The price is a page fault per page of each such block when it is first written (the kernel zeroes it), a
small cost next to gathering or computing into a block of that size. glibc only: elsewhere it reports that
nothing was set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt's parameter number for the mmap threshold (glibc's malloc.h); setting it disables the dynamic rise.
_M_MMAP_THRESHOLD = -3
# glibc refuses thresholds above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit systems).
MAX_MMAP_THRESHOLD_MB = 32


def return_large_blocks_to_os(threshold_mb: int) -> bool:
    """Serve every allocation of at least `threshold_mb` MiB with its own mapping from now on, returned to the
    OS when freed, in this process (each rank calls it for itself). True when glibc took the setting; False
    (and a log line saying why) on a C library without glibc's `mallopt`."""
    if not 0 < threshold_mb <= MAX_MMAP_THRESHOLD_MB:
        raise ValueError(
            f"threshold_mb={threshold_mb}: expected 1..{MAX_MMAP_THRESHOLD_MB} MiB (glibc's largest mmap "
            "threshold)"
        )
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    if mallopt is None:
        log.info("host memory: no glibc mallopt in %s; freed heap blocks stay with the process", name)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, threshold_mb << 20) != 1:
        log.info("host memory: mallopt refused an mmap threshold of %d MiB", threshold_mb)
        return False
    return True


__all__ = ["MAX_MMAP_THRESHOLD_MB", "return_large_blocks_to_os"]
