"""The group batch: the one data structure the backbone consumes (DESIGN.md, "everything is a group").

A packed sequence is a list of groups. A position attends to every position of its own group and of
all earlier groups of the same document; inside a group attention is bidirectional. The mask is a
function of (doc_id, group_id) alone, so one rule serves text (one token per group), visual scales
(one group per scale of one frame) and audio frames (one group per codec frame).

`datamodules/sequence.py` builds these; `models/` reads them; nothing here knows a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from enum import IntEnum

import torch
from torch import Tensor

IGNORE_INDEX = -100
PAD_DOC = -1  # doc_id of padding positions: they belong to no document


class Modality(IntEnum):
    """Where a position's content came from. Used by embedders, heads and statistics, never by routing."""

    PAD = 0
    TEXT = 1
    IMAGE = 2
    VIDEO = 3
    AUDIO = 4
    CONTEXT = 5  # continuous understanding inputs (an encoded image or clip): no targets


@dataclass
class GroupBatch:
    """A packed batch of group sequences; every tensor is `[B, L]` unless noted.

    Attributes:
        input_ids: unified-vocabulary ids where the input is a token, `pad_id` elsewhere.
        modality: a `Modality` per position.
        group_id: monotone within a document; equal ids attend bidirectionally.
        doc_id: document index within the row (`PAD_DOC` for padding); documents never see each other.
        positions: `[3, B, L]` (t, h, w) coordinates for Uni-RoPE.
        targets: per head name, e.g. `"text"`: `[B, L]` ids predicted at each position (the content
            of the next group), `IGNORE_INDEX` where the position predicts nothing for that head.
        payloads: per modality, whatever that modality's embedder needs (code maps, pixels, ...).
    """

    input_ids: Tensor
    modality: Tensor
    group_id: Tensor
    doc_id: Tensor
    positions: Tensor
    targets: dict[str, Tensor] = field(default_factory=dict)
    payloads: dict[str, Tensor] = field(default_factory=dict)

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

    def to(self, device: torch.device | str) -> GroupBatch:
        return replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in fields(self)
                if f.name not in ("targets", "payloads")
            },
            targets={k: v.to(device) for k, v in self.targets.items()},
            payloads={k: v.to(device) for k, v in self.payloads.items()},
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


def scale_coordinates(side: int, finest: int) -> list[int]:
    """Uni-RoPE h (or w) offsets of the cells of a `side x side` scale on the `finest x finest` grid: cell i
    sits at the centre of the cells it covers there (Infinity's layout, so every scale shares one grid)."""
    return [(i * finest + finest // 2) // side for i in range(side)]
