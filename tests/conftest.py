"""Test-suite setup: the checkout on the path, and `make test`'s two workers (pytest-xdist).

`make test` runs the suite on two workers (`-n 2 --dist loadgroup`), one torch thread each, so the two cores
run two tests at once instead of one test on two threads (the suite's models are too small to gain from a
second thread). Every test file is one group, so a module's fixtures run once, on one worker; the files
that start processes of their own (2-process gloo groups, Ray clusters, servers) share one group, so they
never run beside each other and oversubscribe the cores or race for ports.

A plain `pytest tests/some_file.py` (no workers) runs one torch thread too: the tests that train a few steps
and assert that learning happened were sized at one thread, and two threads sum in another order.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

# Files whose tests start processes (torch.distributed ranks, Ray actors, servers, the CLI in a subprocess).
PROCESS_FILES = frozenset({
    "test_checkpoint_kills.py",
    "test_expert_parallel.py",
    "test_expert_parallel_training.py",
    "test_export_memory.py",
    "test_gpu_check.py",
    "test_lm_eval.py",
    "test_meta_init.py",
    "test_parallel.py",
    "test_parallel_multimodal.py",
    "test_resume_fsdp.py",
    "test_rl_ray.py",
    "test_serve.py",
    "test_stage_sharding.py",
    "test_streaming_ranks.py",
})


def pytest_configure(config: pytest.Config) -> None:
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        name = item.path.name
        item.add_marker(pytest.mark.xdist_group("processes" if name in PROCESS_FILES else name))
