"""Rollout Router Replay (R3) and the trainer's side of the train/inference mismatch (ERNIE 5.0 RL section).

An MoE policy's inference engine and trainer can route the same token to different experts (bf16/FP8
rounding flips near-ties), which adds to the l_old - l_inf mismatch. With replay, the trainer's forward
forces the expert *sets* the engine recorded (`Rollout.routing`) while the gate weights over them come
from the live router (`Router(forced_indices=...)`), so the router still gets gradients.
`sequence_logprobs` computes the trainer's log-probs of rollouts' response tokens with or without it;
`routing_agreement` and `mismatch_kl` measure what it buys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from zoo.batch import GroupBatch
from zoo.parallel import gathered
from zoo.rl.prompts import PromptLayout
from zoo.rl.responses import Scored, response_kind, rollout_batch

if TYPE_CHECKING:
    from zoo.models.unified import UnifiedModel
    from zoo.rl.records import Rollout


def sequence_logprobs(
    model: UnifiedModel,
    rollouts: list[Rollout],
    replay: bool = False,
    grad: bool | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> list[Tensor] | tuple[list[Tensor], list[Tensor]]:
    """The trainer's log-probs of each rollout's response decisions (prompt and hint excluded).

    Entry t of rollout i is the log-prob of its decision t given the prompt and the decisions before it,
    under `log_softmax(logits / temperature)` (`zoo.models.sampling`), aligned with `Rollout.inf_logprobs`
    (temperature 0 means 1, as in the engine). Which head scores which position is the response kind's
    (`zoo.rl.responses`): text tokens, image codes (NFSP), speech frames level by level and END (NCP).
    replay: Rollout Router Replay: every MoE layer uses the rollout's recorded expert sets while the gate
    weights over them come from the live router (`Router(forced_indices=...)`), so the router still
    learns. grad: None follows `torch.is_grad_enabled()`; False computes without a graph.
    with_entropy: also return the entropy of each predicted distribution, `[len(response)]` per rollout.
    A sharded (FSDP2) model is gathered for the pass: call it on every rank; with grad it is untested.
    """
    if not rollouts:
        return ([], []) if with_entropy else []
    batch = _full_sequences(model, rollouts)
    routing = _replay_routing(model, rollouts) if replay else None
    kinds = [response_kind(model, r.prompt_ids) for r in rollouts]
    enabled = torch.is_grad_enabled() if grad is None else grad
    with torch.set_grad_enabled(enabled), gathered(model):
        hidden = model.forward_hidden(batch, routing=routing).hidden
        scored: list[Scored | None] = [None] * len(rollouts)
        for kind in dict.fromkeys(kinds):  # each kind present, once, scores all its rollouts together
            rows = [(row, r) for row, (r, k) in enumerate(zip(rollouts, kinds, strict=True)) if k is kind]
            scores = kind.logprobs(model, hidden, rows, temperature, with_entropy)
            for (row, _), score in zip(rows, scores, strict=True):
                scored[row] = score
        logprobs = [score[0] for score in scored]
        if not with_entropy:
            return logprobs
        return logprobs, [score[1] for score in scored]


def _positions(model: UnifiedModel, rollout: Rollout) -> int:
    """Positions of prompt + response in the trainer's sequence."""
    kind = response_kind(model, rollout.prompt_ids)
    return len(rollout.prompt_ids) + kind.positions(model, rollout.response_ids)


def _full_sequences(model: UnifiedModel, rollouts: list[Rollout]) -> GroupBatch:
    """prompt (text or a document with media) + response of each rollout, right-padded, one document a
    row (`zoo.rl.responses.rollout_batch`)."""
    longest = max(_positions(model, r) for r in rollouts)
    if longest > model.backbone.max_seq_len:
        raise ValueError(f"a rollout of {longest} tokens exceeds max_seq_len={model.backbone.max_seq_len}")
    rows = [(r.prompt_document, r.prompt_ids, r.response_ids) for r in rollouts]
    return rollout_batch(PromptLayout(model), rows, left=False)


def _replay_routing(model: UnifiedModel, rollouts: list[Rollout]) -> dict[int, Tensor]:
    """Per MoE layer, the recorded expert ids of every valid position in row-major order (right padding
    puts each row's positions first, so this is the rollouts' recordings one after the other)."""
    device = next(model.parameters()).device
    layers = [i for i, block in enumerate(model.backbone.layers) if block.is_moe]
    for i, r in enumerate(rollouts):
        positions = _positions(model, r)
        if r.routing is None:
            raise ValueError(f"rollout {i} has no recorded routing: generate with record_routing=True")
        for layer in layers:
            got = r.routing.get(layer)
            if got is None or got.shape[0] != positions:
                shape = None if got is None else tuple(got.shape)
                raise ValueError(
                    f"rollout {i}: routing of MoE layer {layer} has shape {shape}, expected "
                    f"[{positions} (prompt + response positions), top_k]"
                )
    return {layer: torch.cat([r.routing[layer] for r in rollouts]).to(device) for layer in layers}


@torch.no_grad()
def routing_agreement(model: UnifiedModel, rollouts: list[Rollout], replay: bool = False) -> float:
    """Fraction of (position, MoE layer) where the trainer's expert set equals the recorded one."""
    batch = _full_sequences(model, rollouts)
    recorded = _replay_routing(model, rollouts)
    with gathered(model):
        out = model.forward_hidden(batch, routing=recorded if replay else None)
    same = [
        (chosen.sort(-1).values == recorded[layer].sort(-1).values).all(-1)
        for layer, chosen in out.routing.items()
    ]
    return float(torch.cat(same).float().mean())


def mismatch_kl(inf_logprobs: list[Tensor], train_logprobs: list[Tensor]) -> Tensor:
    """Token-mean k3 estimate of KL(pi_inf || pi_train) on the sampled tokens: E[w - 1 - log w] with
    w = pi_train / pi_inf (Schulman's unbiased, non-negative estimator)."""
    inf = torch.cat([t.float() for t in inf_logprobs])
    train = torch.cat([t.detach().float().to(inf.device) for t in train_logprobs])
    if inf.shape != train.shape:
        raise ValueError(f"{inf.numel()} inference log-probs but {train.numel()} trainer log-probs")
    if inf.numel() == 0:
        return inf.new_zeros(())
    log_w = train - inf
    return (log_w.exp() - 1 - log_w).mean()
