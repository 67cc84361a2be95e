"""Pinned generations (issue 15): what seeded tiny models generate through every decode loop (text, MTP
speculation, NFSP images and video, NCP speech, captions after media, the RL engine with a sync mid-flight)
must not change when the decode path is rebuilt. Token ids are compared exactly, log-probs to 1e-5.
A deliberate change regenerates them with tests/golden/make_generations.py."""

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "golden"))
from make_generations import GENERATIONS, generations  # noqa: E402

EXPECTED = json.loads(GENERATIONS.read_text())


@pytest.fixture(scope="module")
def actual() -> dict:
    return generations()


def close(a: object, b: object) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, abs_tol=1e-5)
    return a == b


@pytest.mark.parametrize("group", sorted(EXPECTED))
def test_seeded_generations_equal_the_pinned_ones(actual, group):
    assert set(actual[group]) == set(EXPECTED[group])
    for name, expected in EXPECTED[group].items():
        if "logprobs" in name or "acceptance" in name:
            assert close(actual[group][name], expected), f"{group}/{name}"
        else:
            assert actual[group][name] == expected, f"{group}/{name}"
