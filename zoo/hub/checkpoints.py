"""Lightning checkpoints of the zoo's tasks, read weights-only, to the model or the component they trained.

A `UnifiedPretraining` checkpoint holds the unified model under its `model` hyper-parameter (and the text
tokenizer under `TOKENIZER_KEY`); the component tasks hold theirs under theirs (`VisualTokenizerTraining`
`tokenizer`, `AudioTokenizerTask` `codec`, `VisionEncoderPretraining` `encoder`, `RefinerTraining`
`refiner`), each kept as the task's attribute of the same name, so its tensors sit under `<name>.` in the
state dict. Models are rebuilt through the allow-list with their construction-only arguments cleared (the
state dict brings the weights) and loaded with `strict=True`. A distributed (FSDP2) folder is read into the
rebuilt model in place (`distributed.py`), so loading or exporting it holds one copy of the weights.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zoo.hub.components import UNIFIED_COMPONENTS, is_component_folder
from zoo.hub.distributed import is_distributed_checkpoint, load_distributed_part, read_meta
from zoo.models.unified import UnifiedModel
from zoo.publishing.building import build_from_config, resolve_class, without_construction_only
from zoo.publishing.component import PretrainedComponent
from zoo.tokenizers.text import TextTokenizer

TOKENIZER_KEY = "zoo_tokenizer"  # where a checkpoint keeps its text tokenizer, whatever the datamodule


def _read_checkpoint(path: Path) -> dict:
    """A Lightning checkpoint as one dict: a file, or a distributed (DCP) folder, one shard per rank plus
    Lightning's `meta.pt`, consolidated into full tensors on this process (every tensor, optimizer states
    included: the models and components below read a folder in place instead)."""
    if not is_distributed_checkpoint(path):
        # Memory-mapped: a tensor is read when used (a deferred model's init_from reads each at its replay).
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint = read_meta(path)
    with tempfile.TemporaryDirectory() as tmp:
        merged = Path(tmp) / "consolidated.pt"
        dcp_to_torch_save(path, merged)  # torch's converter: Lightning's own fails on these folders
        checkpoint["state_dict"] = torch.load(merged, map_location="cpu", weights_only=True)["state_dict"]
    return checkpoint


def read_lightning_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint as a dict with a `state_dict`, read with `weights_only=True` (nothing unpickled)."""
    path = Path(path)
    checkpoint = _guarded(_read_checkpoint, path)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ValueError(f"{path} is not a Lightning checkpoint (no 'state_dict')")
    return checkpoint


def open_checkpoint(path: Path) -> dict[str, Any]:
    """What `build_task_part` reads: a checkpoint file whole; of a distributed folder only `meta.pt` (the
    hyper-parameters), its tensors being read later into the rebuilt module, in place."""
    if not is_distributed_checkpoint(path):
        return read_lightning_checkpoint(path)
    checkpoint = _guarded(read_meta, path)
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{path / 'meta.pt'} is not a Lightning checkpoint's metadata (not a dict)")
    return checkpoint


def _guarded(read: Any, path: Path) -> Any:
    """`read(path)`, its failures as a ValueError naming the checkpoint."""
    try:
        return read(path)
    except ValueError:
        raise
    except Exception as err:
        raise ValueError(f"cannot read checkpoint {path} (truncated, or not weights-only): {err}") from err


def checkpoint_tokenizer_json(checkpoint: Mapping[str, Any]) -> str | None:
    """The text tokenizer (JSON) a checkpoint was trained with: under `TOKENIZER_KEY`, where the zoo's tasks
    store it, or (older checkpoints) in the datamodule state Lightning keeps under the datamodule's class
    name, which another datamodule class would not find."""
    if isinstance(checkpoint.get(TOKENIZER_KEY), str):
        return checkpoint[TOKENIZER_KEY]
    for value in checkpoint.values():
        if isinstance(value, Mapping) and isinstance(value.get("tokenizer"), str):
            return value["tokenizer"]
    return None


