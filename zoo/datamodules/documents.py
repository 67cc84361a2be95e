"""What every document datamodule shares: map-style datasets of documents, reproducible shuffling,
tokenizer persistence in the checkpoint, and packing into group batches at collate time.

Reproducibility is by construction: the order of an epoch is a function of (seed, epoch) and a
document's BPE-dropout draw a function of (seed, epoch, index), so a run resumed from a checkpoint
sees exactly the data the uninterrupted run would have seen. A checkpoint written mid-epoch also
records how many batches of the epoch were consumed (`ResumableDataLoader`), and the resumed epoch
starts after them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from zoo.datamodules.sequence import Document, SequenceBuilder, TextSegment
from zoo.tokenizers.text import TextTokenizer
from zoo.tokenizers.vocab import UnifiedVocab


class EpochShuffleSampler(Sampler[tuple[int, int]]):
    """A permutation of `range(n)` drawn from (seed, epoch); Lightning calls `set_epoch` every epoch.

    It yields `(index, epoch)` pairs: the epoch travels with each index, so dataloader workers (which
    hold their own copy of the sampler, frozen at the epoch they started in) draw per-epoch randomness
    such as BPE-dropout exactly as the main process would.
    """

    def __init__(self, n: int, seed: int, shuffle: bool = True) -> None:
        self.n, self.seed, self.shuffle, self.epoch = n, seed, shuffle, 0
        self.skip = 0  # indices the next iteration leaves out, once: the part of an epoch already trained

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch, skip, self.skip = self.epoch, self.skip, 0
        if not self.shuffle:
            return iter((i, epoch) for i in range(skip, self.n))
        g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
        return iter((i, epoch) for i in torch.randperm(self.n, generator=g).tolist()[skip:])

    def __len__(self) -> int:
        return self.n


class ResumableDataLoader(DataLoader):
    """A DataLoader that Lightning can checkpoint mid-epoch.

    Lightning saves `state_dict()` of every train loader that has `state_dict`/`load_state_dict` and
    restores it on resume, but by itself it restarts the epoch's iteration from the first batch. This
    loader records (epoch, batches handed out in that epoch); after `load_state_dict` the next iteration
    of that same epoch starts after them. Counting here rather than in the sampler is what makes the
    count exact: with workers the sampler runs ahead of the batches training has consumed.
    """

    _epoch, _delivered = 0, 0
    _resume: tuple[int, int] | None = None

    def _current_epoch(self) -> int:
        return int(getattr(self.sampler, "epoch", 0))

    def __iter__(self) -> Iterator[Any]:
        # A generator: nothing is drawn before the first batch is asked for, i.e. after Lightning's
        # `set_epoch`, so the (index, epoch) pairs (and the skip) follow the epoch being trained.
        epoch, skip = self._current_epoch(), 0
        if self._resume is not None:
            resume_epoch, skip = self._resume
            self._resume = None
            skip = skip if resume_epoch == epoch else 0
        self._epoch, self._delivered = epoch, skip
        if isinstance(self.sampler, EpochShuffleSampler):
            self.sampler.skip = skip * (self.batch_size or 1)  # skip indices: no documents are made
            batches = super().__iter__()
        else:  # a sampler replaced by Lightning (e.g. distributed): make the batches and drop them
            batches = islice(super().__iter__(), skip, None)
        for batch in batches:
            self._delivered += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "batches": self._delivered}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        if not {"epoch", "batches"} <= set(state_dict):
            raise ValueError(
                f"a train dataloader state needs 'epoch' and 'batches', got {sorted(state_dict)}"
            )
        epoch, batches = int(state_dict["epoch"]), int(state_dict["batches"])
        # A finished epoch leaves nothing to skip: the next epoch starts from its first batch.
        self._resume = (epoch, batches) if 0 < batches < len(self) else None


class DocumentDataset(Dataset[Document]):
    """`n` documents made on demand by `make(index, epoch)`, indexed by the sampler's `(index, epoch)`."""

    def __init__(self, n: int, make: Callable[[int, int], Document], sampler: EpochShuffleSampler) -> None:
        self.n, self.make, self.sampler = n, make, sampler

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key: tuple[int, int] | int) -> Document:
        index, epoch = key if isinstance(key, tuple) else (key, self.sampler.epoch)
        if not 0 <= index < self.n:
            raise IndexError(f"document index {index} out of range 0..{self.n - 1}")
        return self.make(index, epoch)


