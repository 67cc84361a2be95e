"""Small real verifiers for tests/test_rl_verifiers.py: module-level, so worker processes can import them."""

import math
import os
import time


def correct(query, output):
    return 1.0


def echo_length(query, output):
    return float(len(output))


def raises(query, output):
    raise RuntimeError(f"cannot verify {output!r}")


def hangs(query, output):
    time.sleep(600)
    return 1.0


def returns_text(query, output):
    return "yes"


def returns_nan(query, output):
    return math.nan


def returns_none(query, output):
    return None


def dies(query, output):
    os._exit(3)
