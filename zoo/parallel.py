"""Scaling one model over many processes (DESIGN.md, "Scale"): FP8 training, activation checkpointing,
regional compilation, FlexAttention and FSDP2, applied in torchtitan's fixed order by `parallelize`, from a
task's `configure_model`.

The models in `zoo.models` know nothing of sharding; everything distributed happens here. The order
matters: FP8 conversion swaps `nn.Linear` for `Float8Linear` before anything wraps the blocks,
checkpointing wraps whole blocks, each (wrapped) block is then compiled on its own (torchtitan's regional
compilation: one small graph reused by every layer, instead of one graph of the whole model), and
`fully_shard` comes last, per block then at the root, so each block's parameters are gathered just before it
runs and freed after. A model built under `zoo.meta_init.deferred_init` (parameters on `meta`) is
materialised after sharding, each rank writing only its shards, with the weights a single process builds.
Tensor parallelism is not done (the strategy below keeps the tensor-parallel dimension at 1). Expert
parallelism (`expert_parallel > 1`, `zoo.expert_parallel`) splits the routed experts over groups of
data-parallel ranks before checkpointing, as torchtitan applies TP/EP before it; FSDP2 then shards the local
experts over the ranks EP does not use and everything else over all of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from zoo.expert_parallel import apply_expert_parallel, fully_shard_local_experts
from zoo.host_memory import return_large_blocks_to_os
from zoo.meta_init import deferred_plan, is_deferred, materialize
from zoo.models.moe import Router
from zoo.models.unified import UnifiedModel

# Float8 GEMMs need both matrix dimensions divisible by 16 (the scaled-mm kernels' tile constraint).
FP8_DIM_MULTIPLE = 16


@dataclass(frozen=True)
class Parallelism:
    """How `parallelize` scales the model.

    Args:
        fsdp: shard parameters, gradients and optimiser state with FSDP2 over the data-parallel ranks
            (needs `ModelParallelStrategy` or `FSDP2Strategy`, which provide the device mesh).
        fp8: torchao float8 training of the linear layers the filter admits (`fp8_module_filter`).
        fp8_experts: FP8 rowwise grouped GEMMs for the routed experts' weights (torchao's MoE training
            path, `zoo.float8_experts`): CUDA with compute capability 9.0+ only; refused elsewhere, naming
            the reason. Independent of `fp8` (the linears); both together is the full FP8 recipe.
        activation_checkpointing: recompute each transformer block in the backward pass.
        fp8_all_gather: with fsdp and fp8, all-gather float8 weights (half the bytes of bf16).
        compile: `torch.compile` each transformer block on its own (regional compilation).
        compile_backend: the `torch.compile` backend ("inductor": generated kernels; "aot_eager": the same
            graphs run by eager kernels, which checks tracing without a compiler toolchain's minutes).
        attention: "sdpa" (`scaled_dot_product_attention` with the dense group mask; the default, and the
            one for KV-cache decoding) or "flex" (FlexAttention with a `BlockMask` of the group rule: no
            `[L, L]` mask, and blocks no position may see are skipped; compiled kernels on GPU).
        expert_parallel: ranks each MoE layer's routed experts are split over (1: every rank holds its FSDP
            shard of every expert); tokens go to their experts' rank by all-to-all (`zoo.expert_parallel`).
            Must divide the data-parallel size and n_experts; needs fsdp.
    """

    fsdp: bool = False
    fp8: bool = False
    activation_checkpointing: bool = False
    fp8_all_gather: bool = False
    compile: bool = False
    compile_backend: str = "inductor"
    attention: Literal["sdpa", "flex"] = "sdpa"
    fp8_experts: bool = False
    expert_parallel: int = 1

    def __post_init__(self) -> None:
        if self.expert_parallel < 1:
            raise ValueError(f"expert_parallel={self.expert_parallel}: expected at least 1 (1: none)")
        if self.expert_parallel > 1 and not self.fsdp:
            raise ValueError(
                f"expert_parallel={self.expert_parallel} needs fsdp=True: FSDP2 shards and reduces what the "
                "experts' split leaves (the non-expert parameters and the local experts' gradients)"
            )
        if self.fp8_experts and self.expert_parallel > 1:
            raise ValueError(
                "fp8_experts with expert_parallel > 1 is not supported yet: the FP8 grouped GEMM wrapper and "
                "the experts' split over ranks were built and tested apart (docs/scale.md)"
            )
        if self.fp8_all_gather and not (self.fsdp and self.fp8):
            raise ValueError("fp8_all_gather=True needs fsdp=True and fp8=True: it is FSDP2's float8 gather")
        if self.attention not in ("sdpa", "flex"):
            raise ValueError(f"attention must be 'sdpa' or 'flex', got {self.attention!r}")


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's `ModelParallelStrategy` with every process data-parallel by default.

    The parent's "auto" sizes mean one data-parallel group per node and tensor parallelism inside it;
    with no tensor parallelism in the zoo that would leave the ranks of a node unsynchronised and
    feeding on the same data. Here "auto" means world size / tensor_parallel_size.

    Args:
        data_parallel_size: data-parallel (FSDP) group size; "auto": all processes.
        tensor_parallel_size: tensor-parallel group size (must stay 1 until the zoo does TP).
        save_distributed_checkpoint: each rank saves its own shard (DCP) rather than one full file.
        host_mmap_threshold_mb: on CPU ranks, host allocations of at least this many MiB get their own
            mapping, returned to the OS when freed (`zoo.host_memory`): FSDP2's gather and reduce buffers
            otherwise fragment glibc's heap, which held more than the rank's sharded training state
            (docs/scale.md). None: glibc's default (a dynamic threshold). GPU ranks are left as they are.
    """

    def __init__(
        self,
        data_parallel_size: int | Literal["auto"] = "auto",
        tensor_parallel_size: int = 1,
        save_distributed_checkpoint: bool = True,
        host_mmap_threshold_mb: int | None = 4,
    ) -> None:
        super().__init__(data_parallel_size, tensor_parallel_size, save_distributed_checkpoint)
        self.host_mmap_threshold_mb = host_mmap_threshold_mb

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes // self._tensor_parallel_size
        super().setup_environment()
        if self.host_mmap_threshold_mb is not None and self.root_device.type == "cpu":
            return_large_blocks_to_os(self.host_mmap_threshold_mb)  # in every rank's own process


