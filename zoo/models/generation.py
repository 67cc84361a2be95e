"""Text generation: a token stream over `zoo.models.decode.text_step`, and speculative self-decoding with the
MTP module as draft.

Text is one token per group, so a decode step is one group: the new position sees its own group and every
earlier one, which with a cache needs no recomputation. Prompts of different lengths are left-padded;
padding has no document (`PAD_DOC`) so nothing attends to it. `stream_text` yields every step's ids (the
token iterator a server streams); `generate_text` and `zoo.models.media_generation.generate_text_after`
collect it for prompts of unified ids and for prompt batches with media.

`step` picks the text step after the prefill: "dynamic" (default, `decode.text_step`: the cache sliced to
its filled length), "static" (`zoo.models.static_step.StaticTextStep`: every shape fixed, attention over
the whole preallocated cache) or "compiled" (the static step through `torch.compile`; CUDA graphs on GPU).
All three give the same greedy tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from zoo.batch import GroupBatch
from zoo.models.decode import Cursor, Recording, mtp_draft_step, text_prompts, text_step
from zoo.models.elastic import ElasticConfig
from zoo.models.kv_cache import KVCache
from zoo.models.sampling import Sampler
from zoo.models.static_step import StaticTextStep, static_cache_len

TextStepKind = Literal["dynamic", "static", "compiled"]

if TYPE_CHECKING:
    from zoo.models.decodable import DecodingModel


def check_prompts(model: DecodingModel, prompts: list[list[int]], max_new_tokens: int) -> None:
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
def stream_text(
    model: DecodingModel,
    prompt: GroupBatch,
    max_new_tokens: int,
    sampler: Sampler,
    stop_ids: tuple[int, ...],
    elastic: ElasticConfig | None = None,
    use_cache: bool = True,
    recording: Recording | None = None,
    step: TextStepKind = "dynamic",
) -> Iterator[tuple[Tensor, Tensor]]:
    """Continue a left-padded prompt batch (any groups) with text, one token a row per step.

    Yields per step the sampled ids `[B]` and `[B]` bool: which rows they belong to (False for a row that
    sampled a stop id before: its id is padding). Ends after every row has sampled a stop id (kept), or
    after `max_new_tokens` steps. Text comes from `model.sampling_logits`. With `use_cache=False` every
    step recomputes the whole sequence (text prompts only): the reference the cache must match. `step`:
    the text step after the prefill (module docstring); "static" and "compiled" need the cache.
    """
    if step not in ("dynamic", "static", "compiled"):
        raise ValueError(f"step={step!r}: expected 'dynamic', 'static' or 'compiled'")
    if step != "dynamic" and not use_cache:
        raise ValueError(f"step={step!r} writes into a KV cache: it needs use_cache=True")
    device = prompt.input_ids.device
    stop = torch.tensor(stop_ids, dtype=torch.long, device=device)
    cache, static = None, None
    if use_cache:
        width = prompt.seq_len + max_new_tokens
        if step != "dynamic":
            width = static_cache_len(width)
        cache = model.backbone.new_cache(prompt.batch_size, width)
    out = model.forward_hidden(prompt, cache=cache, elastic=elastic)
    if recording is not None:
        recording.fed(out, prompt)
    if cache is not None and step != "dynamic":
        static = StaticTextStep(model, cache, elastic, compile=step == "compiled")
    cursor, sequence = Cursor.after(prompt), prompt
    live = torch.ones(prompt.batch_size, dtype=torch.bool, device=device)
    logits = model.sampling_logits(out.hidden[:, -1])
    for n in range(max_new_tokens):
        token = sampler.sample(logits)
        if recording is not None:
            rows = live.nonzero()[:, 0]
            recording.sampled(rows.tolist(), sampler.logprob(logits[rows], token[rows])[:, None])
        yield token, live
        live = live & ~torch.isin(token, stop)
        if not bool(live.any()) or n + 1 == max_new_tokens:
            return
        if static is not None:
            step_logits, routing = static(token[:, None], cursor)
            logits = step_logits[:, -1]
            if recording is not None:
                recording.fed_step(routing)
        else:
            ids = token[:, None]
            out, sequence = text_step(model, cache, ids, cursor, elastic, recording, before=sequence)
            logits = model.sampling_logits(out.hidden[:, -1])
        cursor = cursor.advance()


@torch.no_grad()
def generate_text(
    model: DecodingModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    elastic: ElasticConfig | None = None,
    use_cache: bool = True,
    stop_ids: tuple[int, ...] | None = None,
    generator: torch.Generator | None = None,
    step: TextStepKind = "dynamic",
) -> list[list[int]]:
    """Continue each prompt (unified ids) by up to `max_new_tokens`; a row stops after a stop id (kept;
    default `<eos>`, `()` never stops). With `use_cache=False` every step recomputes the whole sequence.
    `step="compiled"`: the static text step through `torch.compile` (module docstring), once per (rows,
    cache width rounded up to `static_step.STATIC_LEN_MULTIPLE`); "static" runs it eagerly."""
    check_prompts(model, prompts, max_new_tokens)
    sampler = Sampler(temperature, top_k, top_p, generator)
    stop_ids = (model.vocab.eos_id,) if stop_ids is None else stop_ids
    stream = stream_text(
        model, text_prompts(model, prompts), max_new_tokens, sampler, stop_ids, elastic, use_cache, step=step
    )
    return collect(stream, len(prompts))


def collect(stream: Iterator[tuple[Tensor, Tensor]], rows: int) -> list[list[int]]:
    """The ids of a `stream_text` stream, per row."""
    out: list[list[int]] = [[] for _ in range(rows)]
    for token, live in stream:
        for row, (value, counts) in enumerate(zip(token.tolist(), live.tolist(), strict=True)):
            if counts:
                out[row].append(value)
    return out


@torch.no_grad()
def speculative_generate(
    model: DecodingModel, prompt: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] | None = None
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
    backbone = model.backbone
    max_len = len(prompt) + max_new_tokens + 2
    cache = backbone.new_cache(1, max_len)
    mtp_cache = KVCache(1, 1, backbone.n_kv_heads, max_len, backbone.head_dim, cache.dtype, device)
    stops = set((model.vocab.eos_id,) if stop_ids is None else stop_ids)

    def run(ids: list[int], start: int) -> Tensor:
        at = Cursor.at([start], [start], device)
        return text_step(model, cache, torch.tensor([ids], device=device), at)[0].hidden

    def draft(hidden: Tensor, next_ids: list[int], start: int) -> int:
        """Feed MTP positions start.. (each with its known next token); return the draft after the last."""
        ids = torch.tensor([next_ids], device=device)
        state = mtp_draft_step(model, mtp_cache, hidden, ids, Cursor.at([start], [start], device))
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
