"""Prompts for RL: unified ids, or a document with media (an image, a clip or speech to caption; issue 5).

A prompt is either unified ids laid out as text (one token per group, t = h = w = its index: the text
tasks) or a `Document` (`zoo.datamodules.sequence`) whose segments carry media. For a document:

- `PromptLayout.prepare` tokenizes its media once, with the model's frozen visual tokenizer / audio
  codec, into codes (`VisualSegment(codes=...)`, `AudioSegment(codes=...)`). The engine and the trainer
  then embed the same codes whatever precision either runs in, and no forward re-encodes pixels. Context
  images stay pixels: the vision encoder is trained with the policy.
- the rollout's `prompt_ids` are the document's laid-out input ids (`pad_id` where media sit), so
  lengths, response offsets and recorded routing index positions exactly as for text prompts.

What follows the prompt, and how prompt + response are laid out for the engine and the trainer, is the
response kind's (`zoo.rl.responses`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zoo.batch import PAD_DOC, GroupBatch
from zoo.datamodules.sequence import (
    AudioSegment,
    ContextSegment,
    Document,
    MediaLayout,
    SequenceBuilder,
    TextSegment,
    VisualSegment,
)
from zoo.models.decode import left_pad, text_batch
from zoo.models.nfsp import flatten_scales

if TYPE_CHECKING:
    from zoo.models.unified import UnifiedModel

Prompt = list[int] | Document
SEGMENTS = (TextSegment, VisualSegment, AudioSegment, ContextSegment)
# (prompt document or None, prompt ids, response ids): one row of `zoo.rl.responses.rollout_batch`.
Row = tuple[Document | None, list[int], list[int]]


def is_document(prompt: object) -> bool:
    """True for a list of segments (a prompt with media), False for unified ids."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], SEGMENTS)


class PromptLayout:
    """Lays out a model's prompts and rollouts as group batches (see the module docstring)."""

    def __init__(self, model: UnifiedModel) -> None:
        self.model = model
        self.builder = SequenceBuilder(model.vocab, model.backbone.max_seq_len, layout=MediaLayout.of(model))

    @torch.no_grad()
    def prepare(self, document: Document) -> tuple[Document, list[int]]:
        """(the document with its media tokenized to codes, its laid-out unified ids)."""
        if not is_document(document) or not all(isinstance(s, SEGMENTS) for s in document):
            raise TypeError("a media prompt must be a non-empty list of zoo.datamodules.sequence segments")
        prepared = [self._tokenize(segment) for segment in document]
        length = self.builder.length(prepared)
        if length > self.model.backbone.max_seq_len:
            raise ValueError(
                f"prompt of {length} positions exceeds the context of {self.model.backbone.max_seq_len}"
            )
        ids = self.builder.layout_rows([[prepared]], length).input_ids[0].tolist()
        return prepared, ids

    def _tokenize(self, segment: object) -> object:
        device = next(self.model.parameters()).device
        if isinstance(segment, VisualSegment) and segment.pixels is not None:
            tokenizer = self.model.visual_tokenizer
            if tokenizer is None:
                raise ValueError("the prompt holds an image or video but the model has no visual_tokenizer")
            pixels = segment.pixels[None].to(device, next(tokenizer.parameters()).dtype)
            if not segment.is_video and tokenizer.temporal:
                pixels = pixels.unsqueeze(2)  # an image is a one-frame video for a 3D tokenizer
            codes = flatten_scales(tokenizer.encode(pixels))[0].long().cpu()
            return VisualSegment(codes=codes, predict=False, video=segment.is_video)
        if isinstance(segment, AudioSegment) and segment.wave is not None:
            codec = self.model.audio_codec
            if codec is None:
                raise ValueError("the prompt holds audio but the model has no audio_codec")
            wave = segment.wave[None].to(device, next(codec.parameters()).dtype)
            return AudioSegment(codes=codec.encode(wave)[0].long().cpu(), predict=False)
        return segment


def text_rows(seqs: list[list[int]], pad_id: int, left: bool, device: torch.device) -> GroupBatch:
    """Unified-id sequences as a text GroupBatch, one document a row, left- or right-padded."""
    if left:
        return text_batch(*left_pad(seqs, pad_id, device))
    longest = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), longest), pad_id, dtype=torch.long, device=device)
    doc = torch.full_like(ids, PAD_DOC)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long, device=device)
        doc[row, : len(seq)] = 0
    index = torch.arange(longest, device=device).expand(len(seqs), -1).contiguous()
    return text_batch(ids, doc, index)
