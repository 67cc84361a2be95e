"""Rebuilding a component from its `{class_path, init_args}` tree without executing code from the tree.

Every class path passes the allow-list (`zoo.trust.zoo_class`: only classes defined under `zoo.`, checked
before any import) and must be a `Configurable` component; dataclasses and tuples are rebuilt from the
constructor's type hints; everything else must be plain JSON.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Mapping
from typing import Any

from zoo.config import Configurable
from zoo.trust import UnsafeConfigError, zoo_class


def resolve_class(class_path: object, where: str = "config") -> type:
    """The zoo component `class_path` names, or `UnsafeConfigError`. Only modules under `zoo.` are imported
    (`zoo.trust`), and the class must be a `Configurable` component."""
    cls = zoo_class(class_path, where)
    if not issubclass(cls, Configurable):
        raise UnsafeConfigError(
            f"{where}: refusing class_path {class_path!r}: not a Configurable zoo component"
        )
    return cls


def build_from_config(config: Any, hint: Any = Any, where: str = "config") -> Any:
    """Instantiate a `{"class_path", "init_args"}` tree (the output of `to_config`) without executing code
    from the config: classes pass `resolve_class`, dataclasses and tuples are rebuilt from the constructor's
    type hints, everything else must be plain JSON."""
    if isinstance(config, Mapping) and "class_path" in config:
        extra = set(config) - {"class_path", "init_args"}
        if extra:
            raise ValueError(f"{where}: unexpected keys {sorted(extra)} next to class_path")
        cls = resolve_class(config["class_path"], where)
        init_args = config.get("init_args") or {}
        if not isinstance(init_args, Mapping):
            raise ValueError(f"{where}.init_args must be a mapping, got {type(init_args).__name__}")
        parameters = inspect.signature(cls).parameters
        hints = _type_hints(cls.__init__)
        kwargs = {}
        for name, value in init_args.items():
            if name not in parameters:
                valid = ", ".join(parameters)
                raise ValueError(f"{where}: {config['class_path']} has no argument {name!r} ({valid})")
            kwargs[name] = build_from_config(value, hints.get(name, Any), f"{where}.{name}")
        try:
            return cls(**kwargs)
        except TypeError as err:
            raise ValueError(f"{where}: cannot build {config['class_path']}: {err}") from err
    hint = _strip_optional(hint)
    if isinstance(config, Mapping):
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            names = {f.name for f in dataclasses.fields(hint)}
            unknown = set(config) - names
            if unknown:
                raise ValueError(f"{where}: {hint.__name__} has no fields {sorted(unknown)}")
            hints = _type_hints(hint)
            values = {k: build_from_config(v, hints.get(k, Any), f"{where}.{k}") for k, v in config.items()}
            return hint(**values)
        return {str(k): build_from_config(v, Any, f"{where}.{k}") for k, v in config.items()}
    if isinstance(config, list):
        items = [build_from_config(v, Any, f"{where}[{i}]") for i, v in enumerate(config)]
        origin = typing.get_origin(hint)
        return tuple(items) if origin is tuple or hint is tuple else items
    if config is None or isinstance(config, (bool, int, float, str)):
        return config
    raise ValueError(f"{where}: {type(config).__name__} is not plain configuration")


def without_construction_only(config: Any, where: str = "config") -> Any:
    """`config` with every component's construction-only arguments (a `weights` path, pretrained backbones)
    set to None, as `to_config` records them: a checkpoint's state dict brings the weights, so rebuilding it
    must not read files that only exist on the machine that trained it. Class paths pass the allow-list."""
    if isinstance(config, Mapping) and "class_path" in config:
        skip = getattr(resolve_class(config["class_path"], where), "construction_only", ())
        init_args = config.get("init_args") or {}
        if not isinstance(init_args, Mapping):
            return dict(config)  # build_from_config names the fault
        cleared = {
            k: None if k in skip else without_construction_only(v, f"{where}.{k}")
            for k, v in init_args.items()
        }
        return {**config, "init_args": cleared}
    if isinstance(config, Mapping):
        return {k: without_construction_only(v, f"{where}.{k}") for k, v in config.items()}
    if isinstance(config, list):
        return [without_construction_only(v, f"{where}[{i}]") for i, v in enumerate(config)]
    return config


def _type_hints(obj: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(obj)
    except Exception:  # an annotation that does not resolve just loses its conversion
        return {}


def _strip_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint
