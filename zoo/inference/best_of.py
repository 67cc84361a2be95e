"""Best of N: draw several images (or utterances) for a caption and keep the one the model itself reads back
as that caption most likely.

A unified model that understands what it generates can rank its own samples, as DALL-E ranked its samples
with CLIP, here with no second model: each candidate is laid out as the understanding document it would be in
training, `<bos> medium caption <eos>` (an image through the vision encoder where the data reads images so,
speech as its codec codes), and scored by the caption's teacher-forced log-prob (`score_documents`). No
verifier and no ground truth take part, so what it buys is the gap between how well the model reads and how
well it draws: on ShapesWorld the demo's model reads image captions at 0.78 exact and draws them at 0.14
(docs/results.md, "Best of N"). A model never trained on the understanding task ranks at random.

The candidates of a prompt batch are drawn a few at a time (`draw_candidates`): on a CPU one call of about
`ROWS_PER_DRAW` rows beats both one call per candidate and one call for all of them (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

import torch
from torch import Tensor

from zoo.batch import IGNORE_INDEX
from zoo.datamodules.sequence import AudioSegment, Document, Segment, SequenceBuilder, TextSegment
from zoo.models.refinement import decode_visual
from zoo.models.unified import UnifiedModel

T = TypeVar("T")

ROWS_PER_DRAW = 256  # rows the backbone decodes at once, guidance's unconditional rows included


def check_best_of(**counts: int) -> None:
    """Refuse a candidate count below 1, by its argument's name."""
    for name, n in counts.items():
        if n < 1:
            raise ValueError(f"{name} must be >= 1 (1: one sample, no ranking), got {n}")


def draw_candidates(
    draw: Callable[[list[list[int]]], list[T]], prompts: list[list[int]], n: int, rows_per_prompt: int = 1
) -> list[list[T]]:
    """`n` draws per prompt, `candidates[c][i]` the c-th for prompt i. `draw` maps a prompt list to one result
    a prompt (a sampler call); it is called on the prompts repeated as often as `ROWS_PER_DRAW` rows allow
    (`rows_per_prompt`: the rows a prompt takes, 2 under classifier-free guidance)."""
    check_best_of(n=n)
    per_call = max(1, min(n, ROWS_PER_DRAW // max(1, len(prompts) * rows_per_prompt)))
    candidates: list[list[T]] = []
    while len(candidates) < n:
        k = min(per_call, n - len(candidates))
        drawn = draw(prompts * k)
        candidates += [drawn[j * len(prompts) : (j + 1) * len(prompts)] for j in range(k)]
    return candidates


@torch.no_grad()
def score_documents(model: UnifiedModel, builder: SequenceBuilder, documents: list[Document]) -> Tensor:
    """`[n]`: each document's summed log-prob of its text targets (the text head, teacher-forced; one
    document a row, so no document sees another). Media segments are read as training reads them."""
    batch = builder.collate_prompts(documents).to(next(model.parameters()).device)
    hidden = model.forward_hidden(batch).hidden
    targets = batch.targets["text"]
    picked = targets != IGNORE_INDEX
    logprobs = torch.log_softmax(model.sampling_logits(hidden[picked]).float(), dim=-1)
    chosen = logprobs.gather(-1, targets[picked][:, None])[:, 0]
    rows = torch.arange(len(documents), device=hidden.device)[:, None].expand_as(picked)[picked]
    return torch.zeros(len(documents), device=hidden.device).index_add(0, rows, chosen).cpu()


def reading(caption: list[int], medium: Segment, bos_id: int, eos_id: int) -> Document:
    """The understanding document that scores `medium` (an input segment) as a rendering of `caption`
    (unified text ids): only the caption and its `<eos>` are targets, not the medium's opening token."""
    return [TextSegment([bos_id]), replace(medium, predict_opener=False), TextSegment([*caption, eos_id])]


def rank_candidates(
    model: UnifiedModel,
    builder: SequenceBuilder,
    captions: list[list[int]],
    candidates: list[list[Segment | None]],
) -> tuple[list[int], Tensor]:
    """The likeliest candidate of each caption, and every candidate's score `[C, B]`: `candidates[c][i]` is
    candidate c for caption i as an input segment (`predict=False`; None: nothing to read, such as speech
    that ended at once, scored -inf), `captions[i]` its unified text ids."""
    if not candidates or any(len(c) != len(captions) for c in candidates):
        raise ValueError(f"rank_candidates needs candidate lists of {len(captions)} segments each")
    vocab = model.vocab
    scores = torch.full((len(candidates), len(captions)), -torch.inf)
    for c, row in enumerate(candidates):
        readable = [i for i, medium in enumerate(row) if medium is not None]
        if readable:
            documents = [reading(captions[i], row[i], vocab.bos_id, vocab.eos_id) for i in readable]
            scores[c, readable] = score_documents(model, builder, documents)
    return scores.argmax(0).tolist(), scores


def prompt_caption(prompt: list[int]) -> list[int]:
    """The caption of a caption-to-media prompt `<bos> caption <opener>`."""
    return list(prompt[1:-1])


def best_of_visual(
    model: UnifiedModel,
    builder: SequenceBuilder,
    prompts: list[list[int]],
    n: int,
    draw: Callable[[list[list[int]]], list[Tensor]],
    read: Callable[[Tensor], Segment],
    rows_per_prompt: int = 1,
) -> tuple[list[Tensor], list[Tensor]]:
    """Images (videos) for caption-to-media `prompts`: the best of `n` draws each, and the first draws (one
    plain sample each), both as codes per scale `[B, frames, s, s]`. `draw` is a sampler call giving such
    codes for a prompt list; `read` turns one decoded image `[3, H, W]` (video `[3, T, H, W]`) into the
    segment understanding reads (through the vision encoder or as codes, as the model was trained)."""

    def per_prompt(rows: list[list[int]]) -> list[list[Tensor]]:
        scales = draw(rows)
        return [[scale[i] for scale in scales] for i in range(len(rows))]

    def joined(codes: list[list[Tensor]]) -> list[Tensor]:
        return [torch.stack(scale) for scale in zip(*codes, strict=True)]

    candidates = draw_candidates(per_prompt, prompts, n, rows_per_prompt)
    segments = [[read(pixels) for pixels in decode_visual(model, joined(row)).cpu()] for row in candidates]
    best, _ = rank_candidates(model, builder, [prompt_caption(p) for p in prompts], segments)
    return joined([candidates[c][i] for i, c in enumerate(best)]), joined(candidates[0])


def best_of_speech(
    model: UnifiedModel,
    builder: SequenceBuilder,
    prompts: list[list[int]],
    n: int,
    draw: Callable[[list[list[int]]], list[Tensor]],
) -> tuple[list[Tensor], list[Tensor]]:
    """Codec codes `[F, Q]` for caption-to-speech `prompts`: the best of `n` draws each (read back as their
    codes), and the first draws. `draw` is a sampler call giving one `[F, Q]` a prompt."""
    candidates = draw_candidates(draw, prompts, n)
    segments = [[AudioSegment(codes=c, predict=False) if len(c) else None for c in row] for row in candidates]
    best, _ = rank_candidates(model, builder, [prompt_caption(p) for p in prompts], segments)
    return [candidates[c][i] for i, c in enumerate(best)], candidates[0]
