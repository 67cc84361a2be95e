"""The optimizer and learning-rate schedule of every task, chosen in YAML (LightningCLI's callables).

Each task takes `optimizer: OptimizerCallable | None` and `lr_scheduler: LRSchedulerCallable | None`, which a
YAML file sets the way LightningCLI documents:

    model:
      init_args:
        optimizer: {class_path: torch.optim.SGD, init_args: {lr: 0.1, momentum: 0.9}}
        lr_scheduler: {class_path: torch.optim.lr_scheduler.StepLR, init_args: {step_size: 100}}

None keeps the task's own recipe: AdamW with the task's `lr` and `betas`, and the warm-up-cosine schedule of
`zoo/tasks/schedules.py` over `warmup_steps` and `min_lr_ratio`, exactly as before the callables existed.

The task still owns its parameter groups (no weight decay on norms and biases, a separate learning rate for a
discriminator, ...): the callable receives the groups, so a swapped optimizer keeps them. Each group carries
its `weight_decay` (the task's `weight_decay` on matrices, 0 on vectors), which takes precedence over the
optimizer's own `weight_decay` argument, as torch gives a group's settings precedence over the defaults.
Arguments of the default recipe do nothing once the callable replaces it; one changed from its default is
refused by name rather than silently ignored (`refuse_replaced_arguments`). A given schedule is stepped every
optimizer step, as the default is (runs are step-limited).

Which classes a YAML may name is `zoo/trust.py`'s allow-list (torch.optim and torchao.optim).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn

from zoo.tasks.schedules import Total, warmup_cosine

__all__ = [
    "LRSchedulerCallable",
    "OptimizerCallable",
    "build_optimizer",
    "build_schedule",
    "decay_groups",
    "lightning_optimizers",
    "refuse_replaced_arguments",
]


def decay_groups(parameters: Iterable[nn.Parameter], weight_decay: float) -> list[dict[str, object]]:
    """The trainable parameters in two groups: matrices decayed by `weight_decay`, vectors (norm scales,
    biases) not decayed."""
    decay, no_decay = [], []
    for p in parameters:
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(
    groups: list[dict[str, object]],
    optimizer: OptimizerCallable | None,
    default: Callable[[list[dict[str, object]]], torch.optim.Optimizer],
    task: str,
) -> torch.optim.Optimizer:
    """`optimizer(groups)`, or `default(groups)` when no optimizer is configured."""
    built = (default if optimizer is None else optimizer)(groups)
    if not isinstance(built, torch.optim.Optimizer):
        raise TypeError(
            f"{task}: `optimizer` built a {type(built).__name__}, expected a torch.optim.Optimizer (give a "
            "class_path of an optimizer class, e.g. torch.optim.SGD or torchao.optim.AdamW8bit)"
        )
    return built


def lightning_optimizers(
    optimizer: torch.optim.Optimizer,
    lr_scheduler: LRSchedulerCallable | None,
    warmup_steps: int,
    total_steps: Total,
    min_lr_ratio: float,
) -> dict[str, object]:
    """`configure_optimizers`' return value: the configured schedule stepped every optimizer step, or (None)
    `warmup_cosine` over `total_steps`."""
    if lr_scheduler is None:
        return warmup_cosine(optimizer, warmup_steps, total_steps, min_lr_ratio)
    scheduler = build_schedule(optimizer, lr_scheduler, type(optimizer).__name__)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def build_schedule(
    optimizer: torch.optim.Optimizer, lr_scheduler: LRSchedulerCallable, where: str
) -> torch.optim.lr_scheduler.LRScheduler:
    """`lr_scheduler(optimizer)`, refusing what cannot be stepped once per optimizer step without a metric."""
    scheduler = lr_scheduler(optimizer)
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError(
            f"{where}: `lr_scheduler` built a {type(scheduler).__name__}, expected a "
            "torch.optim.lr_scheduler.LRScheduler stepped every optimizer step (ReduceLROnPlateau needs a "
            "monitored metric, which the zoo's step-limited runs do not give it)"
        )
    return scheduler


def refuse_replaced_arguments(
    task: type, replaced_by: str, replacement: object | None, given: dict[str, object]
) -> None:
    """Refuse arguments of the default recipe changed from their defaults while `replacement` (the configured
    `optimizer` or `lr_scheduler`) makes them unused: the value would otherwise be silently ignored."""
    if replacement is None:
        return
    parameters = inspect.signature(task.__init__).parameters
    changed = {
        name: (value, parameters[name].default)
        for name, value in given.items()
        if name in parameters and _plain(value) != _plain(parameters[name].default)
    }
    if changed:
        values = ", ".join(f"{name}={value!r}" for name, (value, _) in changed.items())
        defaults = ", ".join(f"{name}: {default!r}" for name, (_, default) in changed.items())
        raise ValueError(
            f"{task.__name__}: {values} belong to the default recipe, which the configured `{replaced_by}` "
            f"replaces, so they would be ignored: give them in {replaced_by}.init_args instead, and remove "
            f"them or set them back to their defaults ({defaults})"
        )


def _plain(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value
