"""The group batch: the one data structure the backbone consumes (DESIGN.md, "everything is a group").

A packed sequence is a list of groups. A position attends to every position of its own group and of
all earlier groups of the same document; inside a group attention is bidirectional. The mask is a
function of (doc_id, group_id) alone, so one rule serves text (one token per group), visual scales
(one group per scale of one frame) and audio frames (one group per codec frame).

`datamodules/sequence.py` builds these; `models/` reads them; nothing here knows a model. The media of a
batch travel as typed payloads, one per kind of media group (`VisualPayload`, `AudioPayload`,
`ContextPayload`): what the embedders need to compute their positions' inputs (pixels, waveforms, given
codes) and which position holds which token. What each head predicts is in `GroupBatch.targets`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from enum import IntEnum
from typing import TypeVar

import torch
from torch import Tensor

IGNORE_INDEX = -100
PAD_DOC = -1  # doc_id of padding positions: they belong to no document
NO_SLOT = -1  # a position holds no token of a payload (slots), or predicts none (visual and audio targets)

_Moved = TypeVar("_Moved")


def _to(value: _Moved, device: torch.device | str) -> _Moved:
    """A dataclass with every tensor field on `device` (other fields as they are)."""
    tensors = {f.name: getattr(value, f.name) for f in fields(value)}
    return replace(value, **{k: v.to(device) for k, v in tensors.items() if isinstance(v, Tensor)})


class Modality(IntEnum):
    """Where a position's content came from. Used by embedders, heads and statistics, never by routing."""

    PAD = 0
    TEXT = 1
    IMAGE = 2
    VIDEO = 3
    AUDIO = 4
    CONTEXT = 5  # continuous understanding inputs (an encoded image or clip): no targets


class VisualItem(IntEnum):
    """Where a visual item of a batch comes from (`VisualPayload.items[:, 0]`)."""

    IMAGE = 0  # index into `image_pixels`
    VIDEO = 1  # index into `video_pixels`
    CODES = 2  # index = offset into `codes` (pre-tokenized, or generated and fed back)


class AudioItem(IntEnum):
    """Where an audio item of a batch comes from (`AudioPayload.items[:, 0]`)."""

    WAVE = 0  # index into `waves` / `lengths`
    CODES = 1  # index = first row in `codes`


@dataclass
class VisualPayload:
    """The images, videos and given codes of a batch's NFSP groups, and where their tokens sit.

    Attributes:
        items: `[N, 5]` long, per visual item in token order: (`VisualItem`, index, first token, latent
            frames, read). Its tokens are numbered `first .. first + frames * tokens_per_frame - 1`. `read`
            is 1 for an item that is input only (understanding: its inputs are `scale_readings`, the whole
            image through each scale) and 0 for one whose codes are predicted (VAR teacher forcing).
        slot: `[B, L]` the visual token a position holds (its input is that token's teacher-forcing
            features), `NO_SLOT` elsewhere.
        scale: `[B, L]` the scale index of that token (`NO_SLOT` elsewhere).
        scales: the side of every scale, coarse to fine, as laid out (the visual tokenizer must agree).
        image_pixels: `[N_images, 3, H, W]` in [-1, 1], or None.
        video_pixels: `[N_videos, 3, T, H, W]` in [-1, 1], or None.
        codes: flat long codes given by the data, in (frame, scale, row, col) order, or None.
    """

    items: Tensor
    slot: Tensor
    scale: Tensor
    scales: tuple[int, ...]
    image_pixels: Tensor | None = None
    video_pixels: Tensor | None = None
    codes: Tensor | None = None

    def to(self, device: torch.device | str) -> VisualPayload:
        return _to(self, device)


@dataclass
class AudioPayload:
    """The waveforms and given codes of a batch's NCP groups, and where their frames sit.

    Attributes:
        items: `[N, 4]` long, per audio item in frame order: (`AudioItem`, index, first frame, frames).
        slot: `[B, L]` the codec frame a position holds (its input is that frame's codes), `NO_SLOT`
            elsewhere.
        hop: waveform samples per codec frame, as laid out (the codec must agree).
        waves: `[N_waves, S]` mono waveforms, zero-padded past `lengths`, or None.
        lengths: `[N_waves]` long, the samples of each waveform, or None.
        codes: `[F, Q]` long codec codes given by the data, or None.
    """

    items: Tensor
    slot: Tensor
    hop: int
    waves: Tensor | None = None
    lengths: Tensor | None = None
    codes: Tensor | None = None

    def to(self, device: torch.device | str) -> AudioPayload:
        return _to(self, device)


@dataclass
class ContextPayload:
    """The images a batch's context groups show the vision encoder (understanding inputs, no targets).

    Attributes:
        pixels: `[N_images, 3, H, W]` in [-1, 1].
        slot: `[B, L]` the encoder token a position holds (image i's tokens are `i * rows * cols ..`, row
            major), `NO_SLOT` elsewhere.
        grid: (rows, cols) of encoder tokens per image, as laid out (the vision encoder must agree).
    """

    pixels: Tensor
    slot: Tensor
    grid: tuple[int, int]

    def to(self, device: torch.device | str) -> ContextPayload:
        return _to(self, device)


