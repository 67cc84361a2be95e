"""What a config or a checkpoint may make the zoo import: one allow-list for the hub, the CLI and checkpoints.

Instantiation is execution: a `class_path` plus `init_args` can run anything importable (`os.system`,
`builtins.eval`, a module with a side effect on import). So every class path is checked *before* anything
is imported, in two tiers:

- A checkpoint or a hub folder is untrusted data (anyone can share one). The class paths it holds must name
  classes defined under the `zoo` package; the dotted path is matched textually first, so a path outside
  `zoo.` is refused without importing anything (`zoo_class`, `check_checkpoint_classes`).
- A YAML file or a command-line flag is the user's own, but may still arrive from elsewhere (a shared
  config). jsonargparse enforces an allow-list of import paths for every value it parses
  (`enforce_import_allowlist`): the zoo, Lightning's callbacks, loggers, strategies, plugins, profilers and
  accelerators, and the optimisers and schedules of torch (`torch.optim`) and torchao (`torchao.optim`). A
  user's own module is added by naming it in the
  environment variable `ZOO_ALLOW_IMPORTS` (comma-separated dotted prefixes, e.g. `my_callbacks,lab.tools`).

Lightning's own anchor is `lightning.pytorch.core.saving._ALLOWED_INSTANTIATORS`, the instantiators a
checkpoint may name; `check_checkpoint_classes` accepts exactly those. Besides zoo classes, a checkpoint may
name the optimiser and schedule a task was configured with (`zoo/tasks/optim.py`): an `Optimizer` or
`LRScheduler` subclass defined under `torch.optim` or `torchao.optim` (`optimizer_class`).
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Mapping
from typing import Any

ALLOW_ENV = "ZOO_ALLOW_IMPORTS"

# Dotted prefixes a YAML file or a flag may name (jsonargparse checks the name and the canonical path).
ALLOWED_IMPORTS = (
    "zoo",
    "lightning.pytorch.callbacks",
    "lightning.pytorch.loggers",
    "lightning.pytorch.strategies",
    "lightning.pytorch.plugins",
    "lightning.pytorch.profilers",
    "lightning.pytorch.accelerators",
    "lightning.fabric.plugins",
    "lightning.fabric.accelerators",
    "torch.optim",
    "torchao.optim",
)

# The packages whose optimisers and schedules a checkpoint may name (a task's `optimizer`, `lr_scheduler`).
OPTIMIZER_PACKAGES = ("torch.optim", "torchao.optim")

# A dotted path of identifiers under the `zoo` package; checked before anything is imported.
_ZOO_PATH = re.compile(r"zoo(\.[A-Za-z_][A-Za-z0-9_]*)+")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_OPTIM_PATH = re.compile(r"(torch|torchao)\.optim(\.[A-Za-z_][A-Za-z0-9_]*)+")
_CLASS_KEYS = ("class_path", "_class_path")


class UnsafeConfigError(ValueError):
    """A config or checkpoint names something outside the allow-list."""


def zoo_class(class_path: object, where: str = "config") -> type:
    """The class `class_path` names, if it is defined in a module under `zoo.`; `UnsafeConfigError` otherwise.

    Only modules under `zoo.` are ever imported, and only after the textual check."""
    if not isinstance(class_path, str) or not _ZOO_PATH.fullmatch(class_path):
        raise UnsafeConfigError(
            f"{where}: refusing class_path {class_path!r}: only classes defined under the `zoo.` package may "
            "be built from a config or a checkpoint"
        )
    module_name, _, name = class_path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UnsafeConfigError(
            f"{where}: refusing class_path {class_path!r}: no zoo module {module_name!r}"
        ) from err
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and cls.__module__ == module_name):
        raise UnsafeConfigError(
            f"{where}: refusing class_path {class_path!r}: not a class defined in {module_name}"
        )
    return cls


def optimizer_class(class_path: str, where: str = "checkpoint") -> type:
    """The optimiser or schedule class `class_path` names under `torch.optim` or `torchao.optim` (any of their
    modules, as jsonargparse may spell the canonical path); `UnsafeConfigError` for anything else. Only
    modules of those two packages are imported, after the textual check."""
    import torch

    module_name, _, name = class_path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UnsafeConfigError(
            f"{where}: refusing class_path {class_path!r}: no module {module_name!r}"
        ) from err
    cls = getattr(module, name, None)
    kinds = (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)
    defined_in = getattr(cls, "__module__", "")
    if not (
        isinstance(cls, type)
        and issubclass(cls, kinds)
        and any(defined_in == p or defined_in.startswith(p + ".") for p in OPTIMIZER_PACKAGES)
    ):
        raise UnsafeConfigError(
            f"{where}: refusing class_path {class_path!r}: not an optimizer or learning-rate schedule of "
            f"{' or '.join(OPTIMIZER_PACKAGES)}"
        )
    return cls


def checkpoint_class(class_path: object, where: str) -> type:
    """A class a checkpoint may name: a zoo class, or a torch / torchao optimiser or schedule."""
    if isinstance(class_path, str) and _OPTIM_PATH.fullmatch(class_path):
        return optimizer_class(class_path, where)
    return zoo_class(class_path, where)


def check_checkpoint_classes(tree: Any, where: str) -> None:
    """Refuse a checkpoint's hyper-parameters that name anything but zoo classes, torch / torchao optimisers
    and schedules (`checkpoint_class`) or Lightning's allowed instantiators, importing nothing outside those
    packages. Walks nested dicts and lists."""
    from lightning.pytorch.core.saving import _ALLOWED_INSTANTIATORS

    if isinstance(tree, Mapping):
        for key, value in tree.items():
            here = f"{where}.{key}"
            if key in _CLASS_KEYS:
                checkpoint_class(value, here)
            elif key == "_instantiator":
                if value not in _ALLOWED_INSTANTIATORS:
                    raise UnsafeConfigError(f"{here}: refusing instantiator {value!r}")
            else:
                check_checkpoint_classes(value, here)
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            check_checkpoint_classes(value, f"{where}[{i}]")


def allowed_imports() -> tuple[str, ...]:
    """`ALLOWED_IMPORTS` plus the user's prefixes from `ZOO_ALLOW_IMPORTS`."""
    extra = [p.strip() for p in os.environ.get(ALLOW_ENV, "").split(",") if p.strip()]
    for prefix in extra:
        if not _DOTTED.fullmatch(prefix) or prefix.split(".")[0] == "jsonargparse":
            raise UnsafeConfigError(
                f"{ALLOW_ENV}: {prefix!r} is not an allowed import prefix (dotted module names only; "
                "jsonargparse itself cannot be allowed)"
            )
    return (*ALLOWED_IMPORTS, *extra)


def enforce_import_allowlist() -> None:
    """Make jsonargparse refuse every import path a parsed value names unless `allowed_imports` covers it.

    The setting is process-wide and jsonargparse only adds to it; calling this again re-reads
    `ZOO_ALLOW_IMPORTS` and denies again what an earlier call allowed and the variable no longer names."""
    from jsonargparse import set_parsing_settings

    allowed = allowed_imports()
    withdrawn = sorted(_granted - set(allowed))
    set_parsing_settings(import_path_denylist=["*", *withdrawn], import_path_allowlist=list(allowed))
    _granted.update(allowed)


_granted: set[str] = set()  # every prefix some call of `enforce_import_allowlist` allowed in this process
