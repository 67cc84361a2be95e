"""`zoo plan`: what one rank of a sharded run holds, checked without GPUs or a cluster (docs/scale.md).

The model of a config (or a preset) is built on the `meta` device, a fake process group of `--world_size`
ranks (torch's `FakeStore` and "fake" backend: every collective is a no-op) gives the device mesh, and
`zoo.parallel.parallelize` shards it exactly as `zoo fit` would: the DTensor shards are the real per-rank
shapes. Printed: the mesh, the parameter, gradient and AdamW-state bytes per rank, and the largest unit
FSDP2 all-gathers (a block, or the root's embeddings and heads), which a rank holds whole while it runs.
With expert parallelism (`--expert_parallel N`, or the config's `parallel.expert_parallel`) the mesh gains its
expert dimensions and the plan shows the routed experts' bytes per rank (each rank holds E/N experts of a
layer, sharded again over the ranks that hold the same experts). Takes seconds for `base` on a laptop;
nothing is allocated.

    zoo plan --preset base --world_size 64
    zoo plan --preset base --world_size 64 --expert_parallel 8
    zoo plan --config configs/quickstart.yaml --config configs/presets/base.yaml --world_size 64
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from zoo.expert_parallel import EP_DIM, EXPERT_DP_DIM
from zoo.models.moe import Experts
from zoo.models.unified import UnifiedModel
from zoo.parallel import Parallelism, parallelize, transformer_blocks

ADAMW_STATES = 2  # exp_avg and exp_avg_sq, each the parameter's shape and dtype


@dataclass(frozen=True)
class RankPlan:
    """Per-rank memory of one sharded model (bytes), and the mesh it was sharded over."""

    world_size: int
    mesh: dict[str, int]
    params_total: int
    params_per_rank: int
    param_bytes_per_rank: int
    grad_bytes_per_rank: int
    optimizer_bytes_per_rank: int
    state_bytes_per_rank: int  # parameters + gradients + AdamW states
    largest_gathered_unit: str
    largest_gathered_unit_bytes: int
    expert_parallel: int = 1
    expert_bytes_total: int = 0  # the routed experts' parameter bytes, all ranks together
    expert_bytes_per_rank: int = 0  # the routed experts' parameter bytes one rank holds


def _local(param: nn.Parameter) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def _bytes(params: list[nn.Parameter], local: bool) -> int:
    return sum((_local(p) if local else p).numel() * p.element_size() for p in params)


def plan_model(model: UnifiedModel, parallel: Parallelism, world_size: int) -> RankPlan:
    """Shard a meta-device `model` over a fake mesh of `world_size` ranks with `parallel` (fsdp forced on,
    compile off) and measure what rank 0 holds. The fake process group is set up and torn down here."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if any(not p.is_meta for p in model.parameters()):
        raise ValueError("zoo plan measures a model built on the meta device (device='meta')")
    if dist.is_initialized():
        raise RuntimeError("zoo plan sets up its own fake process group: call it outside a distributed run")
    units = {name: [p for p in block.parameters()] for name, block in _unit_names(model)}
    owned = {id(p) for params in units.values() for p in params}
    units["root (embeddings, heads, norms)"] = [p for p in model.parameters() if id(p) not in owned]
    gathered = {name: _bytes(params, local=False) for name, params in units.items()}
    experts = {name: m for name, m in model.named_modules() if isinstance(m, Experts)}
    expert_bytes = sum(_bytes(list(m.parameters()), local=False) for m in experts.values())
    ep = parallel.expert_parallel
    if ep > 1:  # the local experts are a unit of their own, gathered over the ranks holding the same experts
        for name, module in experts.items():
            block = next(unit for unit in units if name.startswith(unit + "."))
            own = _bytes(list(module.parameters()), local=False)
            gathered[block] -= own
            gathered[name] = own // ep
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("data_parallel",))
        parallelize(model, replace(parallel, fsdp=True, compile=False), mesh)
        dims = dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True))
        if ep > 1:
            dims |= {EXPERT_DP_DIM: world_size // ep, EP_DIM: ep}
        params = list(model.parameters())
        # Sharding replaced the Parameter objects: read the experts' again.
        expert_params = [p for m in model.modules() if isinstance(m, Experts) for p in m.parameters()]
        trainable = [p for p in params if p.requires_grad]
        param_bytes, grad_bytes = _bytes(params, local=True), _bytes(trainable, local=True)
        optimizer_bytes = ADAMW_STATES * grad_bytes
        largest = max(gathered, key=gathered.get)
        return RankPlan(
            world_size=world_size,
            mesh=dims,
            params_total=sum(p.numel() for p in params),
            params_per_rank=sum(_local(p).numel() for p in params),
            param_bytes_per_rank=param_bytes,
            grad_bytes_per_rank=grad_bytes,
            optimizer_bytes_per_rank=optimizer_bytes,
            state_bytes_per_rank=param_bytes + grad_bytes + optimizer_bytes,
            largest_gathered_unit=largest,
            largest_gathered_unit_bytes=gathered[largest],
            expert_parallel=ep,
            expert_bytes_total=expert_bytes,
            expert_bytes_per_rank=_bytes(expert_params, local=True),
        )
    finally:
        dist.destroy_process_group()


def _unit_names(model: UnifiedModel) -> list[tuple[str, nn.Module]]:
    """The FSDP2 units `parallelize` makes, by name: each backbone and MTP block."""
    names = {id(module): name for name, module in model.named_modules()}
    return [(names[id(block)], block) for _, _, block in transformer_blocks(model)]


def _model_from_configs(configs: list[str]) -> tuple[UnifiedModel, Parallelism]:
    """The task's model and `parallel` of LightningCLI configs, every class built on the meta device."""
    from zoo.cli.lightning_cli import ZooCLI

    class MetaCLI(ZooCLI):
        def instantiate_classes(self) -> None:
            with torch.device("meta"):
                super().instantiate_classes()

    args = [flag for path in configs for flag in ("--config", path)]
    task = MetaCLI(args=args, run=False).model
    model, parallel = getattr(task, "model", None), getattr(task, "parallel", None)
    if not isinstance(model, UnifiedModel) or not isinstance(parallel, Parallelism):
        raise SystemExit(
            f"zoo plan: the config's task {type(task).__name__} has no UnifiedModel `model` and Parallelism "
            "`parallel` (expected zoo.tasks.pretrain.UnifiedPretraining or a task like it)"
        )
    return model, parallel


def format_plan(plan: RankPlan) -> str:
    gib = 2**30
    lines = [
        f"mesh {plan.mesh} ({plan.world_size} ranks); parameters {plan.params_total:,} in all, "
        f"{plan.params_per_rank:,} per rank",
        f"per rank: parameters {plan.param_bytes_per_rank / gib:.3f} GiB, gradients "
        f"{plan.grad_bytes_per_rank / gib:.3f} GiB, AdamW states "
        f"{plan.optimizer_bytes_per_rank / gib:.3f} GiB = {plan.state_bytes_per_rank / gib:.3f} GiB",
        f"largest unit gathered whole while it runs: {plan.largest_gathered_unit} "
        f"({plan.largest_gathered_unit_bytes / gib:.3f} GiB); activations come on top",
    ]
    if plan.expert_bytes_total:
        split = f"split over expert_parallel={plan.expert_parallel}" if plan.expert_parallel > 1 else "no EP"
        lines.append(
            f"routed experts ({split}): {plan.expert_bytes_per_rank / gib:.3f} GiB of parameters per rank, "
            f"{plan.expert_bytes_total / gib:.3f} GiB in all"
        )
    return "\n".join(lines)


def plan_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="zoo plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", help="a model preset (zoo models), with Parallelism(fsdp=True)")
    # --config is the training run's own config (as for zoo ablate and analyze), not this command's options.
    source.add_argument("--config", action="append", help="LightningCLI config files, in order (repeatable)")
    parser.add_argument("--world_size", type=int, required=True, help="ranks of the data-parallel mesh")
    parser.add_argument("--fp8", action="store_true", help="with --preset: FP8 linears (as fsdp_fp8.yaml)")
    parser.add_argument(
        "--expert_parallel", type=int, help="ranks the routed experts are split over (default: the config's)"
    )
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error(f"--world_size must be at least 1, got {args.world_size}")
    if args.preset:
        from zoo.registry import create_model

        model, parallel = create_model(args.preset, device="meta"), Parallelism(fsdp=True, fp8=args.fp8)
    else:
        model, parallel = _model_from_configs(args.config)
    if args.expert_parallel is not None:
        parallel = replace(parallel, fsdp=True, expert_parallel=args.expert_parallel)
    plan = plan_model(model, parallel, args.world_size)
    print(format_plan(plan))
    print(json.dumps(asdict(plan)))


__all__ = ["RankPlan", "format_plan", "plan_main", "plan_model"]