class DocumentDataModule(L.LightningDataModule):
    """Base of the text-bearing datamodules: subclasses provide texts and a tokenizer.

    The tokenizer's JSON travels in the checkpoint (`state_dict`), so a resumed or reloaded run decodes
    with the tokenizer it was trained with.
    """

    def __init__(
        self,
        vocab: UnifiedVocab,
        seq_len: int,
        batch_size: int,
        bpe_dropout: float,
        truncate: bool,
        num_workers: int,
        seed: int,
        prompts: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.prompts = list(prompts) if prompts is not None else [""] * 8
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0.0 <= bpe_dropout < 1.0:
            raise ValueError(f"bpe_dropout must lie in [0, 1), got {bpe_dropout}")
        self.vocab = vocab
        self.builder = SequenceBuilder(vocab, seq_len, truncate)
        self.batch_size, self.bpe_dropout = batch_size, bpe_dropout
        self.num_workers, self.seed = num_workers, seed
        self.tokenizer: TextTokenizer | None = None
        self.datasets: dict[str, DocumentDataset] = {}

    # -- what subclasses provide -------------------------------------------------------------------
    def texts(self, split: str) -> list[str]:
        raise NotImplementedError

    def make_tokenizer(self) -> TextTokenizer:
        raise NotImplementedError

    # -- shared machinery ----------------------------------------------------------------------------
    def encode_document(self, text: str, dropout: float = 0.0, seed: int | None = None) -> Document:
        assert self.tokenizer is not None
        ids = self.tokenizer.encode(text, dropout=dropout or None, seed=seed)
        unified = self.vocab.text_to_unified(ids).tolist()
        return [TextSegment([self.vocab.bos_id, *unified, self.vocab.eos_id])]

    def decode(self, ids: list[int]) -> str:
        """Unified ids -> text, dropping special tokens. Ids the model reserves but the tokenizer lacks
        (`vocab.text_size` may exceed the tokenizer's size) show as U+2047 rather than failing."""
        assert self.tokenizer is not None
        pieces, run = [], []
        for i in ids:
            if i not in self.vocab.text_range():
                continue
            local = i - self.vocab.text_offset
            if local < self.tokenizer.vocab_size:
                run.append(local)
            else:
                pieces += [self.tokenizer.decode(run), "\u2047"]
                run = []
        return "".join([*pieces, self.tokenizer.decode(run)])

    def setup(self, stage: str | None = None) -> None:
        if self.tokenizer is None:
            self.tokenizer = self.make_tokenizer()
        if self.tokenizer.vocab_size > self.vocab.text_size:
            raise ValueError(
                f"the tokenizer has {self.tokenizer.vocab_size} ids but the unified vocabulary reserves "
                f"text_size={self.vocab.text_size}: raise vocab.text_size or use a smaller tokenizer"
            )
        for split in ("train", "val", "test"):
            if split in self.datasets:
                continue
            texts = self.texts(split)
            if not texts:
                continue
            sampler = EpochShuffleSampler(len(texts), self.seed, shuffle=split == "train")
            make = functools.partial(self.make_document, split)
            self.datasets[split] = DocumentDataset(len(texts), make, sampler)

    def make_document(self, split: str, index: int, epoch: int) -> Document:
        """Document `index` of `split` as seen in `epoch`: a function of (seed, split, epoch, index) only.

        Text datamodules encode `texts(split)[index]` (BPE-dropout seeded per epoch and index); multimodal
        ones override this to build documents with media segments around the same texts.
        """
        dropout = self.bpe_dropout if split == "train" else 0.0
        seed = (self.seed * 1_000_003 + epoch) * 1_000_033 + index
        return self.encode_document(self.texts(split)[index], dropout, seed)

    def _loader(self, split: str) -> DataLoader:
        if split not in self.datasets:
            raise RuntimeError(f"no {split} data: call setup() first or give {split} files")
        dataset = self.datasets[split]
        return (ResumableDataLoader if split == "train" else DataLoader)(
            dataset,
            batch_size=self.batch_size,
            sampler=dataset.sampler,
            collate_fn=self.builder.collate,
            num_workers=self.num_workers,
            drop_last=split == "train" and len(dataset) >= self.batch_size,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test" if "test" in self.datasets else "val")

    def prompt_ids(self, prompt: str) -> list[int]:
        """`<bos>` + the prompt's unified ids (no `<eos>`: the model continues it)."""
        assert self.tokenizer is not None
        return [self.vocab.bos_id, *self.vocab.text_to_unified(self.tokenizer.encode(prompt)).tolist()]

    def predict_dataloader(self) -> DataLoader:
        """The `prompts` (default: eight empty ones, i.e. free generation) as lists of unified ids."""
        if self.tokenizer is None:
            self.setup("predict")
        prompts = [self.prompt_ids(p) for p in self.prompts]
        return DataLoader(prompts, batch_size=self.batch_size, collate_fn=list)

    def score_text(self, text: str) -> dict[str, float]:
        """Verifier scores of a generated text; datasets with a verifier override this."""
        return {}

    def state_dict(self) -> dict[str, str]:
        return {"tokenizer": self.tokenizer.to_json()} if self.tokenizer is not None else {}

    def load_state_dict(self, state_dict: dict[str, str]) -> None:
        if "tokenizer" in state_dict:
            self.tokenizer = TextTokenizer.from_json(state_dict["tokenizer"])
