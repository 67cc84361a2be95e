"""Ultra-sparse, modality-agnostic mixture of experts (ERNIE 5.0 report, MoE section; REFERENCES.md 2.8).

The router reads the hidden state and nothing else: there is no modality id, so any specialisation by
modality has to emerge from the data. Balancing is either a Switch-style auxiliary loss or DeepSeek-V3's
aux-loss-free bias, which only changes which experts are selected, never the gate weights. Elastic
training (REFERENCES.md 2.11) is served by a per-call `top_k`, an `expert_mask` that removes experts from
the softmax, and `extract()`, which builds a smaller standalone layer holding only the kept experts.
RL router replay forces the recorded expert sets while the gate weights come from the live router.

One ablation breaks the agnosticism on purpose: `ModalityPools` (ERNIE 4.5's modality-isolated routing) gives
each modality its own pool of routed experts. The router still reads only the hidden state and takes no
modality; the backbone turns the pools into a per-token `[N, E]` `expert_mask` that removes other pools'
experts from the softmax, as the `[E]` mask of elastic width does. Without pools nothing of this runs.

Dispatch is dropless: token-assignments are sorted by expert, gathered once, multiplied by every expert's
weights in one grouped matrix product per projection, and gathered back through the inverse permutation.
Under expert parallelism (`zoo.expert_parallel`) the `Experts` module's weights are this rank's slice and
hooks around its forward send the sorted rows to the ranks holding their experts and bring the outputs back;
the layer only has to take the sorted path on every rank (`Experts.exchanges_tokens`), so that every rank
joins every exchange.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

ScoreFunc = Literal["softmax", "sigmoid"]
Balancing = Literal["aux_loss", "aux_free", "none"]

_INIT_STD = 0.02
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class SwiGLU(nn.Module):
    """Dense SwiGLU feed-forward: w2(silu(w1 x) * w3 x). Dense layers and shared experts use it."""

    def __init__(self, dim: int, hidden: int) -> None:
        """
        Args:
            dim: model width (input and output size).
            hidden: inner width of the gated projection.
        """
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        for linear in (self.w1, self.w3, self.w2):
            nn.init.normal_(linear.weight, std=_INIT_STD)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


@dataclass
class RouterOutput:
    """What the router decided for N tokens (losses already multiplied by their coefficients)."""

    indices: Tensor  # [N, k] long, chosen experts
    weights: Tensor  # [N, k] gate weights, dtype of x
    probs: Tensor  # [N, E] float32 scores after softmax/sigmoid, dropped experts 0
    aux_loss: Tensor  # scalar, coef * E_active * sum_i f_i P_i (0 unless balancing == "aux_loss")
    z_loss: Tensor  # scalar, coef * mean(logsumexp(logits)^2)
    load: Tensor  # [E] float32, detached: token-assignments per expert in this call


@dataclass(frozen=True)
class ModalityPools:
    """Modality-isolated routing (ERNIE 4.5 heterogeneous MoE), the ablation of ERNIE 5.0's agnostic router.

    Each field lists the routed experts that tokens of that `zoo.batch.Modality` may choose; shared experts
    stay shared. Modalities that share a pool give the same list (e.g. image, video, audio and context all
    on the "vision/audio" experts). The distinct pools must partition the routed experts 0..E-1 and each
    hold at least top_k experts (`check`). An empty list means the modality is not expected: a token of it
    is an error.
    """

    text: tuple[int, ...] = ()
    image: tuple[int, ...] = ()
    video: tuple[int, ...] = ()
    audio: tuple[int, ...] = ()
    context: tuple[int, ...] = ()

    @classmethod
    def split(cls, n_experts: int, n_text: int) -> ModalityPools:
        """Experts 0..n_text-1 for text, the rest for every other modality (the usual two-pool split)."""
        other = tuple(range(n_text, n_experts))
        return cls(tuple(range(n_text)), other, other, other, other)

    def pools(self) -> list[tuple[int, ...]]:
        """The distinct non-empty pools, in field order."""
        out: list[tuple[int, ...]] = []
        for name in ("text", "image", "video", "audio", "context"):
            pool = tuple(getattr(self, name))
            if pool and pool not in out:
                out.append(pool)
        return out

    def check(self, n_experts: int, top_k: int) -> None:
        """Raise a ValueError naming the problem unless the pools partition 0..n_experts-1, >= top_k each."""
        pools = self.pools()
        if not pools:
            raise ValueError("modality_pools gives no modality any expert: expected at least one pool")
        seen: dict[int, int] = {}
        for p, pool in enumerate(pools):
            if len(set(pool)) != len(pool):
                raise ValueError(f"modality_pools: pool {list(pool)} repeats an expert")
            bad = [e for e in pool if not 0 <= e < n_experts]
            if bad:
                raise ValueError(
                    f"modality_pools: experts {bad} out of range: expected ids in [0, {n_experts})"
                )
            if len(pool) < top_k:
                raise ValueError(
                    f"modality_pools: pool {list(pool)} has {len(pool)} experts, fewer than top_k={top_k}"
                )
            for e in pool:
                if e in seen:
                    raise ValueError(
                        f"modality_pools: expert {e} is in two different pools ({list(pools[seen[e]])} and "
                        f"{list(pool)}): modalities share a pool only by giving the same list"
                    )
                seen[e] = p
        missing = sorted(set(range(n_experts)) - set(seen))
        if missing:
            raise ValueError(
                f"modality_pools leaves experts {missing} in no pool: the pools must partition all "
                f"n_experts={n_experts} routed experts"
            )

    def pool_of_expert(self, n_experts: int) -> list[int]:
        """The index (into `pools()`) of each routed expert's pool."""
        pool_of = [0] * n_experts
        for p, pool in enumerate(self.pools()):
            for e in pool:
                pool_of[e] = p
        return pool_of

    def table(self, n_experts: int, n_modalities: int) -> Tensor:
        """`[n_modalities, E]` bool indexed by `Modality` value: row m says which experts m may choose.
        Row 0 (padding) and the rows of modalities without a pool are all False."""
        table = torch.zeros(n_modalities, n_experts, dtype=torch.bool)
        for m, name in enumerate(("text", "image", "video", "audio", "context"), start=1):
            if m < n_modalities and getattr(self, name):
                table[m, list(getattr(self, name))] = True
        return table

    def remap(self, keep_experts: list[int]) -> ModalityPools:
        """The pools of a sub-model that keeps only `keep_experts` (renumbered 0..len-1, elastic extract)."""
        new_id = {e: i for i, e in enumerate(keep_experts)}
        fields = ("text", "image", "video", "audio", "context")
        return ModalityPools(*(tuple(new_id[e] for e in getattr(self, f) if e in new_id) for f in fields))


