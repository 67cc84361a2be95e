"""A folder's weights: one `model.safetensors`, or, past `max_shard_size`, shards with an index, as the Hub
and transformers lay them out (`model-00001-of-00003.safetensors` ..., `model.safetensors.index.json`).

Saving is huggingface_hub's `save_torch_state_dict` (it splits by size, writes the index, drops the duplicate
names of tied tensors and removes the weight files of an earlier save from the folder). Loading is ours, for
two reasons: huggingface_hub's `load_torch_model(strict=True)` counts a tied tensor's dropped name as missing,
and it only warns when a shard holds tensors its index does not list. Here every shard is read on its own
(peak memory: the module plus one shard), each file must hold exactly the tensors the index assigns to it,
and the module's tensors must all arrive once (a tied name counts when its partner arrived) and nothing else.
Errors name the file and the tensors. Nothing is unpickled.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from zoo.publishing.layout import WEIGHTS_INDEX_NAME, WEIGHTS_NAME

# huggingface_hub's file name pattern: {suffix} is "" for one file, "-00001-of-00003" for a shard.
WEIGHTS_PATTERN = "model{suffix}.safetensors"
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# The Hub's and transformers' default: files of at most 5 GB upload and download in one piece.
MAX_SHARD_SIZE = "5GB"
MAX_INDEX_BYTES = 64 * 2**20  # an index is a name -> file map: anything larger is not one


def save_weights(
    state: Mapping[str, torch.Tensor],
    directory: str | Path,
    *,
    max_shard_size: int | str = MAX_SHARD_SIZE,
    metadata: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write `state` into `directory` as `model.safetensors`, or as shards of at most `max_shard_size` (bytes,
    or a string such as "5GB" or "200MB") and their index; returns the files written. Tied tensors are stored
    once; the weight files of an earlier save in the folder are removed first, so the two layouts never mix.
    A single tensor larger than `max_shard_size` gets a shard of its own (tensors are never split)."""
    from huggingface_hub import save_torch_state_dict

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().cpu() for name, tensor in state.items()}
    save_torch_state_dict(
        state, directory, filename_pattern=WEIGHTS_PATTERN, max_shard_size=max_shard_size,
        metadata=dict(metadata or {}),  # it adds the dropped tied names to the dict it is given
    )
    return weight_files(directory)


def weight_files(directory: str | Path) -> list[Path]:
    """The weight files of a saved folder: `model.safetensors`, or the shards its index names, in order.
    A folder with both, an index naming files that are missing or not shards, or neither file is refused."""
    directory = Path(directory)
    single, index = directory / WEIGHTS_NAME, directory / WEIGHTS_INDEX_NAME
    if single.exists() and index.exists():
        raise ValueError(
            f"{directory} holds both {WEIGHTS_NAME} and {WEIGHTS_INDEX_NAME}: expected one layout (a save "
            "replaces the other; a copy mixed two saves)"
        )
    if index.exists():
        return sorted({directory / name for name in read_index(index).values()})
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{single} is missing (and there is no {WEIGHTS_INDEX_NAME} of shards beside it)")


def read_index(index: Path) -> dict[str, str]:
    """The index's `weight_map` (tensor name -> shard file), checked: shard names only (no paths), present."""
    if index.stat().st_size > MAX_INDEX_BYTES:
        raise ValueError(f"{index} is {index.stat().st_size:,} bytes: not a weights index")
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise ValueError(f"{index} is not a weights index (a JSON object with a weight_map): {err}") from err
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: expected a 'weight_map' object of tensor name -> shard file name")
    for name in sorted(set(weight_map.values())):
        if not SHARD_NAME.fullmatch(name):
            raise ValueError(f"{index} names {name!r}: expected shard files model-NNNNN-of-NNNNN.safetensors")
        if not (index.parent / name).is_file():
            raise FileNotFoundError(f"{index} names {name}, which is missing from {index.parent}")
    return weight_map


def load_weights(
    module: nn.Module,
    location: str | Path,
    device: str | torch.device = "cpu",
    skip_prefixes: tuple[str, ...] = (),
) -> None:
    """Load a folder's weights into `module`, strictly, one file at a time, then move it to `device`.

    `location` is the folder, its `model.safetensors` path (the shards are found from the index beside it when
    the folder is sharded), or any single `.safetensors` file. Every tensor of `module` but those under
    `skip_prefixes` (parts loaded from elsewhere) must be in the files, and nothing else; a tensor under
    `skip_prefixes` in the files is refused too. A size mismatch, a tampered or truncated file raise a
    ValueError naming the file."""
    location = Path(location)
    folder = location if location.is_dir() else location.parent if location.name == WEIGHTS_NAME else None
    if folder is None and not location.is_file():
        raise FileNotFoundError(f"{location} is missing")
    files = weight_files(folder) if folder is not None else [location]
    sharded = folder is not None and (folder / WEIGHTS_INDEX_NAME).exists()
    where = folder / WEIGHTS_INDEX_NAME if sharded else files[0]
    index = read_index(where) if sharded else None
    model_keys = set(module.state_dict())
    expected = {k for k in model_keys if not k.startswith(skip_prefixes)}
    loaded: set[str] = set()
    for path in files:
        part = _read_file(path)
        _check_part(path, set(part), index, loaded, model_keys, skip_prefixes)
        try:
            module.load_state_dict(part, strict=False)
        except RuntimeError as err:
            raise ValueError(f"cannot load weights from {path} (another model's?): {err}") from err
        loaded |= set(part)
        del part  # one shard in memory at a time
    ties = tied_names(module)
    missing = sorted(k for k in expected - loaded if not ties.get(k, set()) & loaded)
    if missing:
        raise ValueError(
            f"cannot load weights from {where}: Missing key(s) in state_dict: {missing[:8]}"
            + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        )
    if torch.device(device) != torch.device("cpu"):  # the files were read to the CPU; a deferred build
        module.to(device)  # (zoo.meta_init) stays on meta until it is materialised


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        message = f"cannot load weights from {path} (tampered, truncated or another model's): {err}"
        raise ValueError(message) from err


def _check_part(
    path: Path,
    names: set[str],
    index: Mapping[str, str] | None,
    loaded: set[str],
    model_keys: set[str],
    skip_prefixes: tuple[str, ...],
) -> None:
    """Refuse a file whose tensors are not the ones it should hold (before any is copied into the module).
    Each shard holding exactly what the index assigns it also means every tensor the index lists arrives."""
    if index is not None:
        assigned = {k for k, file in index.items() if file == path.name}
        if names != assigned:
            odd = sorted(names ^ assigned)[:8]
            raise ValueError(f"{path} does not hold the tensors its index assigns to it (differ: {odd})")
    again = sorted(names & loaded)
    if again:
        raise ValueError(f"{path} holds tensors an earlier shard already gave: {again[:8]}")
    carried = sorted(k for k in names if k.startswith(skip_prefixes) and skip_prefixes)
    if carried:
        raise ValueError(
            f"{path} carries tensors of the components its config names ({carried[:4]}): a folder "
            "either names a component or stores it, not both"
        )
    unexpected = sorted(names - model_keys)
    if unexpected:
        raise ValueError(f"cannot load weights from {path}: Unexpected key(s) in state_dict: {unexpected[:8]}"
                         + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""))


def tied_names(module: nn.Module) -> dict[str, set[str]]:
    """Each state-dict name of a tensor that has several (tied embeddings) -> its other names."""
    by_tensor: dict[int, set[str]] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(value), set()).add(name)
    return {name: names - {name} for names in by_tensor.values() if len(names) > 1 for name in names}