def high_precision_linears(model: UnifiedModel) -> set[nn.Module]:
    """Linear layers that stay in high precision whatever their shape: router gates (tiny, and routing
    decisions are sensitive to rounding), the text, NFSP and NCP output layers and the MTP projections
    (the logits and the first op of each MTP module, which DeepSeek-V3 also keeps in BF16), and every
    linear of the frozen visual tokenizer and audio codec."""
    keep: set[nn.Module] = {model.text_head.output}
    keep.update(m.gate for m in model.modules() if isinstance(m, Router))
    keep.update(module.proj for module in model.text_head.mtp)
    # Media heads' logits likewise; the frozen tokenizers are never trained, so FP8 training buys nothing
    # there and would only perturb the codes the model learns from.
    if model.nfsp is not None:
        keep.add(model.nfsp.head)
        keep.update(m for m in model.nfsp.tokenizer.modules() if isinstance(m, nn.Linear))
    if model.ncp is not None:
        keep.update(model.ncp.heads)
        keep.update(m for m in model.ncp.codec.modules() if isinstance(m, nn.Linear))
    return keep


def fp8_module_filter(model: UnifiedModel):  # noqa: ANN201 (torchao's (module, fqn) -> bool callable)
    """The `module_filter_fn` of `convert_to_float8_training`: an `nn.Linear` whose in and out features
    are multiples of 16 and that is not in `high_precision_linears`. Embeddings are not linears, and the
    routed experts are stacked `nn.Parameter`s multiplied by grouped GEMMs (`fp8_experts` converts those)."""
    return fp8_linears_outside(high_precision_linears(model))


def fp8_linears_outside(keep: set[nn.Module]):  # noqa: ANN201 (torchao's (module, fqn) -> bool callable)
    """Admit a plain `nn.Linear` (not a subclass, such as `nn.MultiheadAttention`'s output projection) whose
    in and out features are multiples of 16, unless it is in `keep`: the one rule of every FP8 filter."""

    def admit(module: nn.Module, fqn: str) -> bool:
        return (
            type(module) is nn.Linear
            and module not in keep
            and module.in_features % FP8_DIM_MULTIPLE == 0
            and module.out_features % FP8_DIM_MULTIPLE == 0
        )

    return admit


