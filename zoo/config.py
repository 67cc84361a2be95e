"""Components that know the YAML that rebuilds them.

Every zoo component is built from `class_path`/`init_args` (LightningCLI, jsonargparse). A
`Configurable` records the arguments it was constructed with, so a live object turns back into that
same plain structure with `to_config`: for checkpoints (hyper-parameters that load with
`weights_only=True`, never pickled objects) and for hub configs (JSON, rebuilt without executing code).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import asdict, is_dataclass
from typing import Any

from torch import nn


class _FromAttribute:
    """Stands in for a module-valued argument: the live object is the attribute of the same name (so a
    swapped or extracted submodule is what gets serialised, and copies do not duplicate it)."""

    def __repr__(self) -> str:
        return "<attribute>"

    def __copy__(self) -> _FromAttribute:
        return self  # a singleton: `to_config` recognises it by identity, copies included

    def __deepcopy__(self, memo: dict) -> _FromAttribute:
        return self


FROM_ATTRIBUTE = _FromAttribute()


class Configurable:
    """Mixin: records the bound constructor arguments of the most-derived class in `self.init_args`.

    A module-valued argument must be kept as the attribute of the same name (`self.backbone = backbone`).
    Arguments named in `construction_only` (e.g. a path to pretrained weights read once by `__init__`)
    are recorded as None: the weights travel in the state dict, and a saved config must not point at a
    file that only exists on the machine that trained it.
    """

    construction_only: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return
        signature = inspect.signature(init)

        @functools.wraps(init)
        def recording_init(self: Any, *args: Any, **kw: Any) -> None:
            init(self, *args, **kw)
            if type(self) is cls:
                bound = signature.bind(self, *args, **kw)
                bound.apply_defaults()
                recorded = {
                    name: None
                    if name in cls.construction_only
                    else FROM_ATTRIBUTE
                    if isinstance(value, nn.Module)
                    else value
                    for name, value in list(bound.arguments.items())[1:]
                }
                object.__setattr__(self, "init_args", recorded)

        cls.__init__ = recording_init  # type: ignore[misc]


def class_path(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def to_config(value: Any) -> Any:
    """A plain (JSON/YAML-able) structure: `{"class_path", "init_args"}` for components, dicts for
    dataclasses, lists for tuples."""
    if isinstance(value, Configurable):
        init_args = {}
        for name, arg in value.init_args.items():
            init_args[name] = to_config(getattr(value, name) if arg is FROM_ATTRIBUTE else arg)
        return {"class_path": class_path(value), "init_args": init_args}
    if isinstance(value, functools.partial) and (cls := _bound_class(value)) is not None:
        # A class with keyword arguments bound (a task's `optimizer`, `lr_scheduler`): the YAML spelling
        # LightningCLI gives the same callable.
        init_args = {k: to_config(v) for k, v in value.keywords.items()}
        return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": init_args}
    if is_dataclass(value) and not isinstance(value, type):
        return {k: to_config(v) for k, v in asdict(value).items()}
    if isinstance(value, (list, tuple)):
        return [to_config(v) for v in value]
    if isinstance(value, dict):
        return {k: to_config(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if callable(value):
        raise TypeError(
            f"cannot express the callable {value!r} as configuration; give a class with its keyword arguments"
            " bound, functools.partial(torch.optim.SGD, lr=0.1), or its YAML {class_path, init_args}"
        )
    raise TypeError(f"cannot express {type(value).__name__} as configuration; make it Configurable")


def _bound_class(value: functools.partial) -> type | None:
    """The class a partial builds with keyword arguments only: `partial(cls, **kw)` (Python), or
    jsonargparse's `partial(call, instantiator, cls, **kw)` (a callable-typed argument parsed from YAML)."""
    if isinstance(value.func, type):
        return None if value.args else value.func
    from_parser = getattr(value.func, "__module__", "").startswith("jsonargparse")
    return value.args[-1] if from_parser and value.args and isinstance(value.args[-1], type) else None


def save_config_hyperparameters(module: Any) -> None:
    """`LightningModule.save_hyperparameters()` for the caller's `__init__`, with every component replaced by
    the config that rebuilds it, so a checkpoint never pickles an object and loads with
    `torch.load(weights_only=True)`. Built by LightningCLI, the hyper-parameters already are configs (they
    carry `_instantiator`); built in Python, they are converted here. Injected modules are kept, not
    ignored: ignoring them breaks `load_from_checkpoint` (DESIGN.md).

    The configs are made *before* Lightning stores the hyper-parameters, as LightningCLI hands them over:
    Lightning keeps a `copy.deepcopy` of what it stores (`hparams_initial`), which for the live arguments was
    a second copy of the whole model on every rank (279 MB of `small`'s fp32 weights, held for the whole run;
    under `zoo.meta_init` a copy of every deferred parameter's record)."""
    from lightning.pytorch.core.mixins.hparams_mixin import (
        HyperparametersMixin,
        _given_hyperparameters,
        _given_hyperparameters_context,
    )
    from lightning.pytorch.utilities.parsing import collect_init_args

    frame = inspect.currentframe().f_back
    if _given_hyperparameters.get() is not None:  # built by LightningCLI: its hyper-parameters are configs
        module.save_hyperparameters(frame=frame)
        return
    arguments: dict[str, Any] = {}
    for local in collect_init_args(frame, [], classes=(HyperparametersMixin,)):  # as Lightning collects them
        arguments.update(local)
    configs = {name: to_config(value) for name, value in arguments.items()}
    with _given_hyperparameters_context(configs, instantiator="lightning.pytorch.cli.instantiate_module"):
        module.save_hyperparameters(frame=frame)