def expert_mask_of(keep_experts: list[int], n_experts: int, device: torch.device | None = None) -> Tensor:
    """The [n_experts] bool mask that keeps exactly `keep_experts` (the elastic-width mask)."""
    _check_keep(keep_experts, n_experts)
    mask = torch.zeros(n_experts, dtype=torch.bool, device=device)
    mask[torch.tensor(keep_experts, dtype=torch.long, device=device)] = True
    return mask


def _check_keep(keep_experts: list[int], n_experts: int) -> None:
    if len(keep_experts) == 0:
        raise ValueError("keep_experts is empty: expected at least one expert index")
    if len(set(keep_experts)) != len(keep_experts):
        raise ValueError(f"keep_experts has duplicates: {keep_experts}")
    bad = [e for e in keep_experts if not 0 <= e < n_experts]
    if bad:
        raise ValueError(f"keep_experts {bad} out of range: expected indices in [0, {n_experts})")


class Router(nn.Module):
    """Top-k router over the hidden state alone; softmax or sigmoid scores, aux-loss or bias balancing."""

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        score_func: ScoreFunc = "softmax",
        balancing: Balancing = "aux_loss",
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 1e-3,
        route_scale: float = 1.0,
        renormalize: bool = True,
    ) -> None:
        """
        Args:
            dim: width of the hidden state (the router's only input).
            n_experts: number of routed experts E.
            top_k: experts per token by default; `forward(top_k=...)` overrides it (elastic top-k).
            score_func: "softmax" (Mixtral/OLMoE) or "sigmoid" (DeepSeek-V3).
            balancing: "aux_loss" (Switch loss), "aux_free" (DeepSeek-V3 selection bias) or "none".
            aux_loss_coef: multiplier of the balancing loss.
            z_loss_coef: multiplier of the router z-loss (ST-MoE; OLMoE uses 1e-3).
            route_scale: factor on the gate weights (DeepSeek-V3 uses 2.5 with sigmoid).
            renormalize: softmax only: renormalise the chosen probabilities to sum to 1
                (sigmoid weights are always normalised over the chosen experts, as in DeepSeek-V3).
        """
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func={score_func!r}: expected 'softmax' or 'sigmoid'")
        if balancing not in ("aux_loss", "aux_free", "none"):
            raise ValueError(f"balancing={balancing!r}: expected 'aux_loss', 'aux_free' or 'none'")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k}: expected 1 <= top_k <= n_experts={n_experts}")
        self.dim = dim
        self.n_experts = n_experts
        self.top_k = top_k
        self.score_func = score_func
        self.balancing = balancing
        self.aux_loss_coef = aux_loss_coef
        self.z_loss_coef = z_loss_coef
        self.route_scale = route_scale
        self.renormalize = renormalize
        self.gate = nn.Linear(dim, n_experts, bias=False)
        nn.init.normal_(self.gate.weight, std=_INIT_STD)
        self.register_buffer("expert_bias", torch.zeros(n_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(n_experts), persistent=False)
        # In how many routing calls each expert could be chosen (elastic width drops some for a step).
        self.register_buffer("calls_available", torch.zeros(n_experts), persistent=False)
        # Modality-isolated routing only (`set_pools`): each expert's pool, so the bias balances within it.
        self.expert_pool: Tensor | None = None

    def set_pools(self, pool_of_expert: list[int] | None) -> None:
        """Balance the aux-free bias within expert pools (modality-isolated routing); None: all experts."""
        if pool_of_expert is None:
            self.expert_pool = None
            return
        if len(pool_of_expert) != self.n_experts:
            raise ValueError(f"pool_of_expert has {len(pool_of_expert)} entries: expected {self.n_experts}")
        self.expert_pool = torch.tensor(pool_of_expert, dtype=torch.long, device=self.expert_bias.device)

    def forward(
        self,
        x: Tensor,
        top_k: int | None = None,
        expert_mask: Tensor | None = None,
        forced_indices: Tensor | None = None,
    ) -> RouterOutput:
        """Route x [N, D]. `expert_mask` [E] bool (False = dropped; elastic width) or [N, E] (the experts
        each token may choose: modality-isolated routing); `forced_indices` [N, k] replays sets."""
        if x.dim() != 2 or x.shape[-1] != self.dim:
            raise ValueError(f"router input has shape {tuple(x.shape)}: expected [N, {self.dim}]")
        n_tokens, n_experts = x.shape[0], self.n_experts
        n_active = n_experts
        if expert_mask is not None:
            n_active = self._check_mask(expert_mask, n_tokens)
        k = self.top_k if top_k is None else top_k
        if forced_indices is not None:
            k = self._check_forced(forced_indices, n_tokens, top_k, expert_mask)
        if not 1 <= k <= n_active:
            if expert_mask is not None and expert_mask.dim() == 2:
                raise ValueError(
                    f"top_k={k}: a token may choose only {n_active} experts of its modality's pool (after "
                    "elastic width dropped some): with modality_pools, keep every expert (ElasticSampler "
                    "p_full_width=1.0) or at least top_k of each pool"
                )
            raise ValueError(f"top_k={k}: expected 1 <= top_k <= number of kept experts ({n_active})")

        logits = self.gate(x).float()
        if expert_mask is not None:
            logits = logits.masked_fill(~expert_mask, float("-inf"))
        # The balancing losses only matter with gradients; decoding skips them (they are a third of its ops).
        with_losses = torch.is_grad_enabled()
        zero = logits.new_zeros(())
        z_loss = self.z_loss_coef * torch.logsumexp(logits, dim=-1).square().mean() if with_losses else zero
        if self.score_func == "softmax":
            probs = logits.softmax(dim=-1)
        else:
            probs = torch.sigmoid(logits)  # sigmoid(-inf) = 0 for dropped experts

        if forced_indices is not None:
            indices = forced_indices
        else:
            select = probs + self.expert_bias if self.balancing == "aux_free" else probs.clone()
            if expert_mask is not None:
                select.masked_fill_(~expert_mask, float("-inf"))
            indices = _top_k_indices(select, k)
        chosen = probs.gather(1, indices)
        if self.score_func == "sigmoid" or self.renormalize:
            chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20)
        weights = (chosen * self.route_scale).to(x.dtype)

        # Counted by a scatter-add, not bincount, whose output shape depends on the data (a graph break
        # under torch.compile); the counts are small integers, exact in float32 in any order.
        flat = indices.reshape(-1)
        load = logits.new_zeros(n_experts).index_add_(0, flat, logits.new_ones(flat.shape))
        if self.training:
            self.tokens_per_expert += load
            self.calls_available += 1.0 if expert_mask is None else self._available(expert_mask)
        if self.balancing == "aux_loss" and with_losses:
            aux_loss = self._aux_loss(probs, load, n_tokens * k, n_active)
        else:
            aux_loss = zero
        return RouterOutput(indices, weights, probs, aux_loss, z_loss, load)

    def _aux_loss(self, probs: Tensor, load: Tensor, n_assignments: int, n_active: int) -> Tensor:
        # f_i sums to 1 over experts (a fraction of assignments, not of tokens), so perfectly uniform
        # routing gives exactly 1 for any top-k: the factor-K convention question of allenai/OLMoE#45.
        if self.score_func == "sigmoid":
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        fraction = load / max(n_assignments, 1)
        return self.aux_loss_coef * n_active * (fraction * probs.mean(dim=0)).sum()

    def _check_forced(
        self, forced: Tensor, n_tokens: int, top_k: int | None, expert_mask: Tensor | None
    ) -> int:
        if forced.dim() != 2 or forced.shape[0] != n_tokens or forced.dtype != torch.long:
            raise ValueError(
                f"forced_indices has shape {tuple(forced.shape)} and dtype {forced.dtype}: "
                f"expected [N={n_tokens}, k] long"
            )
        k = forced.shape[1]
        if top_k is not None and top_k != k:
            raise ValueError(f"top_k={top_k} disagrees with forced_indices, which has k={k} experts a token")
        if forced.numel() and (int(forced.min()) < 0 or int(forced.max()) >= self.n_experts):
            raise ValueError(f"forced_indices out of range: expected expert ids in [0, {self.n_experts})")
        if k > 1 and bool((forced.sort(dim=-1).values.diff(dim=-1) == 0).any()):
            raise ValueError("forced_indices repeats an expert within a token: expected k distinct experts")
        if expert_mask is not None:
            allowed = expert_mask[forced] if expert_mask.dim() == 1 else expert_mask.gather(1, forced)
        if expert_mask is not None and not bool(allowed.all()):
            raise ValueError("forced_indices selects an expert that expert_mask drops")
        return k

    def _check_mask(self, mask: Tensor, n_tokens: int) -> int:
        """The fewest experts any token may choose under `mask` ([E] or [N, E] bool)."""
        e = self.n_experts
        if mask.dtype != torch.bool or mask.shape not in ((e,), (n_tokens, e)):
            raise ValueError(
                f"expert_mask has shape {tuple(mask.shape)} and dtype {mask.dtype}: "
                f"expected a [{e}] (or per token [N={n_tokens}, {e}]) bool tensor"
            )
        if mask.dim() == 1:
            n_active = int(mask.sum())
        else:
            n_active = int(mask.sum(dim=-1).min()) if n_tokens else e
        if n_active == 0:
            raise ValueError("expert_mask drops every expert (of a token): expected at least one True")
        return n_active

    @staticmethod
    def _available(mask: Tensor) -> Tensor:
        # A per-token mask: an expert was available in this call if any token could choose it.
        return (mask if mask.dim() == 1 else mask.any(dim=0)).float()

    @torch.no_grad()
    def update_bias(self, gamma: float) -> Tensor:
        """DeepSeek-V3 bias step b_i += gamma * sign(mean_load - load_i), re-centred to mean 0.

        Uses the loads accumulated since the last call (summed over ranks when torch.distributed is
        initialised, as Megatron's get_updated_expert_bias does), then resets them. Returns that load.
        The mean is subtracted afterwards because only differences between biases change the selection
        and an unanchored mean drifts (pytorch/torchtitan#1506). No-op unless balancing == "aux_free".
        """
        if self.balancing != "aux_free":
            return self.tokens_per_expert.clone()
        load, available = self.tokens_per_expert.clone(), self.calls_available.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(load)
            dist.all_reduce(available)
        # Compare experts by load per call in which they could be chosen: an expert that elastic width
        # dropped for a step is neither rewarded for its zero load then nor penalised for it.
        seen = available > 0
        if bool(seen.any()):
            rate = load / available.clamp_min(1.0)
            step = torch.sign(self._mean_rate(rate, seen) - rate) * seen
            self.expert_bias += gamma * step
            self.expert_bias -= self.expert_bias.mean()
        self.tokens_per_expert.zero_()
        self.calls_available.zero_()
        return load

    def _mean_rate(self, rate: Tensor, seen: Tensor) -> Tensor:
        """The mean rate each expert is compared with: of all experts, or of its own pool (isolated routing:
        pools see different token counts, so a global mean would push a whole pool's biases together)."""
        if self.expert_pool is None:
            return rate[seen].mean()
        pool = self.expert_pool.to(rate.device)
        n_pools = int(pool.max()) + 1
        total = rate.new_zeros(n_pools).index_add_(0, pool, rate * seen)
        count = rate.new_zeros(n_pools).index_add_(0, pool, seen.float())
        return (total / count.clamp_min(1.0))[pool]


