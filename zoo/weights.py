"""Loading safetensors weights into a component (no code execution, strict key matching).

Used by components that accept a `weights` path at construction (a tokenizer trained in an earlier
stage, an encoder pretrained on its own). Kept free of model imports so that any module can use it; a saved
folder's shards are read by `zoo.publishing.shards`.
"""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_model, save_model
from torch import nn


def load_weights_file(module: nn.Module, path: str | Path, what: str = "weights") -> None:
    """Load `path` (a `.safetensors` file, or a folder holding `model.safetensors` or the shards of
    `model.safetensors.index.json`) into `module`, strictly.

    Raises FileNotFoundError naming the file when it is missing, ValueError when its tensors do not fit.
    """
    path = Path(path)
    if path.is_dir():
        from zoo.publishing.shards import load_weights  # a saved folder, in either layout

        try:
            return load_weights(module, path)
        except FileNotFoundError as err:
            expected = "model.safetensors or model.safetensors.index.json with its shards"
            raise FileNotFoundError(f"{what}: {err} (expected a folder with {expected})") from err
        except ValueError as err:
            raise ValueError(f"{what}: cannot load {path} into {type(module).__name__}: {err}") from err
    if not path.is_file():
        expected = "a .safetensors file or a folder with model.safetensors"
        raise FileNotFoundError(f"{what}: {path} does not exist (expected {expected})")
    try:
        load_model(module, str(path), strict=True)
    except (SafetensorError, RuntimeError, ValueError, OSError) as err:
        raise ValueError(f"{what}: cannot load {path} into {type(module).__name__}: {err}") from err


def save_weights_file(module: nn.Module, path: str | Path) -> Path:
    """Write `module`'s state dict as safetensors (tied tensors once), creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_model(module, str(path), metadata={"format": "pt"})
    return path