def transformer_blocks(model: UnifiedModel) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute name, block) of every transformer block: the backbone's and the MTP modules'."""
    blocks = [(model.backbone.layers, str(i), block) for i, block in enumerate(model.backbone.layers)]
    blocks += [(module, "block", module.block) for module in model.text_head.mtp]
    return blocks


def materialization_device(mesh: DeviceMesh | None) -> torch.device:
    """Where a deferred model's parameters go: this rank's accelerator under a CUDA mesh, else the CPU."""
    if mesh is not None and mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def compile_blocks(model: UnifiedModel, backend: str = "inductor") -> None:
    """Regional compilation: each transformer block compiled in place (`nn.Module.compile`, so parameter
    names and state-dict keys stay as they are). The MoE's data-dependent dispatch breaks the graph where
    it must (fullgraph off); every block has the same code, so the layers share compiled graphs."""
    for _, _, block in transformer_blocks(model):
        if block._compiled_call_impl is None:  # not compiled yet
            block.compile(backend=backend)


def parallelize(model: UnifiedModel, config: Parallelism, mesh: DeviceMesh | None = None) -> UnifiedModel:
    """Apply `config` to `model` in place, in order: FP8, expert parallelism, activation checkpointing,
    compile, FSDP2, then materialise a model built under `zoo.meta_init.deferred_init`. The attention backend
    is set on the backbone. Idempotent: a step already applied (Lightning may call `configure_model` twice) is
    skipped.

    mesh: the device mesh of `ModelParallelStrategy` (`LightningModule.device_mesh`); FSDP shards over
    its "data_parallel" dimension.
    """
    # Read first: FP8, checkpointing and FSDP2 replace the Parameter objects (the names stay).
    plan = deferred_plan(model) if is_deferred(model) else None
    model.backbone.attention_backend = config.attention
    if config.fp8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

        if not any(isinstance(m, Float8Linear) for m in model.modules()):
            fp8 = Float8LinearConfig(enable_fsdp_float8_all_gather=config.fp8_all_gather)
            convert_to_float8_training(model, config=fp8, module_filter_fn=fp8_module_filter(model))
    if config.fp8_experts:  # the routed experts' stacked weights, which the linear conversion never sees
        from zoo.float8_experts import convert_experts_to_float8

        convert_experts_to_float8(model, mesh.device_type if mesh is not None else None)

    dp_mesh = data_parallel_mesh(config, mesh)  # refuses a mesh without FSDP, FSDP without a mesh, TP
    expert_dp_mesh = None
    if config.expert_parallel > 1 and not isinstance(model, FSDPModule):
        expert_dp_mesh = apply_expert_parallel(model, dp_mesh, config.expert_parallel)

    if config.activation_checkpointing:
        for parent, name, block in transformer_blocks(model):
            if not isinstance(block, CheckpointWrapper):
                # Non-reentrant: arbitrary outputs (RouterOutput) and no requirement that inputs need grad.
                # The recomputed router adds its load a second time, to calls_available as well, so the
                # per-call load rates that steer the aux-free bias are unchanged.
                setattr(parent, name, checkpoint_wrapper(block))

    if config.compile:
        compile_blocks(model, config.compile_backend)

    if dp_mesh is not None:
        if not isinstance(model, FSDPModule):
            if expert_dp_mesh is not None:  # first, so each block's fully_shard leaves the experts to theirs
                fully_shard_local_experts(model, expert_dp_mesh, gradient_divide_factor=dp_mesh.size())
            for _, _, block in transformer_blocks(model):
                fully_shard(block, mesh=dp_mesh)
            fully_shard(model, mesh=dp_mesh)
    if plan is not None:
        materialize(model, plan, materialization_device(mesh))
    return model


def data_parallel_mesh(config: Parallelism, mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The mesh FSDP2 shards over under `config` (None: no sharding), refusing what the zoo cannot do: ranks
    without FSDP (ModelParallelStrategy reduces no gradient itself), FSDP without a mesh, tensor parallelism.
    `parallelize` and the stages that shard along a `zoo.tasks.sharding.ShardingPlan` both start here."""
    if mesh is not None and mesh.size() > 1 and not config.fsdp:
        # ModelParallelStrategy does not wrap the model in DDP: without FSDP no gradient would be reduced.
        raise ValueError(
            f"a device mesh of {mesh.size()} processes but Parallelism(fsdp=False): the ranks would train "
            "apart; set `parallel.fsdp: true` (configs/strategy/fsdp.yaml) or use DDP"
        )
    if not config.fsdp:
        return None
    if mesh is None:
        raise ValueError(
            "Parallelism(fsdp=True) needs a device mesh: train with "
            "lightning.pytorch.strategies.ModelParallelStrategy or zoo.parallel.FSDP2Strategy"
        )
    names = mesh.mesh_dim_names or ()
    if "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            f"tensor_parallel_size={mesh['tensor_parallel'].size()}: the zoo does not do tensor "
            "parallelism yet; set tensor_parallel_size=1 (zoo.parallel.FSDP2Strategy does)"
        )
    return mesh["data_parallel"] if "data_parallel" in names else mesh


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A plain state dict: FSDP2 DTensors gathered (every rank must call), wrapper prefixes removed
    (activation checkpointing, torch.compile)."""
    state = {}
    for key, value in model.state_dict().items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        key = key.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        state[key] = value.detach()
    return state


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 has sharded `model` (its parameters are DTensors)."""
    return isinstance(model, FSDPModule)


@contextmanager
def gathered(model: nn.Module) -> Iterator[nn.Module]:
    """Generation calls the embedder, backbone blocks and head directly, not the root's forward, so the
    root's own parameters (embeddings, head, final norm) must be gathered by hand; each block gathers
    its own in its forward hook. Every rank must enter together. A no-op for an unsharded model."""
    if not isinstance(model, FSDPModule):
        yield model
        return
    model.unshard()
    try:
        yield model
    finally:
        model.reshard()


__all__ = [
    "FSDP2Strategy",
    "compile_blocks",
    "data_parallel_mesh",
    "full_state_dict",
    "materialization_device",
    "Parallelism",
    "fp8_linears_outside",
    "fp8_module_filter",
    "gathered",
    "high_precision_linears",
    "is_sharded",
    "parallelize",
    "transformer_blocks",
]