def _grouped_mm_ok(x: Tensor, w: Tensor) -> bool:
    # torch._grouped_mm wants 16-byte aligned rows; its meta kernel (used by torch.compile) is bf16-only.
    if not hasattr(torch, "_grouped_mm") or x.dtype not in _GROUPED_MM_DTYPES or x.device.type == "meta":
        return False
    if (x.shape[-1] * x.element_size()) % 16 or (w.shape[-1] * w.element_size()) % 16:
        return False
    return x.dtype == torch.bfloat16 or not torch.compiler.is_compiling()


def grouped_matmul(x: Tensor, w: Tensor, counts: Tensor, offsets: Tensor) -> Tensor:
    """Rows of x [M, K] sorted by group, times w [G, K, N] of their group: [M, N].

    `counts` [G] long rows per group and `offsets` their int32 cumulative sum. Uses torch._grouped_mm
    when it accepts the inputs, else one batched product over rows padded to the largest group.
    """
    if _grouped_mm_ok(x, w):
        return torch._grouped_mm(x, w, offs=offsets)
    n_groups = w.shape[0]
    group = torch.repeat_interleave(torch.arange(n_groups, device=x.device), counts, output_size=x.shape[0])
    row_in_group = torch.arange(x.shape[0], device=x.device) - (offsets - counts)[group]
    padded = x.new_zeros(n_groups, int(counts.max()) if x.shape[0] else 0, x.shape[1])
    padded = padded.index_put((group, row_in_group), x)
    return torch.bmm(padded, w)[group, row_in_group]


