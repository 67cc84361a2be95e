"""Text generation with a preallocated KV cache, and speculative self-decoding with the MTP module as draft.

Text is one token per group, so a decode step is one group: the new position sees its own group and
every earlier one, which with a cache needs no recomputation. Prompts of different lengths are
left-padded; padding has no document (`PAD_DOC`) so nothing attends to it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from zoo.batch import PAD_DOC, GroupBatch, Modality
from zoo.models.backbone import AttentionContext
from zoo.models.elastic import ElasticConfig
from zoo.models.kv_cache import KVCache
from zoo.models.sampling import sample

if TYPE_CHECKING:
    from zoo.models.unified import UnifiedModel


def text_batch(ids: Tensor, doc_id: Tensor, index: Tensor) -> GroupBatch:
    """A text-only GroupBatch: one group per token, t = h = w = the token's index in its document."""
    modality = torch.where(doc_id == PAD_DOC, int(Modality.PAD), int(Modality.TEXT))
    return GroupBatch(
        input_ids=ids,
        modality=modality,
        group_id=index,
        doc_id=doc_id,
        positions=index.unsqueeze(0).expand(3, -1, -1),
    )


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """ids, doc_id, index `[B, Lmax]` for left-padded prompts."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long, device=device)
    doc = torch.full_like(ids, PAD_DOC)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt, dtype=torch.long, device=device)
        doc[row, longest - len(prompt) :] = 0
    index = ((doc != PAD_DOC).cumsum(-1) - 1).clamp_min(0)
    return ids, doc, index


def check_prompts(model: UnifiedModel, prompts: list[list[int]], max_new_tokens: int) -> None:
    if not prompts:
        raise ValueError("no prompts given")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty: start it with at least <bos>")
        model.vocab.check_ids(torch.tensor(prompt), range(0, model.vocab.text_head_size))
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > model.backbone.max_seq_len:
        raise ValueError(
            f"prompt ({max(len(p) for p in prompts)} tokens) + max_new_tokens ({max_new_tokens}) = {longest} "
            f"exceeds the context of {model.backbone.max_seq_len}"
        )


@torch.no_grad()
def generate_text(
    model: UnifiedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    elastic: ElasticConfig | None = None,
    use_cache: bool = True,
    stop_ids: tuple[int, ...] | None = None,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Continue each prompt (unified ids) by up to `max_new_tokens`; a row stops after a stop id (kept).

    With `use_cache=False` every step recomputes the whole sequence: the reference the cache must match.
    """
    check_prompts(model, prompts, max_new_tokens)
    stop_ids = (model.vocab.eos_id,) if stop_ids is None else stop_ids
    device = next(model.parameters()).device
    ids, doc, index = left_pad(prompts, model.vocab.pad_id, device)
    b = ids.shape[0]
    cache = model.backbone.new_cache(b, ids.shape[1] + max_new_tokens) if use_cache else None
    stop = torch.tensor(stop_ids, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    out: list[list[int]] = [[] for _ in range(b)]
    step_ids, step_doc, step_index = ids, doc, index
    for _ in range(max_new_tokens):
        batch = text_batch(step_ids, step_doc, step_index)
        hidden = model.forward_hidden(batch, cache=cache, elastic=elastic).hidden
        token = sample(model.sampling_logits(hidden[:, -1]), temperature, top_k, top_p, generator)
        for row in range(b):
            if not done[row]:
                out[row].append(int(token[row]))
        done |= torch.isin(token, stop)
        if bool(done.all()):
            break
        next_index = step_index[:, -1:] + 1
        if use_cache:
            step_ids, step_doc, step_index = token[:, None], torch.zeros_like(token)[:, None], next_index
        else:
            step_ids = torch.cat([step_ids, token[:, None]], dim=1)
            step_doc = torch.cat([step_doc, torch.zeros_like(token)[:, None]], dim=1)
            step_index = torch.cat([step_index, next_index], dim=1)
    return out


@torch.no_grad()
def speculative_generate(
    model: UnifiedModel, prompt: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] | None = None
) -> tuple[list[int], float]:
    """Greedy decoding with the first MTP module drafting one token ahead (self-speculation).

    Each round runs the backbone once on [pending, draft]: if the backbone's own greedy choice after
    `pending` equals the draft, two tokens are accepted from one pass. The output is exactly greedy
    decoding's, stop ids included (default `<eos>`; `()` never stops). Returns (tokens, acceptance rate).
    """
    if model.text_head.mtp_depth == 0:
        raise ValueError("speculative decoding needs an MTP module (mtp_depth >= 1)")
    check_prompts(model, [prompt], max_new_tokens + 1)
    device = next(model.parameters()).device
    backbone, mtp = model.backbone, model.text_head.mtp[0]
    max_len = len(prompt) + max_new_tokens + 2
    cache = backbone.new_cache(1, max_len)
    mtp_cache = KVCache(1, 1, backbone.n_kv_heads, max_len, backbone.head_dim, cache.dtype, device)
    stops = set((model.vocab.eos_id,) if stop_ids is None else stop_ids)

    def run(ids: list[int], start: int) -> Tensor:
        index = torch.arange(start, start + len(ids), device=device)[None]
        batch = text_batch(torch.tensor([ids], device=device), torch.zeros_like(index), index)
        return model.forward_hidden(batch, cache=cache).hidden

    def draft(hidden: Tensor, next_ids: list[int], start: int) -> int:
        """Feed MTP positions start.. (each with its known next token); return the draft after the last."""
        index = torch.arange(start, start + len(next_ids), device=device)[None]
        batch = text_batch(torch.tensor([next_ids], device=device), torch.zeros_like(index), index)
        ctx = backbone.context(batch, mtp_cache)
        state = mtp(
            hidden,
            model.text_embed(batch.input_ids),
            AttentionContext(ctx.cos, ctx.sin, ctx.mask, mtp_cache, ctx.start),
        )
        return int(model.sampling_logits(state[:, -1]).argmax(-1))

    hidden = run(prompt, 0)
    pending = int(model.sampling_logits(hidden[:, -1]).argmax(-1))
    out = [pending]
    # MTP position i needs t_{i+1}: the prompt's positions take their successors, the last takes `pending`.
    guess = draft(hidden, prompt[1:] + [pending], 0)
    proposed = accepted = 0
    while len(out) < max_new_tokens and out[-1] not in stops:
        n = cache.length
        hidden = run([pending, guess], n)
        logits = model.sampling_logits(hidden[0])
        verified, after = int(logits[0].argmax()), int(logits[1].argmax())
        proposed += 1
        if verified == guess:
            accepted += 1
            if guess in stops:
                out.append(guess)
                break
            out.extend([guess, after][: max_new_tokens - len(out)])
            guess = draft(hidden, [guess, after], n)
            pending = after
        else:
            cache.truncate(n + 1)  # the draft's keys are wrong: drop them
            out.append(verified)
            guess = draft(hidden[:, :1], [verified], n)
            pending = verified
    return out[:max_new_tokens], accepted / max(proposed, 1)
