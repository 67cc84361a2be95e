"""What identifies a frozen tokenizer: a hash of its configuration and every tensor of its state.

Pre-tokenized code shards (`zoo tokenize`) are only valid for the tokenizer that wrote them: codes of
another codebook look just as plausible and train a model on nonsense. So every code record carries the
fingerprint of the tokenizer that made it, and a datamodule refuses records whose fingerprint differs from
the model's own tokenizer (`zoo.datamodules.code_shards.CodeShardSource`).

The hash covers the constructor configuration (`zoo.config.to_config`; the `weights` path is recorded as
None, so where the weights were read from does not matter) and every entry of the state dict (parameters
and buffers: codebooks, EMA statistics, k-means flags), by name, dtype, shape and bytes.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import Tensor, nn

from zoo.config import to_config

HASH_CHARS = 16  # 64 bits of sha256: collisions between two tokenizers of one project are out of reach


def _full(tensor: Tensor) -> Tensor:
    """A DTensor (a tokenizer inside an FSDP2-sharded model) as its full value; others as they are."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


def _tensor_bytes(tensor: Tensor) -> bytes:
    flat = _full(tensor).detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def tokenizer_config(module: nn.Module) -> dict[str, Any]:
    """The `{"class_path", "init_args"}` that rebuilds `module` (a Configurable zoo component)."""
    return to_config(module)


def tokenizer_hash(module: nn.Module) -> str:
    """A hex fingerprint of `module`'s configuration and state (see the module docstring)."""
    digest = hashlib.sha256()
    digest.update(json.dumps(tokenizer_config(module), sort_keys=True).encode())
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(f"\x00{name}\x00{tensor.dtype}\x00{tuple(tensor.shape)}\x00".encode())
        digest.update(_tensor_bytes(tensor))
    return digest.hexdigest()[:HASH_CHARS]
