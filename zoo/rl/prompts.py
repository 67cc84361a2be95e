"""Prompts with media for RL: an image, a clip or speech followed by text the policy writes (issue 5).

A prompt is either unified ids laid out as text (one token per group, t = h = w = its index: the text
tasks) or a `Document` (`zoo.datamodules.sequence`) whose segments carry media. For a document:

- `PromptLayout.prepare` tokenizes its media once, with the model's frozen visual tokenizer / audio
  codec, into codes (`VisualSegment(codes=...)`, `AudioSegment(codes=...)`). The engine and the trainer
  then embed the same codes whatever precision either runs in, and no forward re-encodes pixels. Context
  images stay pixels: the vision encoder is trained with the policy.
- the rollout's `prompt_ids` are the document's laid-out input ids (`pad_id` where media sit), so
  lengths, response offsets and recorded routing index positions exactly as for text prompts.
- `PromptLayout.batch` lays out rows of prompt + response: the response continues the document as text,
  one group a token, t and the group id going on after the prompt's last (as `generate_text_after`
  decodes).

A prompt of unified ids ending with `<boi>` asks for an image (`asks_for_image`, when the model has a
visual tokenizer): its response is the image's NFSP codes as unified visual ids, coarse scale to fine,
laid out for the trainer as the `VisualSegment` pretraining used (one group a scale on the finest grid),
without its closing `<eoi>`, which no policy decision produced.

A prompt ending with `<boa>` asks for speech (`asks_for_speech`, when the model has an audio codec): its
response is the NCP frames, each frame's Q codes as unified audio ids (level q in its own block), then
`<eoa>` when level 1 sampled END. Those are the policy's decisions (Q a frame, one for END); the
positions are one a frame (`response_positions`), laid out as the pretraining `AudioSegment`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from zoo.batch import PAD_DOC, GroupBatch, Modality
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
from zoo.models.nfsp import flatten_scales, unflatten_scales

if TYPE_CHECKING:
    from zoo.models.unified import UnifiedModel

Prompt = list[int] | Document
SEGMENTS = (TextSegment, VisualSegment, AudioSegment, ContextSegment)
# (prompt document or None, prompt ids, response ids): one row of `PromptLayout.batch`.
Row = tuple[Document | None, list[int], list[int]]


def is_document(prompt: object) -> bool:
    """True for a list of segments (a prompt with media), False for unified ids."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], SEGMENTS)


def asks_for_image(model: UnifiedModel, prompt_ids: list[int]) -> bool:
    """A text prompt ending with `<boi>` to a model with a visual tokenizer: the response is an image."""
    return model.nfsp is not None and bool(prompt_ids) and prompt_ids[-1] == model.vocab.special("<boi>")


def asks_for_speech(model: UnifiedModel, prompt_ids: list[int]) -> bool:
    """A text prompt ending with `<boa>` to a model with an audio codec: the response is speech."""
    return model.ncp is not None and bool(prompt_ids) and prompt_ids[-1] == model.vocab.special("<boa>")


def speech_codes(model: UnifiedModel, response_ids: list[int]) -> tuple[Tensor, bool]:
    """A speech response's unified ids -> (codec codes `[F, Q]`, whether it ended with END)."""
    ended = bool(response_ids) and response_ids[-1] == model.vocab.special("<eoa>")
    ids = torch.tensor(response_ids[: len(response_ids) - ended], dtype=torch.long)
    levels = model.ncp.levels
    frames = ids.view(-1, levels) - model.vocab.audio_offset
    return frames - torch.arange(levels) * model.vocab.audio_size, ended


def speech_ids(model: UnifiedModel, codes: Tensor) -> list[int]:
    """Codec codes `[F, Q]` -> unified audio ids, frame by frame (level q in its block)."""
    levels = torch.arange(codes.shape[-1], device=codes.device) * model.vocab.audio_size
    return (codes + levels + model.vocab.audio_offset).flatten().tolist()


def response_positions(model: UnifiedModel, prompt_ids: list[int], response_ids: list[int]) -> int:
    """Positions a response occupies: one a token (text, image codes), one a frame (speech)."""
    if asks_for_speech(model, prompt_ids):
        ended = bool(response_ids) and response_ids[-1] == model.vocab.special("<eoa>")
        return (len(response_ids) - ended) // model.ncp.levels
    return len(response_ids)


def image_codes(model: UnifiedModel, response_ids: list[int]) -> list[Tensor]:
    """An image response's unified visual ids -> the tokenizer's codes per scale `[1, 1, s, s]`."""
    codes = torch.tensor(response_ids, dtype=torch.long) - model.vocab.visual_offset
    return unflatten_scales(codes[None], model.nfsp.scales, 1)


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

    def batch(self, rows: Sequence[Row], left: bool) -> GroupBatch:
        """Prompt + response of every row, one document a row, left- (`left`, for a prefill that continues
        every row) or right-padded, on the model's device."""
        device = next(self.model.parameters()).device
        model = self.model
        media = [bool(r) and (asks_for_image(model, p) or asks_for_speech(model, p)) for _, p, r in rows]
        if all(document is None for document, _, _ in rows) and not any(media):
            seqs = [prompt + response for _, prompt, response in rows]
            return text_rows(seqs, self.model.vocab.pad_id, left, device)
        if left and any(media):
            raise ValueError("image and speech responses are laid out for the trainer only (right padding)")
        documents = []
        for (document, prompt, response), drawn in zip(rows, media, strict=True):
            # VisualSegment / AudioSegment write the prompt's closing <boi> / <boa> themselves.
            if drawn and asks_for_image(model, prompt):
                codes = torch.tensor(response, dtype=torch.long) - self.model.vocab.visual_offset
                documents.append([TextSegment(prompt[:-1], predict=False), VisualSegment(codes=codes)])
            elif drawn:
                frames, _ = speech_codes(model, response)
                speech = [AudioSegment(codes=frames)] if len(frames) else []
                documents.append([TextSegment(prompt[: len(prompt) - bool(speech)], predict=False), *speech])
            elif document is None:
                documents.append([TextSegment(prompt + response, predict=False)])
            else:
                tail = [TextSegment(list(response), predict=False)] if response else []
                documents.append([*document, *tail])
        length = max(self.builder.length(d) for d in documents)
        batch = self.builder.layout_rows([[d] for d in documents], length, left_pad=left)
        for row, ((_, prompt, response), drawn) in enumerate(zip(rows, media, strict=True)):
            end = len(prompt) + response_positions(model, prompt, response)
            if drawn and end < length and batch.doc_id[row, end] != PAD_DOC:
                # The closing <eoi> / <eoa> is no decision of the policy: out of the sequence.
                batch.doc_id[row, end] = PAD_DOC
                batch.modality[row, end] = int(Modality.PAD)
        return batch.to(device)


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
