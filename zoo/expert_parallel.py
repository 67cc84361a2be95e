"""Expert parallelism: each MoE layer's routed experts split over ranks, tokens sent to them by all-to-all
(issue 17 item 3; torchtitan's `ExpertParallel`, torchtitan/distributed/expert_parallel.py).

With `Parallelism(expert_parallel=ep)` the data-parallel ranks are grouped `ep` at a time: the mesh
`(expert_data_parallel, expert_parallel)` of size `(world / ep, ep)`, an unflattening of the data-parallel
dimension. Rank `r` of an expert-parallel group holds experts `r * E/ep .. (r + 1) * E/ep - 1` of each layer,
as a DTensor sharded on dim 0 over `expert_parallel`. The MoE layer routes its own tokens as before and sorts
the assignments by global expert; then, around the `Experts` forward (hooks of `distribute_module`, so the
model code keeps no collective):

1. dispatch: the per-expert counts are exchanged first (an all-to-all of E integers), which gives every
   rank the split sizes; then the sorted rows, each with its gate weight as one extra column, go to the
   rank holding their expert (`all_to_all_single_autograd`: uneven splits, differentiable);
2. the received rows, laid out by source rank, are reordered expert-major (`expert_major_order`) and run
   through the local experts with the existing grouped path;
3. combine: the inverse reorder and the reverse all-to-all bring every row back to the rank and position
   it came from; the MoE layer adds the k slots per token as it always does.

The backward of an all-to-all is the reverse all-to-all, so gradients reach the input, the router (through
the gate weights) and the experts on their own ranks; an expert's gradient sums every rank's tokens. FSDP2
then shards what EP leaves: the non-expert parameters over all data-parallel ranks, the local experts over
`expert_data_parallel`, with the gradient divided by the whole data-parallel size as for every other parameter
(torchtitan's `set_gradient_divide_factor`). Elastic width and top-k change only the counts; router replay
only the indices; the aux-free bias already all-reduces its loads over every rank.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor

from zoo.models.moe import Experts

EP_DIM, EXPERT_DP_DIM = "expert_parallel", "expert_data_parallel"


def expert_major_order(counts: Tensor) -> Tensor:
    """Rows received from each rank for each local expert, `counts` [ranks, local experts], arrive rank-major
    (all of rank 0's rows, expert by expert, then rank 1's); the indices that gather them expert-major (each
    expert's rows together, source ranks in order), the layout the grouped product needs."""
    flat = counts.reshape(-1)
    rank_major_start = (flat.cumsum(0) - flat).view_as(counts)
    block_counts = counts.t().reshape(-1)
    block_starts = rank_major_start.t().reshape(-1)
    total = int(block_counts.sum())
    expert_major_start = block_counts.cumsum(0) - block_counts
    shift = (block_starts - expert_major_start).repeat_interleave(block_counts, output_size=total)
    return torch.arange(total, device=counts.device) + shift


def inverse_permutation(order: Tensor) -> Tensor:
    """The indices that undo `order` (x[order][inverse] == x): a gather, whose backward is a scatter-add."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


class ExpertParallel:
    """Shards one `Experts` module over a 1-D expert-parallel mesh and exchanges its rows (module docstring).

    Attach with `apply(experts, ep_mesh)`. `sent_bytes` counts the payload this rank sent to other ranks in
    forward dispatches and combines since the last `reset_bytes()` (the backward, the reverse exchanges,
    sends as much again and is not counted).
    """

    def __init__(self) -> None:
        self.sent_bytes = 0
        self._splits: tuple[list[int], list[int]] | None = None  # (sent, received) rows per rank
        self._order: Tensor | None = None

    def apply(self, experts: Experts, mesh: DeviceMesh) -> None:
        if mesh.ndim != 1:
            raise ValueError(f"expert parallelism needs a 1-D mesh, got dims {mesh.mesh_dim_names}")
        if experts.n_experts % mesh.size():
            raise ValueError(
                f"{experts.n_experts} routed experts do not split over expert_parallel={mesh.size()} ranks: "
                "expected n_experts divisible by expert_parallel"
            )
        distribute_module(experts, mesh, self._partition, self._dispatch, self._combine)
        experts.exchanges_tokens = True
        experts.expert_parallel = self  # found again by `exchanged_bytes`

    @staticmethod
    def _partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in module.named_parameters(recurse=False):
            # src_data_rank=None: every rank built the same full weights (same seed), so each keeps its slice
            # without a broadcast; a meta parameter (deferred init) is sliced on meta, materialised later.
            sharded = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    def _dispatch(
        self, module: Experts, inputs: tuple, mesh: DeviceMesh
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        rows, counts, weights = (*inputs, None)[:3]
        ranks, group = mesh.size(), mesh.get_group()
        with torch.no_grad():
            received_counts = funcol.all_to_all_single(counts, None, None, group=group)
            received_counts = torch.ops._c10d_functional.wait_tensor(received_counts).view(ranks, -1)
            sent = counts.view(ranks, -1).sum(dim=1).tolist()
            received = received_counts.sum(dim=1).tolist()
        payload = rows if weights is None else torch.cat([rows, weights.to(rows.dtype).unsqueeze(-1)], dim=-1)
        self._count(payload, sent, mesh.get_local_rank())
        payload = funcol.all_to_all_single_autograd(payload, received, sent, group)
        order = expert_major_order(received_counts)
        payload = payload.index_select(0, order)
        self._splits, self._order = (sent, received), order
        local_counts = received_counts.sum(dim=0)
        if weights is None:
            return payload, local_counts, None
        return payload[:, :-1].contiguous(), local_counts, payload[:, -1].to(weights.dtype)

    def _combine(self, module: Experts, out: Tensor, mesh: DeviceMesh) -> Tensor:
        if self._splits is None or self._order is None:
            raise RuntimeError("ExpertParallel: a combine without its dispatch (broken experts hooks)")
        (sent, received), order = self._splits, self._order
        self._splits, self._order = None, None
        out = out.index_select(0, inverse_permutation(order))
        self._count(out, received, mesh.get_local_rank())
        return funcol.all_to_all_single_autograd(out, sent, received, mesh.get_group())

    def _count(self, payload: Tensor, splits: list[int], own_rank: int) -> None:
        # Rows for this rank itself stay in memory. A recomputation under activation checkpointing sends its
        # rows again, and is counted again.
        row_bytes = payload[0].numel() * payload.element_size() if len(payload) else 0
        self.sent_bytes += (sum(splits) - splits[own_rank]) * row_bytes

    def reset_bytes(self) -> None:
        self.sent_bytes = 0


def expert_meshes(dp_mesh: DeviceMesh, expert_parallel: int) -> tuple[DeviceMesh, DeviceMesh]:
    """(expert_parallel mesh, expert_data_parallel mesh) of this rank: the data-parallel dimension unflattened
    to (world / ep, ep), so consecutive ranks share their experts (on GPUs: inside one node, where the
    all-to-all is cheapest)."""
    world = dp_mesh.size()
    if world % expert_parallel:
        raise ValueError(
            f"expert_parallel={expert_parallel} does not divide the {world} data-parallel ranks: expected a "
            "divisor of the world size"
        )
    grid = dp_mesh._unflatten(0, (world // expert_parallel, expert_parallel), (EXPERT_DP_DIM, EP_DIM))
    return grid[EP_DIM], grid[EXPERT_DP_DIM]


def apply_expert_parallel(model: nn.Module, dp_mesh: DeviceMesh, expert_parallel: int) -> DeviceMesh:
    """Split the experts of every MoE layer of `model` over groups of `expert_parallel` data-parallel ranks.
    Returns the `expert_data_parallel` mesh, over which `fully_shard_local_experts` shards local experts."""
    ep_mesh, expert_dp_mesh = expert_meshes(dp_mesh, expert_parallel)
    if not shard_experts(model, ep_mesh):
        raise ValueError(f"expert_parallel={expert_parallel}, but the model has no MoE layer to split")
    return expert_dp_mesh


def fully_shard_local_experts(
    model: nn.Module, expert_dp_mesh: DeviceMesh, gradient_divide_factor: int
) -> None:
    """FSDP2 over what EP leaves: each layer's local experts sharded over `expert_dp_mesh` (the ranks holding
    the same experts). An expert's gradient already sums every rank's tokens (the all-to-all backward), so the
    reduction divides by the whole data-parallel size, as FSDP2 divides every other gradient."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, fully_shard

    # A divide factor other than the mesh size makes FSDP2 reduce-scatter with NCCL's PREMUL_SUM, which gloo
    # lacks: there, sum and scale apart (the same gradient, one more kernel).
    on_gloo = dist.get_backend(expert_dp_mesh.get_group()) == "gloo"
    for module in model.modules():
        if isinstance(module, Experts) and module.exchanges_tokens and not isinstance(module, FSDPModule):
            fully_shard(module, mesh=expert_dp_mesh)
            module.set_gradient_divide_factor(float(gradient_divide_factor))
            if on_gloo:
                module.set_force_sum_reduction_for_comms(True)