def hyper_parameters(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    return dict(checkpoint.get("hyper_parameters") or {})


def build_task_part(checkpoint: Mapping[str, Any], key: str, path: Path) -> nn.Module:
    """The module the task's `key` hyper-parameter describes, with the checkpoint's `<key>.` tensors loaded
    strictly (from a distributed folder: straight into the module's tensors)."""
    spec = hyper_parameters(checkpoint).get(key)
    where = f"{path}:hyper_parameters.{key}"
    module = build_from_config(without_construction_only(spec, where), where=where)
    prefix = f"{key}."
    if is_distributed_checkpoint(path):
        load_distributed_part(module, path, prefix)
        return module.eval()
    state = {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(f"{path}: weights do not fit the {key} its hyper-parameters name: {err}") from err
    return module.eval()


def load_lightning_checkpoint(path: str | Path) -> tuple[UnifiedModel, TextTokenizer | None]:
    """The unified model of a `UnifiedPretraining` checkpoint (a file, or an FSDP2 distributed folder), and
    the tokenizer the datamodule stored in it.

    Read with `weights_only=True` (nothing unpickled); the model is rebuilt from the task's `model`
    hyper-parameter through the same allow-list as hub configs, and its weights load with `strict=True`
    (a distributed folder's straight into the model: one copy of the weights in memory, never two).
    """
    path = Path(path)
    checkpoint = open_checkpoint(path)
    spec = hyper_parameters(checkpoint).get("model")
    if not isinstance(spec, Mapping) or "class_path" not in spec:
        raise ValueError(f"{path}: the task's hyper-parameters hold no model {{class_path, init_args}}")
    if not issubclass(resolve_class(spec["class_path"], f"{path}:hyper_parameters.model"), UnifiedModel):
        raise ValueError(f"{path}: the task's model is a {spec['class_path']}, not a UnifiedModel")
    model = build_task_part(checkpoint, "model", path)
    text = checkpoint_tokenizer_json(checkpoint)
    tokenizer = TextTokenizer.from_json(text, source=f"{path} (checkpoint)") if text is not None else None
    return model, tokenizer  # type: ignore[return-value]


def component_keys(checkpoint: Mapping[str, Any], path: Path) -> list[str]:
    """The hyper-parameters that describe a publishable component (a `PretrainedComponent` class)."""
    keys = []
    for key, spec in hyper_parameters(checkpoint).items():
        if isinstance(spec, Mapping) and "class_path" in spec:
            cls = resolve_class(spec["class_path"], f"{path}:hyper_parameters.{key}")
            if issubclass(cls, PretrainedComponent):
                keys.append(key)
    return keys


def load_checkpoint_component(path: str | Path, key: str | None = None) -> PretrainedComponent:
    """The component a component task's checkpoint trained (the visual tokenizer, audio codec, vision encoder
    or refiner), from its hyper-parameter `key` (found when the task has one component)."""
    path = Path(path)
    checkpoint = open_checkpoint(path)
    keys = component_keys(checkpoint, path)
    if key is None:
        if len(keys) != 1:
            found = f"several ({keys}): name one" if keys else "none"
            raise ValueError(f"{path}: looked for the task's publishable component and found {found}")
        key = keys[0]
    elif key not in keys:
        raise ValueError(f"{path}: hyper-parameter {key!r} is not a publishable component (those are {keys})")
    return build_task_part(checkpoint, key, path)  # type: ignore[return-value]


def holds_unified_model(path: str | Path) -> bool:
    """Whether a checkpoint's `model` hyper-parameter is a unified model (hyper-parameters read only)."""
    path = Path(path)
    spec = hyper_parameters(_read_hparams_only(path)).get("model")
    if not isinstance(spec, Mapping) or "class_path" not in spec:
        return False
    return issubclass(resolve_class(spec["class_path"], f"{path}:hyper_parameters.model"), UnifiedModel)


def _read_hparams_only(path: Path) -> dict[str, Any]:
    try:
        if is_distributed_checkpoint(path):
            return read_meta(path) if (path / "meta.pt").is_file() else {}
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        raise ValueError(f"cannot read checkpoint {path} (truncated, or not weights-only): {err}") from err


def components_named_by_weights(path: str | Path) -> dict[str, Path]:
    """The component folders a unified checkpoint's model was built from: each component whose `weights`
    argument is a component folder, or a `.safetensors` file with one beside it of the same stem (the
    component tasks write both: `visual_tokenizer.safetensors` and `visual_tokenizer/`)."""
    path = Path(path)
    spec = hyper_parameters(_read_hparams_only(path)).get("model")
    init_args = spec.get("init_args") if isinstance(spec, Mapping) else None
    found: dict[str, Path] = {}
    for name in UNIFIED_COMPONENTS:
        part = (init_args or {}).get(name)
        weights = (part.get("init_args") or {}).get("weights") if isinstance(part, Mapping) else None
        if not isinstance(weights, str):
            continue
        weights_path = Path(weights)
        for folder in (weights_path, weights_path.with_suffix("")):
            if is_component_folder(folder):
                found[name] = folder
                break
    return found
