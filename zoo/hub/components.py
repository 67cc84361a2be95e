"""The component folders a unified model's folder names instead of carrying their weights.

A unified model is built with a frozen visual tokenizer, audio codec or vision encoder trained in an earlier
stage (configs/demo/multimodal.yaml points each one's `weights` at that stage's output). Its folder can name
those components (`config.json` "components": a path relative to the folder, or a hub id, `user/name@rev`
for a revision) instead of copying their tensors into `model.safetensors`; loading it pulls each one. Saving
checks that each named folder holds exactly the model's component (configuration and every tensor), and
loading checks the same, so a folder never loads with another component than the one it was saved with.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from zoo.config import to_config
from zoo.publishing.component import PretrainedComponent, load_component
from zoo.publishing.layout import COMPONENT_FORMAT, CONFIG_NAME, read_config
from zoo.publishing.transfer import resolve, split_revision

# The unified model's constructor argument -> where the component lives in its module tree.
UNIFIED_COMPONENTS = {
    "visual_tokenizer": "nfsp.tokenizer",
    "audio_codec": "ncp.codec",
    "vision_encoder": "vision_encoder",
}


def component_module(model: nn.Module, name: str) -> nn.Module:
    """The model's submodule for component `name` (ValueError for an unknown name or an absent part)."""
    if name not in UNIFIED_COMPONENTS:
        known = sorted(UNIFIED_COMPONENTS)
        raise ValueError(f"unknown component {name!r}; a unified model's components are {known}")
    try:
        return model.get_submodule(UNIFIED_COMPONENTS[name])
    except AttributeError as err:
        raise ValueError(f"component {name!r}: this model was built without one") from err


def component_prefixes(names: Mapping[str, str] | list[str]) -> tuple[str, ...]:
    return tuple(UNIFIED_COMPONENTS[name] + "." for name in names)


def is_component_folder(path: Path) -> bool:
    """Whether `path` is a folder a component's `save_pretrained` wrote (its config says so)."""
    try:
        read_config(path, (COMPONENT_FORMAT,))
    except (FileNotFoundError, ValueError, OSError):
        return False
    return True


def looks_like_path(ref: str) -> bool:
    """A reference written as a path (`./x`, `../x`, `/x`, `x/y/z`) is never tried as a hub id."""
    return ref.startswith((".", "/", "~")) or ref.count("/") > 1 or os.sep != "/" and os.sep in ref


def component_folder(
    name: str, ref: str, base: Path, *, token: str | None = None, endpoint: str | None = None,
    cache_dir: str | Path | None = None, local_files_only: bool = False,
) -> Path:
    """The local folder a reference names: a path relative to `base` (the unified folder) or absolute, else a
    hub id downloaded. Errors name the component and where it was looked for."""
    local = Path(ref).expanduser()
    local = local if local.is_absolute() else base / local
    if local.is_dir():
        return local
    if looks_like_path(ref):
        raise FileNotFoundError(
            f"{base / CONFIG_NAME}: component {name!r} names the folder {ref!r}, which does not exist "
            f"(looked in {local.resolve()})"
        )
    repo_id, revision = split_revision(ref)
    try:
        return resolve(repo_id, revision, cache_dir, token, local_files_only, endpoint)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{base / CONFIG_NAME}: component {name!r} ({ref!r}): {err}") from err


def check_same_component(name: str, module: nn.Module, folder: Path, loaded: PretrainedComponent) -> None:
    """Refuse a folder whose component differs from the model's (its configuration, or any tensor)."""
    check_same_configuration(name, module, folder, loaded)
    state, other = module.state_dict(), loaded.state_dict()  # type: ignore[attr-defined]
    for key, value in state.items():
        if key not in other or other[key].shape != value.shape or not torch.equal(other[key], value.cpu()):
            raise ValueError(
                f"component {name!r}: {folder} differs from the model's {name} at tensor {key!r}; save the "
                "model whole or re-export the component from the same weights"
            )


def check_same_configuration(name: str, module: nn.Module, folder: Path, loaded: PretrainedComponent) -> None:
    ours, theirs = to_config(module), to_config(loaded)
    if ours != theirs:
        key = _first_difference(ours, theirs, "")
        raise ValueError(
            f"component {name!r}: {folder} holds another configuration than the model's {name} (first "
            f"difference at {key or 'the class'}); save the model whole or re-export the component"
        )


def load_named_component(name: str, module: nn.Module, folder: Path, device: str | torch.device) -> None:
    """Load the component folder into the model's `module`, after checking that it is the same component
    the unified config describes (its tensors then load strictly)."""
    loaded = load_component(folder, type(module), "cpu")
    check_same_configuration(name, module, folder, loaded)
    module.load_state_dict(loaded.state_dict(), strict=True)  # type: ignore[attr-defined]
    module.to(device)


def stored_reference(ref: str | Path, directory: Path) -> tuple[str, bool]:
    """How a reference is written into the unified config: a local folder as a path relative to `directory`
    (so the two folders move together), a hub id as given. Returns it and whether it is local."""
    local = Path(ref).expanduser()
    if local.is_dir():
        return Path(os.path.relpath(local.resolve(), directory.resolve())).as_posix(), True
    return str(ref), False


def _first_difference(a: object, b: object, where: str) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key, "<absent>") != b.get(key, "<absent>"):
                return _first_difference(a.get(key), b.get(key), f"{where}.{key}" if where else key)
    return where
