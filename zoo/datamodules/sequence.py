"""Builds packed group sequences (`zoo.batch.GroupBatch`) from documents (DESIGN.md, "everything is a group").

A document is a list of segments; each segment lays out its own groups:

- `TextSegment`: one token per group; a text position predicts the next token (when that token's
  segment has `predict=True`).
- `VisualSegment` (NFSP): `<boi>` (image) or `<bov>` (video), then for every latent frame its scales
  coarse to fine, one group per scale, then `<eoi>`/`<eov>`. A scale's positions predict their own codes;
  their inputs (the accumulated codes of the coarser scales) are computed by the model, which owns the
  frozen visual tokenizer. Uni-RoPE: every scale's (h, w) lands on the finest grid; frames advance t.
- `AudioSegment` (NCP): `<boa>`, one group per codec frame, `<eoa>`. A frame position's input is its
  own codes and it predicts the next frame's (the `<boa>` position predicts frame 0, the last frame
  predicts "end of audio"), so the input of a frame is the previous frame, as in the paper.
- `ContextSegment`: an image (or a video's frames) seen by the vision encoder: `<boi>`, one group of
  encoder tokens (no targets), `<eoi>`; a video `<bov>`, one such group per frame (frames advance t), `<eov>`.

Media travel as pixels, waveforms or codes in the batch's typed payloads (`zoo.batch.VisualPayload`,
`AudioPayload`, `ContextPayload`), with per-position slots that say which visual token / audio frame /
context token a position holds, so the model can encode them once per batch and scatter the results; the
visual and audio targets (which token or frame a position predicts) are in `GroupBatch.targets`.
Documents are packed into rows of `seq_len`, in order or first-fit decreasing (`SequenceBuilder.packing`); a
document never spans two rows and never sees another (the mask keys on `doc_id`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from zoo.batch import (
    IGNORE_INDEX,
    NO_SLOT,
    PAD_DOC,
    AudioItem,
    AudioPayload,
    ContextPayload,
    GroupBatch,
    Modality,
    VisualItem,
    VisualPayload,
    scale_coordinates,
)
from zoo.tokenizers.vocab import UnifiedVocab


@dataclass
class TextSegment:
    """Unified text ids. `predict=False` marks context (a prompt): present as input, never a target."""

    ids: list[int]
    predict: bool = True

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class VisualSegment:
    """An image `[3, H, W]` or a video `[3, T, H, W]` (floats in [-1, 1]) as NFSP groups.

    `predict=True`: its codes are targets (generation); False: input only (understanding: every scale
    is read whole, the finest included, see `VisualTokenizer.scale_readings`).
    Instead of pixels, `codes` may hold the tokenizer's codes, flat in (frame, scale, row, col) order
    (pre-tokenized data, or generated codes fed back); `video` then says which brackets to use.
    `predict_opener=False`: the position before `<boi>` / `<bov>` gets no target (a medium a conversation's
    user gave is not the model's to open: the loss stays on the assistant's turns).
    """

    pixels: Tensor | None = None
    predict: bool = True
    codes: Tensor | None = None
    video: bool = False
    predict_opener: bool = True

    def __post_init__(self) -> None:
        if (self.pixels is None) == (self.codes is None):
            raise ValueError("a VisualSegment holds either pixels or codes (exactly one of them)")
        if self.pixels is not None and self.pixels.dim() not in (3, 4):
            raise ValueError(f"pixels must be [3, H, W] or [3, T, H, W], got {list(self.pixels.shape)}")
        if self.codes is not None and (self.codes.dim() != 1 or self.codes.dtype != torch.long):
            got = f"{self.codes.dtype} {list(self.codes.shape)}"
            raise ValueError(f"codes must be a flat long tensor, got {got}")

    @property
    def is_video(self) -> bool:
        return self.video if self.pixels is None else self.pixels.dim() == 4


@dataclass
class AudioSegment:
    """A mono waveform `[N]` as NCP frames. `predict=False`: input only (e.g. audio to caption).

    Instead of a waveform, `codes` `[F, Q]` may hold the codec's codes (pre-tokenized or generated).
    `predict_opener=False`: the position before `<boa>` gets no target (as `VisualSegment`'s).
    """

    wave: Tensor | None = None
    predict: bool = True
    codes: Tensor | None = None
    predict_opener: bool = True

    def __post_init__(self) -> None:
        if (self.wave is None) == (self.codes is None):
            raise ValueError("an AudioSegment holds either a waveform or codes (exactly one of them)")
        if self.wave is not None and self.wave.dim() != 1:
            raise ValueError(f"wave must be mono [N], got {list(self.wave.shape)}")
        if self.codes is not None and (self.codes.dim() != 2 or len(self.codes) == 0):
            raise ValueError(f"codes must be [F >= 1, Q], got {list(self.codes.shape)}")


@dataclass
class ContextSegment:
    """An image `[3, H, W]` or a video `[3, T, H, W]` for the vision encoder, never a target: one group of
    context embeddings per image, or per frame of a video (each frame encoded as a still, as ERNIE's
    encoder reads a video's sampled frames). `predict_opener=False`: the position before its `<boi>` /
    `<bov>` gets no target (as `VisualSegment`'s)."""

    pixels: Tensor
    predict_opener: bool = True

    def __post_init__(self) -> None:
        if self.pixels.dim() not in (3, 4) or self.pixels.shape[0] != 3:
            got = list(self.pixels.shape)
            raise ValueError(f"context pixels must be [3, H, W] or [3, T, H, W], got {got}")

    @property
    def is_video(self) -> bool:
        return self.pixels.dim() == 4

    @property
    def frames(self) -> list[Tensor]:
        """The stills the encoder reads, `[3, H, W]` each: the image, or every frame of the video."""
        return list(self.pixels.unbind(1)) if self.is_video else [self.pixels]


Segment = TextSegment | VisualSegment | AudioSegment | ContextSegment
Document = list[Segment]
Packing = Literal["in_order", "first_fit_decreasing"]
PACKINGS: tuple[Packing, ...] = get_args(Packing)


@dataclass(frozen=True)
class MediaLayout:
    """How many positions media take; must agree with the model's tokenizers (the model checks it).

    Args:
        visual_scales: side of each NFSP scale, coarse to fine (the visual tokenizer's `scales`).
        temporal_stride: frames per latent frame after the first (video: T = 1 + stride * k).
        audio_hop: waveform samples per codec frame (the audio codec's `hop`).
        context_grid: (rows, cols) of the vision encoder's tokens per image.
    """

    visual_scales: tuple[int, ...] = (1, 2, 4, 8)
    temporal_stride: int = 4
    audio_hop: int = 640
    context_grid: tuple[int, int] = (4, 4)

    def __post_init__(self) -> None:
        if not self.visual_scales or any(s < 1 for s in self.visual_scales):
            raise ValueError(f"visual_scales must be positive sides, got {self.visual_scales}")
        if list(self.visual_scales) != sorted(self.visual_scales):
            raise ValueError(f"visual_scales must go coarse to fine, got {self.visual_scales}")
        if self.temporal_stride < 1 or self.audio_hop < 1 or min(self.context_grid) < 1:
            raise ValueError("temporal_stride, audio_hop and context_grid must be >= 1")

    @classmethod
    def of(cls, model: object) -> MediaLayout:
        """The layout a `UnifiedModel` reads: its visual tokenizer's scales and temporal stride, its codec's
        hop, its vision encoder's grid (defaults where the model has no such component)."""
        default = cls()
        visual = getattr(model, "visual_tokenizer", None)
        codec = getattr(model, "audio_codec", None)
        encoder = getattr(model, "vision_encoder", None)
        temporal = visual is not None and bool(visual.temporal)
        return cls(
            visual_scales=tuple(visual.scales) if visual is not None else default.visual_scales,
            temporal_stride=visual.temporal_stride if temporal else default.temporal_stride,
            audio_hop=codec.hop if codec is not None else default.audio_hop,
            context_grid=tuple(encoder.grid) if encoder is not None else default.context_grid,
        )

    @property
    def tokens_per_frame(self) -> int:
        return sum(s * s for s in self.visual_scales)

    def latent_frames(self, frames: int) -> int:
        if frames < 1 or (frames - 1) % self.temporal_stride:
            raise ValueError(
                f"a video of {frames} frames does not fit the temporal stride {self.temporal_stride}: "
                f"expected 1 + {self.temporal_stride} * k frames"
            )
        return 1 + (frames - 1) // self.temporal_stride

    def visual_frames(self, segment: VisualSegment) -> int:
        """Latent frames of a visual segment."""
        if segment.codes is not None:
            n = segment.codes.numel()
            if n == 0 or n % self.tokens_per_frame:
                raise ValueError(f"{n} visual codes are not whole frames of {self.tokens_per_frame} codes")
            return n // self.tokens_per_frame
        return self.latent_frames(segment.pixels.shape[1]) if segment.is_video else 1

    def audio_frames(self, samples: int) -> int:
        if samples < 1:
            raise ValueError("empty audio: a waveform needs at least one sample")
        return math.ceil(samples / self.audio_hop)

    def segment_length(self, segment: Segment) -> int:
        if isinstance(segment, TextSegment):
            return len(segment)
        if isinstance(segment, VisualSegment):
            return 2 + self.visual_frames(segment) * self.tokens_per_frame
        if isinstance(segment, AudioSegment):
            frames = len(segment.codes) if segment.codes is not None else self.audio_frames(len(segment.wave))
            return 2 + frames
        if isinstance(segment, ContextSegment):
            return 2 + len(segment.frames) * self.context_grid[0] * self.context_grid[1]
        raise TypeError(f"unknown segment type {type(segment).__name__}")


def document_length(document: Document, layout: MediaLayout | None = None) -> int:
    layout = layout or MediaLayout()
    return sum(layout.segment_length(segment) for segment in document)


class _RowWriter:
    """Writes the positions of the documents of one row; tracks group ids and Uni-RoPE coordinates.

    Columns are collected as Python lists and written into the batch tensors once, by `flush`: a write of
    one tensor element costs microseconds, which made laying out RL batches (thousands of positions per
    forward) slower than the forward itself."""

    _FILL = {"targets": IGNORE_INDEX, "audio_end": False}  # every other per-position column: NO_SLOT

    def __init__(
        self,
        builder: SequenceBuilder,
        row: int,
        out: dict[str, Tensor],
        media: dict[str, list],
        start: int = 0,
    ) -> None:
        self.b, self.row, self.out, self.media = builder, row, out, media
        self.start = self.pos = start
        self.cols: dict[str, list] = {key: [] for key in out if key != "positions"}
        self.coords: tuple[list[int], list[int], list[int]] = ([], [], [])

    def start_document(self, doc: int) -> None:
        self.doc, self.group, self.t = doc, 0, 0
        self.text_predict: list[tuple[int, bool]] = []  # (position, is a predicted text token)

    def _put(self, token: int, modality: Modality, t: int, h: int, w: int, new_group: bool = True) -> int:
        p = self.pos
        for key, column in self.cols.items():
            column.append(self._FILL.get(key, NO_SLOT))
        c = self.cols
        c["ids"][-1], c["modality"][-1] = token, int(modality)
        c["group"][-1], c["doc"][-1] = self.group, self.doc
        for axis, value in zip(self.coords, (t, h, w), strict=True):
            axis.append(value)
        if new_group:
            self.group += 1
        self.pos += 1
        return p

    def set(self, key: str, p: int, value: int | bool) -> None:
        self.cols[key][p - self.start] = value

    def flush(self) -> None:
        """Write the row's columns into the batch tensors."""
        if self.pos == self.start:
            return
        span = slice(self.start, self.pos)
        for key, column in self.cols.items():
            self.out[key][self.row, span] = torch.tensor(column, dtype=self.out[key].dtype)
        self.out["positions"][:, self.row, span] = torch.tensor(self.coords)

    def text(self, token: int, predict: bool) -> int:
        p = self._put(token, Modality.TEXT, self.t, self.t, self.t)
        self.text_predict.append((p, predict))
        self.t += 1
        return p

    def media_break(self) -> None:
        """A media position interrupts the chain of text-to-next-text targets."""
        self.text_predict.append((-1, False))

    def visual(self, segment: VisualSegment) -> None:
        layout, vocab = self.b.layout, self.b.vocab
        begin, end = ("<bov>", "<eov>") if segment.is_video else ("<boi>", "<eoi>")
        self.text(vocab.special(begin), segment.predict_opener)
        self.media_break()
        frames = layout.visual_frames(segment)
        token = self.media["visual_tokens"]
        read = not segment.predict  # input only: read whole (NFSP.encode)
        if segment.codes is not None:
            offset = sum(c.numel() for c in self.media["codes"])
            self.media["codes"].append(segment.codes)
            self.media["visual_items"].append(("codes", offset, token, frames, read))
        else:
            key = "video" if segment.is_video else "image"
            self.media[key].append(segment.pixels)
            self.media["visual_items"].append((key, len(self.media[key]) - 1, token, frames, read))
        finest = layout.visual_scales[-1]
        modality = Modality.VIDEO if segment.is_video else Modality.IMAGE
        t0 = self.t
        for frame in range(frames):
            for k, side in enumerate(layout.visual_scales):
                coords = scale_coordinates(side, finest)
                for r in range(side):
                    for c in range(side):
                        t, h, w = t0 + frame, t0 + coords[r], t0 + coords[c]
                        p = self._put(vocab.pad_id, modality, t, h, w, new_group=False)
                        self.set("visual_slot", p, token)
                        self.set("visual_scale", p, k)
                        if segment.predict:
                            self.set("visual_target", p, token)
                        token += 1
                self.group += 1
        self.media["visual_tokens"] = token
        self.t = t0 + max(frames, finest)
        self.text(vocab.special(end), True)

    def audio(self, segment: AudioSegment) -> None:
        vocab, layout = self.b.vocab, self.b.layout
        first = self.media["audio_frames"]
        if segment.codes is not None:
            frames = len(segment.codes)
            offset = sum(len(c) for c in self.media["audio_codes"])
            self.media["audio_items"].append((AudioItem.CODES, offset, first, frames))
            self.media["audio_codes"].append(segment.codes)
        else:
            frames = layout.audio_frames(len(segment.wave))
            self.media["audio_items"].append((AudioItem.WAVE, len(self.media["audio"]), first, frames))
            self.media["audio"].append(segment.wave)
        boa = self.text(vocab.special("<boa>"), segment.predict_opener)
        self.media_break()
        if segment.predict:
            self.set("audio_target", boa, first)
        for f in range(frames):
            p = self._put(vocab.pad_id, Modality.AUDIO, self.t, self.t, self.t)
            self.t += 1
            self.set("audio_slot", p, first + f)
            if segment.predict:
                if f + 1 < frames:
                    self.set("audio_target", p, first + f + 1)
                else:
                    self.set("audio_end", p, True)
        self.media["audio_frames"] = first + frames
        self.text(vocab.special("<eoa>"), True)

    def context(self, segment: ContextSegment) -> None:
        vocab = self.b.vocab
        rows, cols = self.b.layout.context_grid
        begin, end = ("<bov>", "<eov>") if segment.is_video else ("<boi>", "<eoi>")
        self.text(vocab.special(begin), segment.predict_opener)
        self.media_break()
        t0 = self.t
        frames = segment.frames
        for f, still in enumerate(frames):  # one group a frame: a frame sees itself and the frames before it
            self.media["context"].append(still)
            token = len(self.media["context"]) - 1
            for r in range(rows):
                for c in range(cols):
                    p = self._put(vocab.pad_id, Modality.CONTEXT, t0 + f, t0 + r, t0 + c, False)
                    self.set("context_slot", p, token * rows * cols + r * cols + c)
            self.group += 1
        self.t = t0 + max(len(frames), rows, cols)
        self.text(vocab.special(end), True)

    def end_document(self) -> None:
        ids = self.cols["ids"]
        chain = self.text_predict
        for (p, _), (q, predict) in zip(chain, chain[1:], strict=False):
            if p >= 0 and q >= 0 and predict:
                self.set("targets", p, ids[q - self.start])


class SequenceBuilder:
    """Packs documents into `[B, seq_len]` group batches.

    Args:
        vocab: the unified vocabulary (pad id, id ranges).
        seq_len: row length; a longer document is refused unless `truncate` (text-only documents).
        truncate: cut over-long text documents to `seq_len` (with a warning) instead of refusing them.
        layout: positions per visual frame, audio frame and context image (must match the model).
        packing: how a batch's documents fill rows: "in_order" (greedy, each row closed when the next
            document does not fit) or "first_fit_decreasing" (longest first, each into the first row with
            room: fewer rows, so less padding to compute, when documents differ in length).
    """

    def __init__(
        self,
        vocab: UnifiedVocab,
        seq_len: int,
        truncate: bool = False,
        layout: MediaLayout | None = None,
        packing: Packing = "in_order",
    ) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        self.vocab = vocab
        self.seq_len = seq_len
        self.truncate = truncate
        self.layout = layout or MediaLayout()
        self.packing = packing
        self._warned = False

    @property
    def packing(self) -> Packing:
        return self._packing

    @packing.setter
    def packing(self, packing: Packing) -> None:
        if packing not in PACKINGS:
            raise ValueError(f"packing must be one of {', '.join(PACKINGS)}, got {packing!r}")
        self._packing = packing

    def length(self, document: Document) -> int:
        return document_length(document, self.layout)

    def fit(self, document: Document) -> Document:
        length = self.length(document)
        if length == 0:
            raise ValueError("empty document: it has no tokens")
        if length <= self.seq_len:
            return document
        if not self.truncate or not all(isinstance(s, TextSegment) for s in document):
            raise ValueError(
                f"document of {length} tokens is longer than seq_len={self.seq_len}; raise seq_len"
                + (" or set truncate=True to cut it" if not self.truncate else " (media are never cut)")
            )
        if not self._warned:
            warnings.warn(
                f"truncating documents longer than seq_len={self.seq_len} (first had {length})", stacklevel=2
            )
            self._warned = True
        kept, room = [], self.seq_len
        for segment in document:
            if room <= 0:
                break
            kept.append(TextSegment(segment.ids[:room], segment.predict))
            room -= len(kept[-1])
        return kept

    def pack(self, documents: list[Document]) -> list[list[Document]]:
        """Rows of documents, by `packing`. Documents never attend across each other (`doc_id`), so the
        rows a document lands in changes only how much padding the batch computes, not its loss."""
        fitted = [self.fit(d) for d in documents]
        lengths = [self.length(d) for d in fitted]
        if self.packing == "first_fit_decreasing":
            # A stable sort: equal lengths keep their order, so a batch packs the same way every run.
            order = sorted(range(len(fitted)), key=lambda i: -lengths[i])
            rows: list[list[Document]] = []
            room: list[int] = []
            for i in order:
                row = next((r for r, free in enumerate(room) if lengths[i] <= free), len(rows))
                if row == len(rows):
                    rows.append([])
                    room.append(self.seq_len)
                rows[row].append(fitted[i])
                room[row] -= lengths[i]
            return rows
        rows, used = [], self.seq_len
        for document, length in zip(fitted, lengths, strict=True):
            if used + length > self.seq_len:  # in order: the current row if it fits, else a new row
                rows.append([])
                used = 0
            rows[-1].append(document)
            used += length
        return rows

    def collate(self, documents: list[Document]) -> GroupBatch:
        """Pack `documents` and lay the rows out as one GroupBatch (`collate_fn` of the dataloaders)."""
        if not documents:
            raise ValueError("cannot build a batch from no documents")
        return self.layout_rows(self.pack(documents), self.seq_len)

    def collate_prompts(self, documents: list[Document]) -> GroupBatch:
        """One document per row, right-aligned (left padding), for generation that continues every row."""
        if not documents:
            raise ValueError("cannot build a batch from no documents")
        for document in documents:
            if self.length(document) == 0:
                raise ValueError("empty prompt: start it with at least <bos>")
        longest = max(self.length(d) for d in documents)
        return self.layout_rows([[d] for d in documents], longest, left_pad=True)

    def layout_rows(self, rows: list[list[Document]], length: int, left_pad: bool = False) -> GroupBatch:
        b = len(rows)

        def full(value: int, dtype: torch.dtype = torch.long) -> Tensor:
            return torch.full((b, length), value, dtype=dtype)

        out = {
            "ids": full(self.vocab.pad_id),
            "modality": full(int(Modality.PAD)),
            "group": full(0),
            "doc": full(PAD_DOC),
            "positions": torch.zeros((3, b, length), dtype=torch.long),
            "targets": full(IGNORE_INDEX),
            "visual_slot": full(NO_SLOT),
            "visual_scale": full(NO_SLOT),
            "visual_target": full(NO_SLOT),
            "audio_slot": full(NO_SLOT),
            "audio_target": full(NO_SLOT),
            "audio_end": full(0, torch.bool),
            "context_slot": full(NO_SLOT),
        }
        media: dict[str, list] = {
            "image": [], "video": [], "codes": [], "audio": [], "audio_codes": [], "context": [],
            "visual_items": [], "audio_items": [], "visual_tokens": 0, "audio_frames": 0,
        }  # fmt: skip
        for r, row in enumerate(rows):
            start = length - sum(self.length(d) for d in row) if left_pad else 0
            writer = _RowWriter(self, r, out, media, start)
            for d, document in enumerate(row):
                writer.start_document(d)
                for segment in document:
                    self._write(writer, segment)
                writer.end_document()
            writer.flush()
        return self._batch(out, media)

    def _write(self, writer: _RowWriter, segment: Segment) -> None:
        if isinstance(segment, TextSegment):
            if len(segment) == 0:
                raise ValueError("empty text segment: it has no tokens")
            self.vocab.check_ids(torch.tensor(segment.ids), range(0, self.vocab.text_head_size))
            for token in segment.ids:
                writer.text(token, segment.predict)
        elif isinstance(segment, VisualSegment):
            writer.visual(segment)
        elif isinstance(segment, AudioSegment):
            writer.audio(segment)
        elif isinstance(segment, ContextSegment):
            writer.context(segment)
        else:
            raise TypeError(f"unknown segment type {type(segment).__name__}")

    def _batch(self, out: dict[str, Tensor], media: dict[str, list]) -> GroupBatch:
        targets = {"text": out["targets"]}
        visual = audio = context = None
        if media["visual_items"]:
            kinds = {"image": VisualItem.IMAGE, "video": VisualItem.VIDEO, "codes": VisualItem.CODES}
            items = [(kinds[k], i, first, n, int(read)) for k, i, first, n, read in media["visual_items"]]
            visual = VisualPayload(
                items=torch.tensor(items),
                slot=out["visual_slot"],
                scale=out["visual_scale"],
                scales=tuple(self.layout.visual_scales),
                image_pixels=_stack(media["image"], "image") if media["image"] else None,
                video_pixels=_stack(media["video"], "video") if media["video"] else None,
                codes=torch.cat(media["codes"]) if media["codes"] else None,
            )
            targets["visual"] = out["visual_target"]
        if media["audio_items"]:
            waves, lengths = _pad_waves(media["audio"]) if media["audio"] else (None, None)
            audio = AudioPayload(
                items=torch.tensor(media["audio_items"]),
                slot=out["audio_slot"],
                hop=self.layout.audio_hop,
                waves=waves,
                lengths=lengths,
                codes=torch.cat(media["audio_codes"]) if media["audio_codes"] else None,
            )
            targets["audio"], targets["audio_end"] = out["audio_target"], out["audio_end"]
        if media["context"]:
            context = ContextPayload(
                pixels=_stack(media["context"], "context image"),
                slot=out["context_slot"],
                grid=tuple(self.layout.context_grid),
            )
        return GroupBatch(
            input_ids=out["ids"],
            modality=out["modality"],
            group_id=out["group"],
            doc_id=out["doc"],
            positions=out["positions"],
            targets=targets,
            visual=visual,
            audio=audio,
            context=context,
        )


def _pad_waves(waves: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Waveforms `[N, longest]`, zero-padded, and their lengths `[N]`."""
    lengths = torch.tensor([len(w) for w in waves])
    padded = torch.zeros(len(waves), int(lengths.max()))
    for i, w in enumerate(waves):
        padded[i, : len(w)] = w
    return padded, lengths


def _stack(tensors: list[Tensor], what: str) -> Tensor:
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) > 1:
        raise ValueError(f"every {what} of a batch must have the same shape, got {sorted(shapes)}")
    return torch.stack([t.float() for t in tensors])
