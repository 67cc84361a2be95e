"""Decode steps: one backbone pass that feeds the next group of every row, one function per kind of group.

Generation goes group by group, as training laid the sequence out (DESIGN.md, "everything is a group"):

- `prefill`: a left-padded prompt batch (any groups: text, media) into a new KV cache;
- `text_step`: the next text id(s) of every row, one group each;
- `visual_scale_step`: scale k of a latent frame (NFSP, ERNIE 5.0 3.2): its s*s positions are one group
  on the finest grid (`zoo.batch.scale_coordinates`), their input the tokenizer's teacher-forcing features
  of the coarser scales drawn so far (`zoo.models.sampling.guided_logits` mixes in classifier-free guidance);
- `audio_frame_step`: one codec frame (NCP, 3.3), its levels' embeddings summed, one group;
- `mtp_draft_step`: the first MTP module over positions the backbone just fed (speculative decoding).

A `Cursor` says where each row's next group goes; a `Recording` keeps, per row, what RL needs of a loop:
the log-prob of every sampled decision and, per MoE layer, the experts of every position fed. The loops
over these steps are `zoo.models.generation` (text, speculation) and `zoo.models.media_generation`
(images, video, speech, text after media); the RL engine (`zoo.rl.rollout`) schedules the same steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from zoo.batch import PAD_DOC, GroupBatch, Modality, scale_coordinates
from zoo.models.backbone import BackboneOutput
from zoo.models.elastic import ElasticConfig
from zoo.models.kv_cache import KVCache

if TYPE_CHECKING:
    from zoo.models.decodable import DecodingModel


# ---------------------------------------------------------------------------------------------- batches


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


def text_prompts(model: DecodingModel, prompts: list[list[int]]) -> GroupBatch:
    """Unified-id prompts as a left-padded text batch on the model's device."""
    return text_batch(*left_pad(prompts, model.vocab.pad_id, next(model.parameters()).device))


def step_batch(
    modality: Modality, t: Tensor, h: Tensor, w: Tensor, group: Tensor, ids: Tensor | None = None
) -> GroupBatch:
    """A decode step's `[R, n]` new positions: one document a row, Uni-RoPE coordinates (t, h, w)."""
    return GroupBatch(
        input_ids=torch.zeros_like(t) if ids is None else ids,
        modality=torch.full_like(t, int(modality)),
        group_id=group,
        doc_id=torch.zeros_like(t),
        positions=torch.stack([t, h, w]),
    )


def append_positions(batch: GroupBatch, step: GroupBatch) -> GroupBatch:
    """`batch` followed by a step's positions: the whole sequence, for decoding without a cache."""
    if batch.has_media:
        raise ValueError("decoding without a cache re-embeds the whole sequence: only text prompts can")
    return GroupBatch(
        input_ids=torch.cat([batch.input_ids, step.input_ids], dim=1),
        modality=torch.cat([batch.modality, step.modality], dim=1),
        group_id=torch.cat([batch.group_id, step.group_id], dim=1),
        doc_id=torch.cat([batch.doc_id, step.doc_id], dim=1),
        positions=torch.cat([batch.positions, step.positions], dim=2),
    )


@dataclass
class Cursor:
    """Where each row's next group goes: its time index t (Uni-RoPE's first axis; h = w = t for text and
    audio) and its group id, `[R]` each."""

    t: Tensor
    group: Tensor

    @classmethod
    def after(cls, batch: GroupBatch) -> Cursor:
        """The position after each row's last one (left padding puts it at the end of the row)."""
        valid = batch.valid
        t = torch.where(valid, batch.positions[0], -1).amax(-1) + 1
        group = torch.where(valid, batch.group_id, -1).amax(-1) + 1
        return cls(t, group)

    @classmethod
    def at(cls, t: Sequence[int], group: Sequence[int], device: torch.device) -> Cursor:
        return cls(torch.tensor(list(t), device=device), torch.tensor(list(group), device=device))

    def advance(self, n: int = 1) -> Cursor:
        """After n more groups of one position (text tokens, audio frames)."""
        return Cursor(self.t + n, self.group + n)


