"""Lightning's distributed checkpoints (FSDP2: a folder of DCP files, one per rank, their `.metadata`, and
`meta.pt` with everything but the tensors) read into a model in place, never consolidated in memory.

torch's `format_utils.dcp_to_torch_save` loads every tensor of the folder at once, the weights and AdamW's two
moments (three copies of the model), and the model built from that dict is a fourth. Here the module is built
first (the one copy), then DCP reads the checkpoint's `state_dict.<prefix>` entries straight into its tensors,
one stored chunk at a time; the optimizer states are never read. Names and shapes are checked against the
DCP metadata before anything is read, so a checkpoint that does not fit names itself and the tensors.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zoo.publishing.shards import tied_names

META_NAME = "meta.pt"  # Lightning's name for the non-tensor part of the checkpoint
STATE_KEY = "state_dict"  # the task's state dict, as Lightning's ModelParallelStrategy saves it


def is_distributed_checkpoint(path: Path) -> bool:
    return path.is_dir()


def read_meta(path: Path) -> dict[str, Any]:
    """The checkpoint without its tensors (`meta.pt`: hyper-parameters, loop state, the tokenizer)."""
    meta = path / META_NAME
    if not meta.is_file():
        raise ValueError(f"{path} is a folder but not a Lightning distributed checkpoint (no {META_NAME})")
    return torch.load(meta, map_location="cpu", weights_only=True)


def saved_shapes(path: Path, prefix: str) -> dict[str, torch.Size]:
    """The shape of every tensor the checkpoint stores under `state_dict.<prefix>`, by its name in the module
    (`prefix` stripped), read from the DCP metadata alone."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        entries = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as err:  # a missing or truncated .metadata: DCP's own errors vary by cause
        message = f"cannot read the DCP metadata of {path} (missing or truncated .metadata?): {err}"
        raise ValueError(message) from err
    start = f"{STATE_KEY}.{prefix}"
    return {
        key[len(start):]: entry.size
        for key, entry in entries.items()
        if key.startswith(start) and isinstance(entry, TensorStorageMetadata)
    }


def load_distributed_part(module: nn.Module, path: Path, prefix: str) -> None:
    """Load the tensors a distributed checkpoint holds under `state_dict.<prefix>` into `module`'s own
    tensors, strictly: every tensor of the module (a tied name counts when its partner is stored), nothing
    else, same shapes. Dtypes follow the module (bf16 into fp32 is cast, as `load_state_dict` does)."""
    import torch.distributed.checkpoint as dcp

    state = module.state_dict()
    not_tensors = sorted(k for k, v in state.items() if not isinstance(v, torch.Tensor))
    if not_tensors:
        raise ValueError(f"{type(module).__name__}: cannot read non-tensor state {not_tensors[:4]} of {path}")
    saved = saved_shapes(path, prefix)
    ties = tied_names(module)
    missing = sorted(k for k in state if k not in saved and not ties.get(k, set()) & set(saved))
    unexpected = sorted(set(saved) - set(state))
    wrong = sorted(k for k in set(saved) & set(state) if saved[k] != state[k].shape)
    if missing or unexpected or wrong:
        shapes = [f"{k}: stored {tuple(saved[k])}, model {tuple(state[k].shape)}" for k in wrong[:4]]
        raise ValueError(
            f"{path}: the stored {prefix.rstrip('.')} does not fit the one its hyper-parameters build: "
            f"missing {missing[:8]}, unexpected {unexpected[:8]}, size mismatch {shapes}"
        )
    targets = {f"{prefix}{k}": v for k, v in state.items() if k in saved}
    with warnings.catch_warnings():  # one process reading a checkpoint N processes wrote is the intent
        warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled, unavailable or uninit")
        try:
            dcp.load({STATE_KEY: targets}, checkpoint_id=str(path))
        except Exception as err:  # DCP wraps a truncated or missing shard file in its own exception
            message = f"cannot read the tensors of {path} (a shard file missing or truncated?): {err}"
            raise ValueError(message) from err
