"""Elastic training (ERNIE 5.0, "elastic depth, width and sparsity"): one set of weights, many sub-models.

Per training step an `ElasticSampler` draws a configuration: the full depth with p=0.75, else a
random subset of layers; all experts with p=0.8, else a random subset (masked in the router); the
default top-k with p=0.8, else a smaller one. The backbone runs the chosen sub-model; `extract`
then builds a standalone smaller model from any configuration, with the dropped layers and experts
physically removed, whose outputs equal the full model run with that configuration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from zoo.config import Configurable


@dataclass(frozen=True)
class ElasticConfig:
    """A sub-model: which layers run, which routed experts exist, how many experts each token uses.

    `None` means "all" (layers, experts) or "the model's default" (top_k).
    """

    layers: tuple[int, ...] | None = None
    experts: tuple[int, ...] | None = None
    top_k: int | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "experts"):
            value = getattr(self, name)
            if value is not None:
                if len(value) == 0:
                    raise ValueError(f"ElasticConfig.{name} must keep at least one entry")
                if list(value) != sorted(set(value)):
                    raise ValueError(f"ElasticConfig.{name} must be sorted and unique, got {value}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"ElasticConfig.top_k must be >= 1, got {self.top_k}")
        if self.top_k is not None and self.experts is not None and self.top_k > len(self.experts):
            raise ValueError(f"top_k={self.top_k} exceeds the {len(self.experts)} kept experts")

    @property
    def is_full(self) -> bool:
        return self.layers is None and self.experts is None and self.top_k is None

    def expert_mask(self, n_experts: int, device: torch.device | None = None) -> Tensor | None:
        """`[E]` bool, False for dropped experts; None when all experts are kept."""
        if self.experts is None:
            return None
        if max(self.experts) >= n_experts:
            raise ValueError(f"expert index {max(self.experts)} out of range for {n_experts} experts")
        mask = torch.zeros(n_experts, dtype=torch.bool, device=device)
        mask[list(self.experts)] = True
        return mask

    def describe(self, n_layers: int, n_experts: int, top_k: int) -> str:
        depth = n_layers if self.layers is None else len(self.layers)
        width = n_experts if self.experts is None else len(self.experts)
        k = top_k if self.top_k is None else self.top_k
        return f"depth {depth}/{n_layers}, experts {width}/{n_experts}, top-k {k}/{top_k}"

    @classmethod
    def from_fractions(
        cls,
        n_layers: int,
        n_experts: int,
        top_k: int,
        depth: float = 1.0,
        width: float = 1.0,
        topk: float = 1.0,
    ) -> ElasticConfig:
        """A named sub-model by fractions: the first `depth` of layers (always keeping the last), the first
        `width` of experts, `topk` of the default top-k (at least 1). Used for evaluation grids and export."""
        for name, value in (("depth", depth), ("width", width), ("topk", topk)):
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} fraction must lie in (0, 1], got {value}")
        n_keep = max(1, round(depth * n_layers))
        layers = None if n_keep == n_layers else tuple(range(n_keep - 1)) + (n_layers - 1,)
        e_keep = max(1, round(width * n_experts))
        experts = None if e_keep == n_experts else tuple(range(e_keep))
        k = min(max(1, round(topk * top_k)), e_keep)
        return cls(layers=layers, experts=experts, top_k=None if k == top_k else k)


class ElasticSampler(Configurable):
    """Draws one `ElasticConfig` per training step, reproducibly from (seed, step).

    Args:
        p_full_depth: probability of running every layer (paper: 0.75).
        p_full_width: probability of keeping every routed expert (paper: 0.8).
        p_full_topk: probability of the default top-k (paper: 0.8).
        min_depth_fraction: the smallest fraction of layers a reduced depth keeps.
        min_width_fraction: the smallest fraction of experts a reduced width keeps.
        min_top_k: the smallest top-k a reduced sparsity uses.
        seed: the draws are a pure function of (seed, step), so a resumed run draws the same sub-models.
    """

    def __init__(
        self,
        p_full_depth: float = 0.75,
        p_full_width: float = 0.8,
        p_full_topk: float = 0.8,
        min_depth_fraction: float = 0.5,
        min_width_fraction: float = 0.5,
        min_top_k: int = 1,
        seed: int = 0,
    ) -> None:
        for name, p in (
            ("p_full_depth", p_full_depth),
            ("p_full_width", p_full_width),
            ("p_full_topk", p_full_topk),
        ):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must be a probability, got {p}")
        self.p_full_depth = p_full_depth
        self.p_full_width = p_full_width
        self.p_full_topk = p_full_topk
        self.min_depth_fraction = min_depth_fraction
        self.min_width_fraction = min_width_fraction
        self.min_top_k = min_top_k
        self.seed = seed

    def sample(self, step: int, n_layers: int, n_experts: int, top_k: int) -> ElasticConfig:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        uniform = lambda: float(torch.rand((), generator=g))  # noqa: E731

        layers = None
        min_layers = max(2, math.ceil(self.min_depth_fraction * n_layers))
        if uniform() >= self.p_full_depth and n_layers > min_layers:
            n_keep = int(torch.randint(min_layers, n_layers, (), generator=g))
            # The first and last layers stay: the first reads raw embeddings, the last writes for the heads.
            middle = torch.randperm(n_layers - 2, generator=g)[: n_keep - 2] + 1
            layers = tuple(sorted([0, n_layers - 1, *middle.tolist()]))

        experts = None
        min_experts = max(top_k, math.ceil(self.min_width_fraction * n_experts))
        if uniform() >= self.p_full_width and n_experts > min_experts:
            e_keep = int(torch.randint(min_experts, n_experts, (), generator=g))
            experts = tuple(sorted(torch.randperm(n_experts, generator=g)[:e_keep].tolist()))

        k = None
        if uniform() >= self.p_full_topk and top_k > self.min_top_k:
            k = int(torch.randint(self.min_top_k, top_k, (), generator=g))
        return ElasticConfig(layers=layers, experts=experts, top_k=k)