# ---------------------------------------------------------------------------------------------- recording


def routing_per_row(out: BackboneOutput, batch: GroupBatch) -> list[dict[int, Tensor]]:
    """A pass's expert ids per row: MoE layer -> `[positions of the row, top_k]` (its valid positions)."""
    counts = batch.valid.sum(1).tolist()
    split = {layer: chosen.split(counts) for layer, chosen in out.routing.items()}
    return [{layer: parts[row] for layer, parts in split.items()} for row in range(len(counts))]


class Recording:
    """What a decode loop did, per row: the log-prob of every decision it sampled (`zoo.models.sampling`)
    and, with `routing`, per MoE layer the experts of every position it fed, prompt included (what RL
    router replay forces). Rows are the loop's rows (with guidance: the conditional rows, then the
    unconditional ones, which are fed but sample nothing)."""

    def __init__(self, rows: int, routing: bool = True) -> None:
        self.record_routing = routing
        self.logprobs: list[list[float]] = [[] for _ in range(rows)]
        self._routing: list[dict[int, list[Tensor]]] = [{} for _ in range(rows)]

    def fed(self, out: BackboneOutput, batch: GroupBatch, rows: Sequence[int] | None = None) -> None:
        """A pass over `batch` (its rows are this recording's): keep the routing of `rows` (default all)."""
        if not self.record_routing:
            return
        per_row = routing_per_row(out, batch)
        for row in range(len(per_row)) if rows is None else rows:
            for layer, chosen in per_row[row].items():
                self._routing[row].setdefault(layer, []).append(chosen)

    def fed_step(self, routing: dict[int, Tensor]) -> None:
        """A static step's routing (`zoo.models.static_step`): per MoE layer `[R * n, k]`, n real positions
        a row, row-major."""
        if not self.record_routing:
            return
        rows = len(self._routing)
        for layer, chosen in routing.items():
            for row, part in enumerate(chosen.view(rows, -1, chosen.shape[-1])):
                self._routing[row].setdefault(layer, []).append(part)

    def sampled(self, rows: Sequence[int], logprobs: Tensor) -> None:
        """`[len(rows), n]` log-probs of the n decisions each of `rows` just sampled."""
        for row, values in zip(rows, logprobs.tolist(), strict=True):
            self.logprobs[row] += values

    def routing(self, row: int) -> dict[int, Tensor]:
        """MoE layer -> `[positions fed, top_k]` expert ids of one row."""
        return {layer: torch.cat(chunks) for layer, chunks in self._routing[row].items()}


# ---------------------------------------------------------------------------------------------- steps


def prefill(
    model: DecodingModel,
    batch: GroupBatch,
    extra: int,
    recording: Recording | None = None,
    elastic: ElasticConfig | None = None,
) -> tuple[BackboneOutput, Cursor, KVCache]:
    """Feed a left-padded prompt batch into a new KV cache with room for `extra` more positions per row;
    returns the pass (its last column is every row's last position), the cursor after it, the cache."""
    if batch.seq_len + extra > model.backbone.max_seq_len:
        raise ValueError(f"prompt ({batch.seq_len}) + generated positions ({extra}) exceed max_seq_len")
    cache = model.backbone.new_cache(batch.batch_size, batch.seq_len + extra)
    out = model.forward_hidden(batch, cache=cache, elastic=elastic)
    if recording is not None:
        recording.fed(out, batch)
    return out, Cursor.after(batch), cache


def text_step(
    model: DecodingModel,
    cache: KVCache | None,
    ids: Tensor,
    cursor: Cursor,
    elastic: ElasticConfig | None = None,
    recording: Recording | None = None,
    before: GroupBatch | None = None,
) -> tuple[BackboneOutput, GroupBatch]:
    """Feed `[R, n]` text ids after `cursor`, one group each. Without a cache the whole sequence is run
    again: `before` (the sequence so far) followed by the ids. Returns the pass and what it ran."""
    offsets = torch.arange(ids.shape[1], device=ids.device)
    t, group = cursor.t[:, None] + offsets, cursor.group[:, None] + offsets
    batch = step_batch(Modality.TEXT, t, t, t, group, ids)
    if cache is None and before is not None:
        batch = append_positions(before, batch)
    out = model.forward_hidden(batch, cache=cache, elastic=elastic)
    if recording is not None:
        recording.fed(out, batch)
    return out, batch


