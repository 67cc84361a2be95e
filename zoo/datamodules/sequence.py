"""Builds packed group sequences (`zoo.batch.GroupBatch`) from documents.

A document is a list of segments; each segment lays out its own groups. Text is one token per group
and predicts the next token; later modalities add segments (visual scales, audio frames, context
embeddings) that lay out their groups the same way. Documents are packed greedily into rows of
`seq_len`; a document never spans two rows and never sees another (the mask keys on `doc_id`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from zoo.batch import IGNORE_INDEX, PAD_DOC, GroupBatch, Modality
from zoo.tokenizers.vocab import UnifiedVocab


@dataclass
class TextSegment:
    """Unified text ids. `predict=False` marks context (a prompt): present as input, never a target."""

    ids: list[int]
    predict: bool = True

    def __len__(self) -> int:
        return len(self.ids)


Document = list[TextSegment]


def document_length(document: Document) -> int:
    return sum(len(segment) for segment in document)


class SequenceBuilder:
    """Packs documents into `[B, seq_len]` group batches.

    Args:
        vocab: the unified vocabulary (pad id, id ranges).
        seq_len: row length; a longer document is refused unless `truncate`.
        truncate: cut over-long documents to `seq_len` (with a warning) instead of refusing them.
    """

    def __init__(self, vocab: UnifiedVocab, seq_len: int, truncate: bool = False) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        self.vocab = vocab
        self.seq_len = seq_len
        self.truncate = truncate
        self._warned = False

    def fit(self, document: Document) -> Document:
        length = document_length(document)
        if length == 0:
            raise ValueError("empty document: it has no tokens")
        if length <= self.seq_len:
            return document
        if not self.truncate:
            raise ValueError(
                f"document of {length} tokens is longer than seq_len={self.seq_len}; "
                "raise seq_len or set truncate=True to cut it"
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
        """Greedy in order: a document goes into the current row if it fits, else starts a new row."""
        rows: list[list[Document]] = []
        used = self.seq_len
        for document in documents:
            document = self.fit(document)
            length = document_length(document)
            if used + length > self.seq_len:
                rows.append([])
                used = 0
            rows[-1].append(document)
            used += length
        return rows

    def collate(self, documents: list[Document]) -> GroupBatch:
        """Pack `documents` and lay the rows out as one GroupBatch (`collate_fn` of the dataloaders)."""
        if not documents:
            raise ValueError("cannot build a batch from no documents")
        rows = self.pack(documents)
        b, length = len(rows), self.seq_len
        ids = torch.full((b, length), self.vocab.pad_id, dtype=torch.long)
        modality = torch.full((b, length), int(Modality.PAD), dtype=torch.long)
        group = torch.zeros((b, length), dtype=torch.long)
        doc = torch.full((b, length), PAD_DOC, dtype=torch.long)
        index = torch.zeros((b, length), dtype=torch.long)
        targets = torch.full((b, length), IGNORE_INDEX, dtype=torch.long)
        for r, row in enumerate(rows):
            start = 0
            for d, document in enumerate(row):
                flat = [token for segment in document for token in segment.ids]
                predict = [segment.predict for segment in document for _ in segment.ids]
                self.vocab.check_ids(torch.tensor(flat), range(0, self.vocab.text_head_size))
                n = len(flat)
                span = slice(start, start + n)
                ids[r, span] = torch.tensor(flat)
                modality[r, span] = int(Modality.TEXT)
                doc[r, span] = d
                # Text: one token per group, so the group id and the (t, h, w) coordinate are the index.
                group[r, span] = torch.arange(n)
                index[r, span] = torch.arange(n)
                next_ids = torch.tensor(flat[1:])
                keep = torch.tensor(predict[1:], dtype=torch.bool)
                targets[r, start : start + n - 1] = torch.where(keep, next_ids, IGNORE_INDEX)
                start += n
        return GroupBatch(
            input_ids=ids,
            modality=modality,
            group_id=group,
            doc_id=doc,
            positions=index.unsqueeze(0).repeat(3, 1, 1),
            targets={"text": targets},
        )