def shard_experts(model: nn.Module, ep_mesh: DeviceMesh) -> list[Experts]:
    """Give every `Experts` module of `model` its slice and the exchange hooks (idempotent); returns them."""
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    for module in experts:
        if not module.exchanges_tokens:
            ExpertParallel().apply(module, ep_mesh)
    return experts


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0) -> Tensor:
    """`torch.nn.utils.clip_grad_norm_` for gradients on several device meshes: under expert parallelism the
    local experts' are DTensors on (expert_data_parallel, expert_parallel) and the rest on data_parallel, and
    torch's version stacks the per-tensor norms of both (DTensor refuses mixed meshes; torchtitan clips EP
    models in the same two steps). Each mesh's norm is reduced over its own mesh, the norms are combined, and
    every gradient is scaled by the one coefficient. Returns the total norm (a plain tensor)."""
    groups: dict[DeviceMesh | None, list[Tensor]] = {}  # the parameters whose gradients live on each mesh
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    if not groups:
        return torch.zeros(())
    norms = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def exchanged_bytes(model: nn.Module, reset: bool = False) -> int:
    """Bytes this rank sent to other ranks in every MoE layer's forward all-to-alls (see ExpertParallel)."""
    total = 0
    for module in model.modules():
        style = getattr(module, "expert_parallel", None)
        if isinstance(style, ExpertParallel):
            total += style.sent_bytes
            if reset:
                style.reset_bytes()
    return total


__all__ = [
    "EP_DIM",
    "EXPERT_DP_DIM",
    "ExpertParallel",
    "apply_expert_parallel",
    "clip_grad_norm_",
    "exchanged_bytes",
    "expert_major_order",
    "expert_meshes",
    "fully_shard_local_experts",
    "inverse_permutation",
    "shard_experts",
]
