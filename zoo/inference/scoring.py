"""Teacher-forced log-probs of text: what a sequence of unified ids costs the model, token by token (the
`echo` + `logprobs` of `zoo serve`'s completions, which lm-eval's `local-completions` client scores with).

Scores are under `model.sampling_logits` (the text head, ids the tokenizer cannot decode masked): the
distribution generation samples from, so "greedy" means what greedy decoding would write.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zoo.models.decode import text_prompts
from zoo.models.unified import UnifiedModel


@dataclass(frozen=True)
class SequenceScores:
    """For ids `s`: `logprobs[i]` = log p(s[i + 1] | s[: i + 1]); `top_ids[i]`, `top_logprobs[i]`: the `top`
    likeliest ids at that place and their log-probs (best first); `next_id`, `next_logprob`: the greedy id
    after the whole sequence (None unless asked for)."""

    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    next_id: int | None = None
    next_logprob: float | None = None


@torch.no_grad()
def score_sequences(
    model: UnifiedModel, sequences: list[list[int]], top: int = 1, with_next: bool = False
) -> list[SequenceScores]:
    """Every sequence (unified ids, `<bos>` first) scored in one left-padded forward; `top` >= 1. The last id
    of a sequence is only a target unless `with_next` asks for the greedy id after it (it is then fed too,
    so the sequence must leave one position of the context free)."""
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    if not sequences or min(len(s) for s in sequences) < 1 + (not with_next):
        raise ValueError("score_sequences needs sequences of at least one id (two, without with_next)")
    fed = [s if with_next else s[:-1] for s in sequences]
    limit = model.backbone.max_seq_len
    if max(len(s) for s in fed) > limit:
        raise ValueError(f"a sequence of {max(len(s) for s in fed)} fed ids exceeds the context of {limit}")
    hidden = model.forward_hidden(text_prompts(model, fed)).hidden
    out = []
    for row, (sequence, inputs) in enumerate(zip(sequences, fed, strict=True)):
        logprobs = torch.log_softmax(model.sampling_logits(hidden[row, -len(inputs) :]).float(), dim=-1)
        best, best_ids = logprobs.topk(top, dim=-1)
        scored = len(sequence) - 1  # positions whose next id is in the sequence
        targets = torch.tensor(sequence[1:], device=logprobs.device)
        chosen = logprobs[:scored].gather(-1, targets[:, None])[:, 0]
        following = (int(best_ids[-1, 0]), float(best[-1, 0])) if with_next else (None, None)
        tops = best_ids[:scored].tolist(), best[:scored].tolist()
        out.append(SequenceScores(chosen.tolist(), *tops, *following))
    return out
