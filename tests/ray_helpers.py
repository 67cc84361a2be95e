"""Module-level functions the Ray verifier actors run in tests/test_rl_ray.py (they travel by name, so
they live in a module the actors can import: the Ray fixture puts tests/ on their PYTHONPATH)."""

import time
from pathlib import Path


def sleep_then_log(path: str, key: str, seconds: float) -> float:
    """Sleep, then append `key` to the file at `path` and return 1.0: a call killed while it sleeps
    leaves no line, so the file lists the calls that ran to the end, each as often as it did."""
    time.sleep(seconds)
    with Path(path).open("a") as f:
        f.write(key + "\n")
    return 1.0


def hang(seconds: float) -> float:
    time.sleep(seconds)
    return 1.0