class _Dispatch(torch.autograd.Function):
    """x [N, D] -> rows x[token] in expert order; backward gathers and sums instead of scattering."""

    @staticmethod
    def forward(ctx, x: Tensor, token: Tensor, inverse: Tensor, k: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, token)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        return _combine(grad, inverse, ctx.k), None, None, None


class _Combine(torch.autograd.Function):
    """Expert-ordered rows [N*k, D] -> per-token sums [N, D]; the adjoint of _Dispatch."""

    @staticmethod
    def forward(ctx, rows: Tensor, token: Tensor, inverse: Tensor, k: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(token)
        return _combine(rows, inverse, k)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        (token,) = ctx.saved_tensors
        return grad.index_select(0, token), None, None, None


def _combine(rows: Tensor, inverse: Tensor, k: int) -> Tensor:
    # inverse is slot-major ([k, N] flattened), so the k copies of a token are k contiguous blocks:
    # adding blocks is about 3x faster on CPU than sum(dim=1) over an interleaved [N, k, D] view.
    gathered = rows.index_select(0, inverse)
    if k == 1:
        return gathered
    parts = gathered.view(k, -1, rows.shape[-1])
    out = parts[0] + parts[1]
    for j in range(2, k):
        out += parts[j]
    return out


def _top_k_indices(scores: Tensor, k: int) -> Tensor:
    """Indices of the k largest scores per row (any order); scores may be overwritten."""
    if k > 4:
        return scores.topk(k, dim=-1, sorted=False).indices
    # For small k, repeated argmax beats torch.topk on CPU (1.2 ms against 3.0 ms for [4096, 64], k = 2).
    picks = []
    for j in range(k):
        pick = scores.argmax(dim=-1, keepdim=True)
        picks.append(pick)
        if j + 1 < k:
            scores.scatter_(1, pick, float("-inf"))
    return torch.cat(picks, dim=1)


class Experts(nn.Module):
    """E fine-grained SwiGLU experts with stacked weights w1, w3 [E, D, H] and w2 [E, H, D]."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        """
        Args:
            n_experts: number of experts E.
            dim: model width D.
            hidden: inner width H of each expert.
        """
        super().__init__()
        self.n_experts, self.dim, self.hidden = n_experts, dim, hidden
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=_INIT_STD)
        # Set by zoo.expert_parallel: the experts live on several ranks and their forward exchanges rows
        # with the others, so the MoE layer must call it on every rank, never its few-row shortcut.
        self.exchanges_tokens = False

    def local_weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """w1, w3, w2 of the experts this rank computes, in `dtype`: all of them, or under expert parallelism
        this rank's slice (the local part of a DTensor sharded over the expert-parallel mesh dimension)."""
        local = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w3, self.w2))
        return tuple(w.to(dtype) for w in local)  # type: ignore[return-value]

    def forward(self, x_sorted: Tensor, counts: Tensor, weights: Tensor | None = None) -> Tensor:
        """x_sorted [M, D] grouped by expert, counts [E] long rows per expert -> [M, D].

        `weights` [M] (optional) scales each row before w2, which equals scaling the output
        because w2 is linear, and touches H instead of D values per row.
        """
        # Under autocast x arrives in low precision while the weights stay fp32, as nn.Linear's would.
        w1, w3, w2 = self.local_weights(x_sorted.dtype)
        n_local = w1.shape[0]
        if counts.shape != (n_local,):
            raise ValueError(f"counts has shape {tuple(counts.shape)}: expected [{n_local}] (local experts)")
        if x_sorted.shape[0] < n_local:
            return self._few_rows(x_sorted, counts, weights, w1, w3, w2)
        offsets = counts.cumsum(0, dtype=torch.int32)
        gate = grouped_matmul(x_sorted, w1, counts, offsets)
        h = F.silu(gate) * grouped_matmul(x_sorted, w3, counts, offsets)
        if weights is not None:
            h = h * weights.unsqueeze(-1)
        return grouped_matmul(h, w2, counts, offsets)

    def _few_rows(
        self, x: Tensor, counts: Tensor, weights: Tensor | None, w1: Tensor, w3: Tensor, w2: Tensor
    ):
        """Fewer rows than experts (decoding): gather each row's expert weights, so the cost follows the
        rows and the top-k, not E (the grouped kernel on CPU visits every expert, empty or not)."""
        expert = torch.arange(len(counts), device=x.device).repeat_interleave(counts, output_size=len(x))
        return self._gathered(x, expert, weights, w1, w3, w2)

    def assigned(self, x: Tensor, expert: Tensor, weights: Tensor | None = None) -> Tensor:
        """Rows x [M, D] in any order, each through its own `expert` [M] (few rows: the MoE layer's
        unsorted decoding path), `weights` [M] scaling each row as in `forward`."""
        if self.exchanges_tokens:
            raise RuntimeError("Experts.assigned indexes all experts' weights: not under expert parallelism")
        w1, w3, w2 = self.local_weights(x.dtype)
        return self._gathered(x, expert, weights, w1, w3, w2)

    @staticmethod
    def _gathered(
        x: Tensor, expert: Tensor, weights: Tensor | None, w1: Tensor, w3: Tensor, w2: Tensor
    ) -> Tensor:
        rows = x.unsqueeze(1)
        h = F.silu(torch.bmm(rows, w1.index_select(0, expert))) * torch.bmm(rows, w3.index_select(0, expert))
        if weights is not None:
            h = h * weights.view(-1, 1, 1)
        return torch.bmm(h, w2.index_select(0, expert)).squeeze(1)


