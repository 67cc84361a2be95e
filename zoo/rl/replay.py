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
from zoo.models.sampling import chosen, entropy, log_probs
from zoo.parallel import gathered
from zoo.rl.prompts import (
    PromptLayout,
    asks_for_image,
    asks_for_speech,
    response_positions,
    speech_codes,
)

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
    """The trainer's log-probs of each rollout's response tokens (prompt and hint excluded).

    Entry t of rollout i is log p(response[t] | prompt + response[:t]) under `log_softmax(logits /
    temperature)`, aligned with `Rollout.inf_logprobs` (temperature 0 means 1, as in the engine). For an
    image response (`zoo.rl.prompts.asks_for_image`) the NFSP head gives them instead: each code is
    predicted at its own position, from the coarser scales and the prompt. For speech the NCP depth head
    does: frame f's Q codes at the position before the frame, level by level, then END at the last one.
    replay: Rollout Router Replay: every MoE layer uses the rollout's recorded expert sets while the gate
    weights over them come from the live router (`Router(forced_indices=...)`), so the router still
    learns. grad: None follows `torch.is_grad_enabled()`; False computes without a graph.
    with_entropy: also return the entropy of each predicted distribution, `[len(response)]` per rollout.
    A sharded (FSDP2) model is gathered for the pass: call it on every rank; with grad it is untested.
    """
    if not rollouts:
        return ([], []) if with_entropy else []
    device = next(model.parameters()).device
    batch = _full_sequences(model, rollouts)
    routing = _replay_routing(model, rollouts) if replay else None
    # Text: position P-1+t predicts response token t. Image: code t sits (and is predicted) at P+t. Right
    # padding keeps each row's predictors contiguous, so a row-major selection is rollout after rollout.
    kinds = [response_kind(model, r.prompt_ids) for r in rollouts]
    picked = {kind: torch.zeros_like(batch.input_ids, dtype=torch.bool) for kind in ("text", "image")}
    targets: dict[str, list[int]] = {"text": [], "image": []}
    offset = model.vocab.visual_offset
    for row, (r, kind) in enumerate(zip(rollouts, kinds, strict=True)):
        if kind == "speech":
            continue
        start = len(r.prompt_ids) - (0 if kind == "image" else 1)
        picked[kind][row, start : start + len(r.response_ids)] = True
        targets[kind] += [t - offset for t in r.response_ids] if kind == "image" else r.response_ids
    enabled = torch.is_grad_enabled() if grad is None else grad
    with torch.set_grad_enabled(enabled), gathered(model):
        hidden = model.forward_hidden(batch, routing=routing).hidden
        per_kind = {}
        for kind in ("text", "image"):
            if kind not in kinds:
                continue
            head = model.nfsp.logits if kind == "image" else model.text_head.logits
            logp = log_probs(head(hidden[picked[kind]]), temperature)
            picked_logp = chosen(logp, torch.tensor(targets[kind], device=device))
            sizes = [len(r.response_ids) for r, k in zip(rollouts, kinds, strict=True) if k == kind]
            entropies = entropy(logp) if with_entropy else picked_logp
            per_kind[kind] = (iter(picked_logp.split(sizes)), iter(entropies.split(sizes)))
        if "speech" in kinds:
            speech = [(row, r) for row, r in enumerate(rollouts) if kinds[row] == "speech"]
            per_kind["speech"] = _speech_logprobs(model, hidden, speech, temperature)
        logprobs = [next(per_kind[kind][0]) for kind in kinds]
        if not with_entropy:
            return logprobs
        return logprobs, [next(per_kind[kind][1]) for kind in kinds]


def response_kind(model: UnifiedModel, prompt_ids: list[int]) -> str:
    """"image", "speech" or "text": what the policy writes after this prompt."""
    if asks_for_image(model, prompt_ids):
        return "image"
    return "speech" if asks_for_speech(model, prompt_ids) else "text"


def _speech_logprobs(  # noqa: ANN202 (two iterators of tensors)
    model: UnifiedModel, hidden: Tensor, rows: list[tuple[int, Rollout]], temperature: float
):
    """Per speech rollout (row of `hidden`, rollout): iterators over its decisions' log-probs and entropies,
    frame by frame (Q levels each), then END. Frame f is decided at position P - 1 + f (`<boa>` for f = 0),
    END at the last frame's position."""
    ncp = model.ncp
    states, codes, counts = [], [], []
    for row, r in rows:
        frames, ended = speech_codes(model, r.response_ids)
        frames = frames.to(hidden.device)
        if ended:
            end = torch.zeros(1, ncp.levels, dtype=torch.long, device=hidden.device)
            end[0, 0] = ncp.end_id
            frames = torch.cat([frames, end])
        start = len(r.prompt_ids) - 1
        states.append(hidden[row, start : start + len(frames)])
        codes.append(frames)
        counts.append((len(frames) - ended, ended))
    logp, entropy = ncp.logprobs(torch.cat(states), torch.cat(codes), temperature)
    flat_logp, flat_entropy = [], []
    at = 0
    for frames, ended in counts:
        span = slice(at, at + frames)
        flat_logp.append(torch.cat([logp[span].flatten(), logp[at + frames :][:ended, 0]]))
        flat_entropy.append(torch.cat([entropy[span].flatten(), entropy[at + frames :][:ended, 0]]))
        at += frames + ended
    return iter(flat_logp), iter(flat_entropy)


def _full_sequences(model: UnifiedModel, rollouts: list[Rollout]) -> GroupBatch:
    """prompt (text or a document with media) + response of each rollout, right-padded, one document a
    row (`zoo.rl.prompts`)."""
    longest = max(
        len(r.prompt_ids) + response_positions(model, r.prompt_ids, r.response_ids) for r in rollouts
    )
    if longest > model.backbone.max_seq_len:
        raise ValueError(f"a rollout of {longest} tokens exceeds max_seq_len={model.backbone.max_seq_len}")
    rows = [(r.prompt_document, r.prompt_ids, r.response_ids) for r in rollouts]
    return PromptLayout(model).batch(rows, left=False)


def _replay_routing(model: UnifiedModel, rollouts: list[Rollout]) -> dict[int, Tensor]:
    """Per MoE layer, the recorded expert ids of every valid position in row-major order (right padding
    puts each row's positions first, so this is the rollouts' recordings one after the other)."""
    device = next(model.parameters()).device
    layers = [i for i, block in enumerate(model.backbone.layers) if block.is_moe]
    for i, r in enumerate(rollouts):
        positions = len(r.prompt_ids) + response_positions(model, r.prompt_ids, r.response_ids)
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
