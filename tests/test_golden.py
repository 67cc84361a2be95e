"""Golden outputs (torchvision-style): a seeded tiny model's hidden states, logits, losses and routing on
a fixed packed batch must not drift. A deliberate change regenerates them with tests/golden/make_golden.py."""

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent / "golden"))
from make_golden import GOLDEN, golden_outputs  # noqa: E402


def test_tiny_model_outputs_match_the_stored_golden_tensors():
    expected = load_file(str(GOLDEN))
    actual = golden_outputs()
    assert set(actual) == set(expected)
    for name, value in expected.items():
        if value.dtype.is_floating_point:
            assert torch.allclose(actual[name], value, atol=2e-5, rtol=1e-4), name
        else:
            assert torch.equal(actual[name], value), name
