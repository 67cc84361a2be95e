"""The tokenizers' quantisation and token interface run in float32 whatever autocast is on.

Under `precision: bf16-mixed` Lightning runs every training and validation step in autocast, and a frozen
tokenizer inside the unified model runs in that step. A code is a nearest-neighbour choice: bf16 features pick
other codes than the tokenizer was trained to give, and the multi-scale quantizer's phi mixes a bf16
convolution with float32 features in `lerp`, which torch refuses. So the methods that quantise, or that turn
codes back into features and pixels, switch autocast off and take their floating inputs as float32 (VQ in
float32 is also what VAR and vector-quantize-pytorch do). A tokenizer's encoder and decoder, trained on their
own, still run in the precision the trainer sets.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

Method = TypeVar("Method", bound=Callable[..., Any])


def _as_float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    return value


def full_precision(method: Method) -> Method:
    """Decorate a tokenizer method: autocast off on CPU and CUDA, floating tensor arguments as float32."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            args = tuple(_as_float32(a) for a in args)
            kwargs = {k: _as_float32(v) for k, v in kwargs.items()}
            return method(*args, **kwargs)

    return run  # type: ignore[return-value]
