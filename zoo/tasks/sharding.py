"""`Parallelism` for every training stage, not only the unified model (DESIGN.md, "Scale"; issue 17 item 1).

`zoo.parallel.parallelize` knows the unified model's blocks. The other stages train other networks (conv
tokenizers, the audio codec, timm encoders, a diffusers UNet), so each task says what its blocks are in a
`ShardingPlan`, and `ShardedStage.configure_model` applies `task.parallel` to that plan in torchtitan's order:

1. FP8: torchao's float8 training of every `nn.Linear` whose dims are multiples of 16, outside the plan's
   high-precision and frozen modules (convolutions are never converted: torchao's float8 is for GEMMs).
2. Activation checkpointing and regional compilation of each block.
3. FSDP2: `fully_shard` per block, then per group (what holds the rest of a trained part's parameters),
   over the "data_parallel" mesh dimension; a model built under `zoo.meta_init.deferred_init` is then
   materialised with the single-process weights.

FSDP2 gathers a group's parameters in a pre-forward hook, so every group must be run through `__call__`
(or a method the plan names in `forward_methods`). Every trainable parameter must end up sharded: a plain
tensor beside DTensors breaks gradient clipping and the optimiser's foreach kernels, and would train apart
on each rank, so a parameter the plan misses is refused with its name. Frozen modules (teachers, frozen
tokenizers, perceptual networks) are replicated: whole on every rank, never converted, never reduced.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

from zoo.meta_init import deferred_plan, is_deferred, materialize
from zoo.parallel import (
    Parallelism,
    data_parallel_mesh,
    fp8_linears_outside,
    full_state_dict,
    materialization_device,
)


@dataclass(frozen=True)
class ShardingPlan:
    """What `shard_stage` does to one task's modules.

    blocks: the repeated units (a residual stage of a conv net, a transformer block): each checkpointed and
        compiled when asked, and sharded on its own, so one block's parameters are gathered at a time.
    groups: sharded after the blocks, each taking the parameters of its subtree that no block took (stems,
        output convs, position embeddings); every group must be run through `__call__` or `forward_methods`.
    forward_methods: (module, method name) pairs that run a group instead of `forward` (timm's
        `forward_features`), registered with FSDP2 so that calling them gathers the group too.
    high_precision: modules whose linears stay out of FP8 (output heads, quantiser projections: small, and
        sensitive to rounding).
    frozen: modules that are never trained, outside every group: replicated, never converted to FP8.
    """

    blocks: tuple[nn.Module, ...] = ()
    groups: tuple[nn.Module, ...] = ()
    forward_methods: tuple[tuple[nn.Module, str], ...] = ()
    high_precision: tuple[nn.Module, ...] = ()
    frozen: tuple[nn.Module, ...] = ()


def with_parameters(modules: Iterable[nn.Module]) -> tuple[nn.Module, ...]:
    """The modules that own parameters (a block of a `Sequential` may be a parameter-free activation)."""
    return tuple(m for m in modules if next(m.parameters(), None) is not None)


def _descendants(modules: Iterable[nn.Module]) -> set[nn.Module]:
    return {sub for module in modules for sub in module.modules()}


def fp8_stage_filter(plan: ShardingPlan):  # noqa: ANN201 (torchao's (module, fqn) -> bool callable)
    """The `module_filter_fn` of `convert_to_float8_training` for a stage: a plain `nn.Linear` with both dims
    multiples of 16, outside the plan's high-precision and frozen modules. Subclasses of `nn.Linear`
    (`nn.MultiheadAttention`'s output projection) are left alone, as in `zoo.parallel.fp8_module_filter`."""
    return fp8_linears_outside(_descendants(plan.high_precision) | _descendants(plan.frozen))


def _parent_and_name(root: nn.Module, module: nn.Module) -> tuple[nn.Module, str]:
    for name, candidate in root.named_modules():
        if candidate is module and name:
            owner, _, attribute = name.rpartition(".")
            return root.get_submodule(owner), attribute
    raise ValueError(
        f"{type(module).__name__} of the sharding plan is not a submodule of {type(root).__name__}"
    )


def _checkpoint_blocks(root: nn.Module, blocks: tuple[nn.Module, ...]) -> tuple[nn.Module, ...]:
    """Each block replaced in its parent by its activation-checkpoint wrapper; returns the wrappers."""
    wrapped = []
    for block in blocks:
        if isinstance(block, CheckpointWrapper):
            wrapped.append(block)
            continue
        parent, name = _parent_and_name(root, block)
        wrapper = checkpoint_wrapper(block)
        setattr(parent, name, wrapper)
        wrapped.append(wrapper)
    return tuple(wrapped)


def unsharded_trainable(root: nn.Module) -> list[str]:
    """Names of the trainable parameters FSDP2 did not shard (plain tensors, not DTensors)."""
    from torch.distributed.tensor import DTensor

    return [n for n, p in root.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]


def shard_stage(
    root: nn.Module, plan: ShardingPlan, config: Parallelism, mesh: DeviceMesh | None = None
) -> nn.Module:
    """Apply `config` to `root` (a task) along `plan`, in place and idempotently (the module docstring)."""
    deferred = deferred_plan(root) if is_deferred(root) else None  # before FP8 and FSDP2 replace parameters
    if config.fp8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

        if not any(isinstance(m, Float8Linear) for m in root.modules()):
            fp8 = Float8LinearConfig(enable_fsdp_float8_all_gather=config.fp8_all_gather)
            convert_to_float8_training(root, config=fp8, module_filter_fn=fp8_stage_filter(plan))
    blocks = plan.blocks
    if config.activation_checkpointing:
        blocks = _checkpoint_blocks(root, blocks)
    if config.compile:
        for block in blocks:
            if block._compiled_call_impl is None:
                block.compile(backend=config.compile_backend)
    dp_mesh = data_parallel_mesh(config, mesh)
    if dp_mesh is not None:
        sharded_now = set()
        for module in (*blocks, *plan.groups):
            if not isinstance(module, FSDPModule):
                fully_shard(module, mesh=dp_mesh)
                sharded_now.add(module)
        for module, method in plan.forward_methods:
            if module in sharded_now:  # registering twice would run FSDP2's hooks twice per call
                register_fsdp_forward_method(module, method)
        missed = unsharded_trainable(root)
        if missed:
            raise ValueError(
                f"{type(root).__name__}: FSDP2 left trainable parameters unsharded: {missed[:8]}; every "
                "trained module must be in the sharding plan's blocks or groups (zoo/tasks/sharding.py)"
            )
    if deferred is not None:
        materialize(root, deferred, materialization_device(mesh))
    return root


def plain_component(module: nn.Module) -> nn.Module:
    """`module` without FSDP2 shards, FP8 layers or checkpoint wrappers, for writing a component file: itself
    when it has none, else a fresh build of its config with the gathered weights (every rank must call)."""
    from torch.distributed.tensor import DTensor

    wrapped = any(isinstance(p, DTensor) for p in module.parameters()) or any(
        type(m).__name__ in ("Float8Linear", "CheckpointWrapper") for m in module.modules()
    )
    if not wrapped:
        return module
    from zoo.config import to_config
    from zoo.publishing.building import build_from_config

    state = full_state_dict(module)
    config = to_config(module)
    if isinstance(module, FSDPModule):  # FSDP2 renamed the class (FSDP<Name>): build the class it came from
        cls = next(c for c in type(module).__mro__[1:] if not issubclass(c, FSDPModule))
        config["class_path"] = f"{cls.__module__}.{cls.__qualname__}"
    with torch.random.fork_rng():  # the fresh build's init draws must not move the training stream
        plain = build_from_config(config)
    plain.load_state_dict(state, strict=True)
    return plain


class ShardedStage:
    """Mixin of a stage's LightningModule: `configure_model` applies `self.parallel` along
    `self.sharding_plan()`. A task sets `parallel` in its constructor and defines `sharding_plan`."""

    parallel: Parallelism
    # `zoo fit` builds the task under zoo.meta_init with parallel.fsdp when this is True (the stages whose
    # constructors replay exactly: tests/test_sharding_plans.py).
    meta_init_with_fsdp: ClassVar[bool] = False

    def sharding_plan(self) -> ShardingPlan:
        raise NotImplementedError(f"{type(self).__name__} must say what FSDP2 shards (a ShardingPlan)")

    def configure_model(self) -> None:
        # Lightning may call this more than once (fit then test); every step of shard_stage is idempotent.
        shard_stage(self, self.sharding_plan(), self.parallel, self.device_mesh)  # type: ignore[arg-type]


__all__ = [
    "ShardedStage",
    "ShardingPlan",
    "fp8_stage_filter",
    "plain_component",
    "shard_stage",
    "unsharded_trainable",
    "with_parameters",
]
