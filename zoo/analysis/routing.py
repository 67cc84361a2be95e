"""Routing statistics of a mixture of experts by modality (ERNIE 5.0 report, "expert routing analysis").

ERNIE 5.0's router never sees a modality, so whether experts specialise by modality is a question for the
trained model. This file answers it from counts alone: how many token-assignments each expert received,
per MoE layer and per modality (`RoutingCounts`, filled by `RoutingRecorder` from the router decisions of
forward passes). From the counts come the report's three measures:

- the share of each modality's assignments that each expert takes (the heatmaps);
- the IoU of two modalities' top-25% experts by load, per layer (1: the same experts, 0: disjoint);
- the normalised entropy NE = -sum_i p_i log p_i / log N of the expert load, per layer and per modality
  (1: perfectly even, 0: one expert takes everything).

The statistics are recorded beside routing, from the decisions the router already made: nothing here feeds
back into it. Plain PyTorch, no Lightning: `zoo.tasks.routing_monitor` logs these during training and
`zoo.analysis.command` runs them over a checkpoint.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from zoo.batch import GroupBatch, Modality
from zoo.models.backbone import BackboneOutput

TOP_FRACTION = 0.25  # the report's "top-25% experts"
ROUTED_MODALITIES = tuple(m for m in Modality if m != Modality.PAD)


def load_entropy(load: Tensor) -> Tensor:
    """NE of a load histogram (last dimension) as a tensor on its device: no host sync, for training steps
    (`zoo.tasks.pretrain.router_statistics`). An all-zero histogram gives 0; use `normalised_entropy` for
    checked input and NaN there."""
    p = load / load.sum(-1, keepdim=True).clamp_min(1e-12)
    return -(p * p.clamp_min(1e-12).log()).sum(-1) / math.log(max(load.shape[-1], 2))


def normalised_entropy(load: Tensor | Sequence[float]) -> float:
    """NE = -sum p_i log p_i / log N of a load histogram over N experts: 1 even, 0 a single expert.

    An empty histogram (no assignments) has no distribution: NaN. N = 1 gives 1 (nothing to balance).
    """
    load = torch.as_tensor(load, dtype=torch.float64)
    if load.dim() != 1 or load.numel() == 0:
        raise ValueError(f"load has shape {tuple(load.shape)}: expected a non-empty [N] histogram")
    if bool((load < 0).any()):
        raise ValueError("load has negative entries: expected assignment counts or shares >= 0")
    total = float(load.sum())
    if total == 0:
        return math.nan
    if load.numel() == 1:
        return 1.0
    return float(load_entropy(load))


def top_experts(load: Tensor | Sequence[float], fraction: float = TOP_FRACTION) -> set[int]:
    """The ceil(fraction * N) experts with the largest load (ties broken by the lower index).

    Experts with zero load are never "top": a modality that used only two experts has a top set of two.
    """
    load = torch.as_tensor(load, dtype=torch.float64)
    if load.dim() != 1 or load.numel() == 0:
        raise ValueError(f"load has shape {tuple(load.shape)}: expected a non-empty [N] histogram")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must lie in (0, 1], got {fraction}")
    k = math.ceil(fraction * load.numel())
    # A stable sort of the negated loads keeps the lower index first among equals.
    order = torch.argsort(-load, stable=True)[:k]
    return {int(e) for e in order if load[e] > 0}


def iou(a: set[int], b: set[int]) -> float:
    """|a & b| / |a | b|; NaN when both sets are empty (nothing to compare)."""
    union = a | b
    return len(a & b) / len(union) if union else math.nan


def chance_iou(n_experts: int, size_a: int, size_b: int) -> float:
    """The expected IoU of two independent uniformly random expert sets of these sizes (hypergeometric
    overlap): the level a top-expert IoU is compared with. 16 experts, 4 and 4: 0.158."""
    if not (0 <= size_a <= n_experts and 0 <= size_b <= n_experts):
        raise ValueError(f"set sizes {size_a}, {size_b} must lie in 0..n_experts={n_experts}")
    if size_a + size_b == 0:
        return math.nan
    total = math.comb(n_experts, size_b)
    expected = 0.0
    for i in range(max(0, size_a + size_b - n_experts), min(size_a, size_b) + 1):
        p = math.comb(size_a, i) * math.comb(n_experts - size_a, size_b - i) / total
        expected += p * i / (size_a + size_b - i)
    return expected


@dataclass
class RoutingCounts:
    """Token-assignments per (MoE layer, modality, expert), summed over the tokens seen.

    Attributes:
        layers: the backbone's indices of the MoE layers, in order.
        n_experts: routed experts per layer.
        counts: `[len(layers), len(Modality), n_experts]` int64, indexed by `Modality` value.
        tokens: `[len(Modality)]` int64, routed tokens per modality (counted once, not per layer).
    """

    layers: list[int]
    n_experts: int
    counts: Tensor = field(default=None)  # type: ignore[assignment]
    tokens: Tensor = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        shape = (len(self.layers), len(Modality), self.n_experts)
        if self.counts is None:
            self.counts = torch.zeros(shape, dtype=torch.long)
        if self.tokens is None:
            self.tokens = torch.zeros(len(Modality), dtype=torch.long)
        if tuple(self.counts.shape) != shape:
            raise ValueError(f"counts has shape {tuple(self.counts.shape)}: expected {shape}")

    def add(self, layer: int, indices: Tensor, modality: Tensor) -> None:
        """Count one routing call: `indices` [N, k] chosen experts of N tokens whose modality is [N]."""
        if indices.dim() != 2 or modality.shape != indices.shape[:1]:
            raise ValueError(
                f"indices {tuple(indices.shape)} and modality {tuple(modality.shape)}: "
                "expected [N, k] and [N]"
            )
        if layer not in self.layers:
            raise ValueError(f"layer {layer} is not one of the MoE layers {self.layers}")
        row = self.layers.index(layer)
        flat = modality.long().cpu()[:, None].expand_as(indices).reshape(-1) * self.n_experts
        flat = flat + indices.long().cpu().reshape(-1)
        hist = torch.bincount(flat, minlength=len(Modality) * self.n_experts)
        self.counts[row] += hist.view(len(Modality), self.n_experts)

    def add_output(self, output: BackboneOutput, batch: GroupBatch) -> None:
        """Count every MoE layer of one backbone pass. Only valid tokens were routed, in row-major order."""
        modality = batch.modality[batch.valid]
        for layer, r in output.router:
            if r.indices.shape[0] != modality.shape[0]:
                raise ValueError(
                    f"layer {layer} routed {r.indices.shape[0]} tokens but the batch has {modality.shape[0]} "
                    "valid positions: the router output does not belong to this batch"
                )
            self.add(layer, r.indices, modality)
        self.tokens += torch.bincount(modality.long().cpu(), minlength=len(Modality))

    def merge(self, other: RoutingCounts) -> None:
        if other.layers != self.layers or other.n_experts != self.n_experts:
            raise ValueError("cannot merge routing counts of different layers or expert counts")
        self.counts += other.counts
        self.tokens += other.tokens

    # -- the measures ---------------------------------------------------------------------------------
    def modalities(self) -> list[Modality]:
        """The modalities that were routed at all, in `Modality` order."""
        return [m for m in ROUTED_MODALITIES if int(self.tokens[m]) > 0]

    def share(self, modality: Modality) -> Tensor:
        """`[layers, experts]` float: each expert's share of the modality's assignments in each layer."""
        c = self.counts[:, int(modality)].double()
        return c / c.sum(dim=-1, keepdim=True).clamp_min(1)

    def load(self, layer_row: int, modality: Modality | None = None) -> Tensor:
        """`[experts]` assignments of one layer (row in `layers`), of one modality or of all."""
        c = self.counts[layer_row]
        return c.sum(dim=0) if modality is None else c[int(modality)]

    def entropy(self) -> dict[str, list[float]]:
        """NE per layer: under "all" for all tokens together, and per modality name."""
        out = {"all": [normalised_entropy(self.load(i)) for i in range(len(self.layers))]}
        for m in self.modalities():
            out[m.name.lower()] = [normalised_entropy(self.load(i, m)) for i in range(len(self.layers))]
        return out

    def top_sets(self, fraction: float = TOP_FRACTION) -> dict[str, list[list[int]]]:
        """Per modality, per layer: the sorted top experts by load."""
        return {
            m.name.lower(): [sorted(top_experts(self.load(i, m), fraction)) for i in range(len(self.layers))]
            for m in self.modalities()
        }

    def iou(self, fraction: float = TOP_FRACTION) -> dict[str, list[float]]:
        """Per pair of routed modalities ("text-image"), per layer: IoU of their top experts by load."""
        out = {}
        for a, b in itertools.combinations(self.modalities(), 2):
            out[f"{a.name.lower()}-{b.name.lower()}"] = [
                iou(top_experts(self.load(i, a), fraction), top_experts(self.load(i, b), fraction))
                for i in range(len(self.layers))
            ]
        return out

    def iou_chance(self, fraction: float = TOP_FRACTION) -> dict[str, list[float]]:
        """Per pair, per layer: `chance_iou` for the sizes of the two top sets actually compared."""
        top = self.top_sets(fraction)
        out = {}
        for a, b in itertools.combinations(self.modalities(), 2):
            na, nb = a.name.lower(), b.name.lower()
            out[f"{na}-{nb}"] = [
                chance_iou(self.n_experts, len(sa), len(sb)) for sa, sb in zip(top[na], top[nb], strict=True)
            ]
        return out

    def summary(self, fraction: float = TOP_FRACTION) -> dict[str, object]:
        """Everything as plain JSON-able values (NaN becomes None)."""
        return _json_safe(
            {
                "layers": self.layers,
                "n_experts": self.n_experts,
                "top_fraction": fraction,
                "tokens": {m.name.lower(): int(self.tokens[m]) for m in self.modalities()},
                "counts": {m.name.lower(): self.counts[:, int(m)].tolist() for m in self.modalities()},
                "share": {m.name.lower(): self.share(m).tolist() for m in self.modalities()},
                "normalised_entropy": self.entropy(),
                "normalised_entropy_mean": {k: _nanmean(v) for k, v in self.entropy().items()},
                "top_experts": self.top_sets(fraction),
                "iou": self.iou(fraction),
                "iou_mean": {k: _nanmean(v) for k, v in self.iou(fraction).items()},
                "iou_chance": self.iou_chance(fraction),
            }
        )

    def scalars(self, fraction: float = TOP_FRACTION) -> dict[str, float]:
        """Flat scalars for a logger: NE per layer and its means, IoU means per pair (NaN left out)."""
        out = {}
        for name, values in self.entropy().items():
            out[f"ne/{name}"] = _nanmean(values)
        for i, value in zip(self.layers, self.entropy()["all"], strict=True):
            out[f"ne/all/layer{i}"] = value
        for pair, values in self.iou(fraction).items():
            out[f"iou/{pair}"] = _nanmean(values)
        return {k: float(v) for k, v in out.items() if v is not None and not math.isnan(v)}


def _nanmean(values: Iterable[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def _json_safe(value: object) -> object:
    if isinstance(value, float):
        return None if math.isnan(value) else round(value, 6)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def moe_layers(model: torch.nn.Module) -> tuple[list[int], int]:
    """The MoE layer indices of a `UnifiedModel`'s (or a `UnifiedTransformer`'s) backbone, and E."""
    backbone = getattr(model, "backbone", model)
    layers = [i for i, block in enumerate(backbone.layers) if block.is_moe]
    if not layers:
        raise ValueError("the model has no MoE layers (every layer is dense): nothing routes")
    return layers, backbone.n_experts


class RoutingRecorder:
    """Runs a `UnifiedModel` over batches without gradients and counts its expert choices.

    The full model runs (no elastic sub-model) in eval mode, so the router's balancing state is untouched.

        recorder = RoutingRecorder(model)
        for batch in batches:
            recorder.record(batch)
        recorder.counts.summary()

    Args:
        model: a `UnifiedModel`.
        keep_tokens: also keep every routed token's choices (`tokens()`), not only the counts.
    """

    def __init__(self, model: torch.nn.Module, keep_tokens: bool = False) -> None:
        self.model = model
        layers, n_experts = moe_layers(model)
        self.counts = RoutingCounts(layers, n_experts)
        self.losses: list[float] = []
        self.head_losses: dict[str, list[float]] = {}
        self.keep_tokens = keep_tokens
        self._tokens: dict[str, list[Tensor]] = {}

    @torch.no_grad()
    def record(self, batch: GroupBatch) -> None:
        was_training = self.model.training
        self.model.eval()
        try:
            device = next(self.model.parameters()).device
            batch = batch.to(device)
            out = self.model(batch)
        finally:
            self.model.train(was_training)
        self.counts.add_output(out.backbone, batch)
        self.losses.append(float(out.loss))
        for name, head in out.heads.items():
            self.head_losses.setdefault(name, []).append(float(head.loss))
        if self.keep_tokens:
            self._tokens.setdefault("modality", []).append(batch.modality[batch.valid].cpu())
            for layer, r in out.backbone.router:
                self._tokens.setdefault(f"layer{layer}", []).append(r.indices.cpu())

    def tokens(self) -> dict[str, Tensor]:
        """Per routed token, in order: `modality` [N] and `layer<i>` [N, k] chosen experts per MoE layer."""
        if not self.keep_tokens:
            raise ValueError("RoutingRecorder(keep_tokens=False) kept only counts: pass keep_tokens=True")
        return {k: torch.cat(v).contiguous() for k, v in self._tokens.items()}