@dataclass
class GroupBatch:
    """A packed batch of group sequences; every tensor is `[B, L]` unless noted.

    Attributes:
        input_ids: unified-vocabulary ids where the input is a token, `pad_id` elsewhere.
        modality: a `Modality` per position.
        group_id: monotone within a document; equal ids attend bidirectionally.
        doc_id: document index within the row (`PAD_DOC` for padding); documents never see each other.
        positions: `[3, B, L]` (t, h, w) coordinates for Uni-RoPE.
        targets: what each head predicts at each position, `[B, L]` per name:
            `"text"`: the text id (the content of the next group), `IGNORE_INDEX` where none;
            `"visual"`: the visual token (`VisualPayload` numbering) whose code it predicts, `NO_SLOT` where
            none; `"audio"`: the codec frame whose codes it predicts, `NO_SLOT` where none; `"audio_end"`:
            bool, it predicts the end of its audio. The visual and audio targets exist when the payload does.
        visual: the NFSP media (images, videos, codes), or None.
        audio: the NCP media (waveforms, codes), or None.
        context: the vision encoder's images, or None.
    """

    input_ids: Tensor
    modality: Tensor
    group_id: Tensor
    doc_id: Tensor
    positions: Tensor
    targets: dict[str, Tensor] = field(default_factory=dict)
    visual: VisualPayload | None = None
    audio: AudioPayload | None = None
    context: ContextPayload | None = None

    def __post_init__(self) -> None:
        shape = self.input_ids.shape
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, L], got shape {tuple(shape)}")
        for name in ("modality", "group_id", "doc_id"):
            if getattr(self, name).shape != shape:
                raise ValueError(
                    f"{name} has shape {tuple(getattr(self, name).shape)}, expected {tuple(shape)}"
                )
        if self.positions.shape != (3, *shape):
            raise ValueError(
                f"positions has shape {tuple(self.positions.shape)}, expected (3, {shape[0]}, {shape[1]})"
            )
        for name, target in self.targets.items():
            if target.shape[:2] != shape:
                raise ValueError(
                    f"targets[{name!r}] has leading shape {tuple(target.shape[:2])}, expected {tuple(shape)}"
                )

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def valid(self) -> Tensor:
        """`[B, L]` bool: positions that belong to a document."""
        return self.doc_id != PAD_DOC

    @property
    def has_media(self) -> bool:
        """Whether any position is fed by a payload (visual, audio or context groups)."""
        return self.visual is not None or self.audio is not None or self.context is not None

    def to(self, device: torch.device | str) -> GroupBatch:
        """The batch on `device`: every tensor, the targets' and the payloads' included. Lightning moves a
        batch by calling this (a batch has `.to`), under single-device, DDP and FSDP2 strategies alike."""
        payloads = {name: getattr(self, name) for name in ("visual", "audio", "context")}
        return replace(
            _to(self, device),
            targets={k: v.to(device) for k, v in self.targets.items()},
            **{name: None if p is None else p.to(device) for name, p in payloads.items()},
        )

    def attention_mask(self) -> Tensor:
        """`[B, 1, L, L]` bool mask for `scaled_dot_product_attention` (True = may attend)."""
        return group_attention_mask(self.doc_id, self.group_id, self.doc_id, self.group_id, query_offset=0)


def group_attention_mask(
    query_doc: Tensor, query_group: Tensor, key_doc: Tensor, key_group: Tensor, query_offset: int
) -> Tensor:
    """The group rule: q sees k iff same document and `group[k] <= group[q]`.

    Queries are the keys at indices `query_offset .. query_offset + Lq` (a KV-cache step), so every
    query also sees itself: a padding row is never fully masked (that would give NaN in softmax).
    Returns `[B, 1, Lq, Lk]` bool.
    """
    same_doc = query_doc[:, :, None] == key_doc[:, None, :]
    earlier_group = key_group[:, None, :] <= query_group[:, :, None]
    real = (query_doc != PAD_DOC)[:, :, None]
    lq, lk = query_doc.shape[1], key_doc.shape[1]
    q_index = torch.arange(query_offset, query_offset + lq, device=query_doc.device)
    k_index = torch.arange(lk, device=query_doc.device)
    itself = q_index[:, None] == k_index[None, :]
    return ((same_doc & earlier_group & real) | itself)[:, None]


def group_mask_mod(doc_id: Tensor, group_id: Tensor):  # noqa: ANN201 (FlexAttention's mask_mod callable)
    """The group rule of `group_attention_mask` (self-attention, no cache) as a FlexAttention `mask_mod`:
    `(b, h, q, k) -> bool` over `[B, L]` ids, for `create_block_mask`. The same rule, evaluated per block
    instead of materialised as `[B, 1, L, L]`."""

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        same_doc = doc_id[b, q] == doc_id[b, k]
        earlier_group = group_id[b, k] <= group_id[b, q]
        return (same_doc & earlier_group & (doc_id[b, q] != PAD_DOC)) | (q == k)

    return mask_mod


def scale_coordinates(side: int, finest: int) -> list[int]:
    """Uni-RoPE h (or w) offsets of the cells of a `side x side` scale on the `finest x finest` grid: cell i
    sits at the centre of the cells it covers there (Infinity's layout, so every scale shares one grid)."""
    return [(i * finest + finest // 2) // side for i in range(side)]