def visual_scale_step(
    model: DecodingModel,
    cache: KVCache,
    codes: list[Tensor],
    frame: int,
    scale: int,
    t0: Tensor,
    group: Tensor,
    modality: Modality = Modality.IMAGE,
    raster: bool = False,
    recording: Recording | None = None,
) -> Tensor:
    """Feed scale `scale` of latent frame `frame` of every row's image or video as one group (`raster`: one
    group a position, the token-by-token baseline of `benchmarks/nfsp.py`). codes: per scale `[R, F, s, s]`,
    the scales before `scale` drawn; t0 `[R]`: the visual item's first time index; group `[R]`: the
    scale's group id. Returns its hidden states `[R, s*s, D]`."""
    nfsp = model.nfsp
    rows, side = t0.shape[0], nfsp.scales[scale]
    known = codes[:scale] + [torch.zeros_like(codes[scale])]
    features = nfsp.tokenizer.scale_inputs(known)[scale][:, frame].flatten(1, 2)  # [R, s*s, C]
    x = nfsp.embed_features(features, torch.full((rows, side * side), scale, device=t0.device))
    coords = torch.tensor(scale_coordinates(side, nfsp.scales[-1]), device=t0.device)
    h = (t0[:, None] + coords.repeat_interleave(side)[None]).expand(rows, -1)
    w = (t0[:, None] + coords.repeat(side)[None]).expand(rows, -1)
    t = (t0 + frame)[:, None].expand(rows, side * side)
    if not raster:
        batch = step_batch(modality, t, h, w, group[:, None].expand(rows, side * side))
        out = model.forward_hidden(batch, cache=cache, inputs=x)
        if recording is not None:
            recording.fed(out, batch)
        return out.hidden
    hidden = []
    for j in range(side * side):
        one = slice(j, j + 1)
        batch = step_batch(modality, t[:, one], h[:, one], w[:, one], (group + j)[:, None])
        out = model.forward_hidden(batch, cache=cache, inputs=x[:, one])
        if recording is not None:
            recording.fed(out, batch)
        hidden.append(out.hidden)
    return torch.cat(hidden, dim=1)


def audio_frame_step(
    model: DecodingModel,
    cache: KVCache,
    codes: Tensor,
    cursor: Cursor,
    recording: Recording | None = None,
    rows: Sequence[int] | None = None,
) -> BackboneOutput:
    """Feed one codec frame `[R, Q]` per row after `cursor`, its levels' embeddings summed, as one group;
    the recording keeps the routing of `rows` only (default all)."""
    t = cursor.t[:, None]
    batch = step_batch(Modality.AUDIO, t, t, t, cursor.group[:, None])
    out = model.forward_hidden(batch, cache=cache, inputs=model.ncp.embed_codes(codes)[:, None])
    if recording is not None:
        recording.fed(out, batch, rows)
    return out


def mtp_draft_step(
    model: DecodingModel, cache: KVCache, hidden: Tensor, next_ids: Tensor, cursor: Cursor
) -> Tensor:
    """The first MTP module over positions the backbone just fed (`hidden` `[R, n, D]`), each reading the
    id that follows it (`next_ids` `[R, n]`); returns its states, whose logits draft the id after that.
    `cache` is the module's own one-layer cache, kept in step with the backbone's."""
    offsets = torch.arange(next_ids.shape[1], device=next_ids.device)
    t, group = cursor.t[:, None] + offsets, cursor.group[:, None] + offsets
    batch = step_batch(Modality.TEXT, t, t, t, group, next_ids)
    ctx = model.backbone.context(batch, cache)
    return model.text_head.mtp[0](hidden, model.text_embed(next_ids), ctx)