@dataclass
class MoEOutput:
    out: Tensor  # same shape as the input
    router: RouterOutput


class MoEFeedForward(nn.Module):
    """Routed fine-grained experts plus optional always-on shared experts (DeepSeekMoE layout)."""

    def __init__(
        self,
        dim: int,
        n_experts: int,
        expert_hidden: int,
        top_k: int,
        n_shared_experts: int = 0,
        score_func: ScoreFunc = "softmax",
        balancing: Balancing = "aux_loss",
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 1e-3,
        route_scale: float = 1.0,
        renormalize: bool = True,
    ) -> None:
        """
        Args:
            dim: model width D.
            n_experts: routed experts E.
            expert_hidden: inner width of one routed expert.
            top_k: routed experts per token by default.
            n_shared_experts: shared experts, merged into one SwiGLU of width n_shared * expert_hidden.
            score_func, balancing, aux_loss_coef, z_loss_coef, route_scale, renormalize: see Router.
        """
        super().__init__()
        if n_shared_experts < 0:
            raise ValueError(f"n_shared_experts={n_shared_experts}: expected >= 0")
        self.dim = dim
        self.expert_hidden = expert_hidden
        self.n_shared_experts = n_shared_experts
        self.router = Router(
            dim, n_experts, top_k, score_func, balancing, aux_loss_coef, z_loss_coef, route_scale, renormalize
        )
        self.experts = Experts(n_experts, dim, expert_hidden)
        self.shared = SwiGLU(dim, n_shared_experts * expert_hidden) if n_shared_experts > 0 else None

    def forward(
        self,
        x: Tensor,
        top_k: int | None = None,
        expert_mask: Tensor | None = None,
        forced_indices: Tensor | None = None,
    ) -> MoEOutput:
        """x [..., D] -> MoEOutput(out [..., D], router decisions for the flattened tokens).
        `expert_mask`: [E], or [N, E] per flattened token (modality-isolated routing); see Router."""
        return self._route_and_run(x, top_k, expert_mask, forced_indices, gathered=False)

    def forward_gathered(
        self,
        x: Tensor,
        top_k: int | None = None,
        expert_mask: Tensor | None = None,
        forced_indices: Tensor | None = None,
    ) -> MoEOutput:
        """`forward`, each assignment through its own gathered expert weights whatever their count
        (`_few_assignments`): a static decode step, whose shapes must not follow how many rows each
        expert got (the sorted path's do). The same arithmetic per assignment; for a few rows only."""
        return self._route_and_run(x, top_k, expert_mask, forced_indices, gathered=True)

    def _route_and_run(
        self,
        x: Tensor,
        top_k: int | None,
        expert_mask: Tensor | None,
        forced_indices: Tensor | None,
        gathered: bool,
    ) -> MoEOutput:
        if x.shape[-1] != self.dim:
            raise ValueError(f"MoE input has width {x.shape[-1]}: expected {self.dim}")
        flat_x = x.reshape(-1, self.dim)
        routing = self.router(flat_x, top_k=top_k, expert_mask=expert_mask, forced_indices=forced_indices)
        n_tokens, k = routing.indices.shape
        # Under expert parallelism every rank must join the exchange in the sorted path, whatever its rows.
        few = gathered or n_tokens * k < self.experts.n_experts
        if few and not self.experts.exchanges_tokens:
            out = self._few_assignments(flat_x, routing)
            if self.shared is not None:
                out = out + self.shared(flat_x)
            return MoEOutput(out.view(x.shape), routing)
        # Assignments are numbered slot-major (j * N + n). The stable sort keeps each expert's rows in
        # a fixed order, so a masked model and its extract() feed every expert the same row blocks.
        order = routing.indices.t().reshape(-1).argsort(stable=True)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        token = order if k == 1 else order.remainder(n_tokens)
        rows = _Dispatch.apply(flat_x, token, inverse, k)
        row_weights = routing.weights.t().reshape(-1).index_select(0, order)
        rows = self.experts(rows, routing.load.long(), row_weights)
        out = _Combine.apply(rows, token, inverse, k)
        if self.shared is not None:
            out = out + self.shared(flat_x)
        return MoEOutput(out.view(x.shape), routing)

    def _few_assignments(self, flat_x: Tensor, routing: RouterOutput) -> Tensor:
        """Fewer assignments than experts (decoding): no sort, no dispatch and no inverse permutation.
        Each assignment, slot-major as in the sorted path, multiplies its own expert's gathered weights,
        and the k slots of a token are added in slot order: the sorted path's arithmetic, in fewer ops."""
        n_tokens, k = routing.indices.shape
        expert = routing.indices.t().reshape(-1)  # assignment j * N + n is token n's slot j
        rows = flat_x if k == 1 else flat_x.repeat(k, 1)
        out = self.experts.assigned(rows, expert, routing.weights.t().reshape(-1))
        parts = out.view(k, n_tokens, self.dim)
        combined = parts[0] if k == 1 else parts[0] + parts[1]
        for j in range(2, k):
            combined += parts[j]
        return combined

    def extract(self, keep_experts: list[int], top_k: int | None = None) -> MoEFeedForward:
        """A new standalone layer holding only `keep_experts` (copied weights), for elastic width.

        Its output equals self(x, top_k=top_k, expert_mask=expert_mask_of(keep_experts, E)).
        """
        router, experts = self.router, self.experts
        if experts.exchanges_tokens:
            raise ValueError(
                "extract() copies every expert's weights, but under expert parallelism a rank holds a slice: "
                "consolidate the checkpoint (zoo export) and extract from the full model"
            )
        _check_keep(keep_experts, router.n_experts)
        k = router.top_k if top_k is None else top_k
        if not 1 <= k <= len(keep_experts):
            raise ValueError(f"top_k={k}: expected 1 <= top_k <= len(keep_experts)={len(keep_experts)}")
        small = MoEFeedForward(
            self.dim,
            len(keep_experts),
            self.expert_hidden,
            k,
            self.n_shared_experts,
            router.score_func,
            router.balancing,
            router.aux_loss_coef,
            router.z_loss_coef,
            router.route_scale,
            router.renormalize,
        ).to(device=router.gate.weight.device, dtype=router.gate.weight.dtype)
        keep = torch.tensor(keep_experts, dtype=torch.long, device=router.gate.weight.device)
        with torch.no_grad():
            small.router.gate.weight.copy_(router.gate.weight.index_select(0, keep))
            small.router.expert_bias.copy_(router.expert_bias.index_select(0, keep))
            for name in ("w1", "w3", "w2"):
                getattr(small.experts, name).copy_(getattr(experts, name).index_select(0, keep))
            if self.shared is not None:
                small.shared.load_state_dict(self.shared.state_dict())
        return small
