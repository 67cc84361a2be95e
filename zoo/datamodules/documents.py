"""What every document datamodule shares: datasets of documents (map-style here, or streamed by
`zoo.datamodules.streaming`), reproducible shuffling, bad documents replaced and counted, tokenizer
persistence in the checkpoint, and packing into group batches at collate time.

Reproducibility is by construction: the order of an epoch is a function of (seed, epoch) and a
document's BPE-dropout draw a function of (seed, epoch, index), so a run resumed from a checkpoint
sees exactly the data the uninterrupted run would have seen. A checkpoint written mid-epoch also
records how many batches of the epoch were consumed (`ResumableDataLoader`, `StreamLoader`), and the
resumed epoch starts after them. A document that cannot be made is replaced by another drawn from a
hash of (seed, epoch, index, attempt) (`DocumentDataset.replacing`), so batch sizes and step counts stay
fixed; the loaders count it (`zoo.datamodules.bad_samples`).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterator
from itertools import islice
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from zoo.datamodules.bad_samples import SAMPLE_ERRORS, BadRecord, BadSamplePolicy, Delivered, describe
from zoo.datamodules.loader_tokenizing import TokenizedDocuments, frozen_copies
from zoo.datamodules.loaders import ReportingLoader
from zoo.datamodules.sequence import Document, SequenceBuilder, TextSegment
from zoo.datamodules.streaming import StreamDataset, StreamLoader, rank_and_world
from zoo.tokenizers.text import TextTokenizer
from zoo.tokenizers.vocab import UnifiedVocab

if TYPE_CHECKING:
    from zoo.datamodules.frozen_tokenizers import FrozenTokenizers


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


class ResumableDataLoader(ReportingLoader):
    """A DataLoader of a map-style dataset that Lightning can checkpoint mid-epoch (see `loaders`).

    With an `EpochShuffleSampler` the skipped part of a resumed epoch is left out of the sampler, so no
    document is made for it; with a sampler Lightning replaced (e.g. distributed) the batches are made
    and dropped.
    """

    def _current_epoch(self) -> int:
        return int(getattr(self.sampler, "epoch", 0))

    def __iter__(self) -> Iterator[Any]:
        # A generator: nothing is drawn before the first batch is asked for, i.e. after Lightning's
        # `set_epoch`, so the (index, epoch) pairs (and the skip) follow the epoch being trained.
        skip = self._begin_epoch(self._current_epoch())
        if isinstance(self.sampler, EpochShuffleSampler):
            self.sampler.skip = skip * (self.batch_size or 1)  # skip indices: no documents are made
            reports = super().__iter__()
        else:
            reports = islice(super().__iter__(), skip, None)
        yield from self._unwrap(reports)


def replacement_index(seed: int, epoch: int, index: int, attempt: int, n: int) -> int:
    """The document that stands in for a bad `index` at `attempt` (1, 2, ...): a hash of all four, so the
    same one in every run and every resume."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{index}/{attempt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % n


class DocumentDataset(Dataset[Document]):
    """`n` documents made on demand by `make(index, epoch)`, indexed by the sampler's `(index, epoch)`.

    `make` may raise one of `errors` for a document that cannot be made; loaders read through
    `replacing()`, which substitutes another document (`replacement_index`) and reports the bad one.
    """

    def __init__(
        self,
        n: int,
        make: Callable[[int, int], Document],
        sampler: EpochShuffleSampler,
        name: str = "documents",
        errors: tuple[type[BaseException], ...] = SAMPLE_ERRORS,
        max_attempts: int = 8,
    ) -> None:
        self.n, self.make, self.sampler = n, make, sampler
        self.name, self.errors, self.max_attempts = name, errors, max_attempts

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key: tuple[int, int] | int) -> Document:
        index, epoch = self._key(key)
        return self.make(index, epoch)

    def _key(self, key: tuple[int, int] | int) -> tuple[int, int]:
        index, epoch = key if isinstance(key, tuple) else (key, self.sampler.epoch)
        if not 0 <= index < self.n:
            raise IndexError(f"document index {index} out of range 0..{self.n - 1}")
        return index, epoch

    def deliver(self, key: tuple[int, int] | int) -> Delivered:
        """Document `key`, or when it is bad the first good replacement, with the bad one's record."""
        index, epoch = self._key(key)
        first: BadRecord | None = None
        for attempt in range(self.max_attempts + 1):
            candidate = (
                index if attempt == 0 else replacement_index(self.sampler.seed, epoch, index, attempt, self.n)
            )
            try:
                document = self.make(candidate, epoch)
            except self.errors as error:
                first = first or BadRecord(self.name, f"document {index}", describe(error))
                continue
            return Delivered(document, (first,) if first else ())
        assert first is not None
        return Delivered(None, (first,), fatal=f"{self.max_attempts} replacements of it were bad too")

    def replacing(self) -> _Replacing:
        return _Replacing(self)

    def with_make(self, make: Callable[[int, int], Document]) -> DocumentDataset:
        """The same documents' keys and sampler (the one the datamodule resumes), made by `make`."""
        return DocumentDataset(self.n, make, self.sampler, self.name, self.errors, self.max_attempts)


class _Replacing(Dataset[Delivered]):
    """A DocumentDataset as its loaders read it: `Delivered` items, bad documents replaced."""

    def __init__(self, documents: DocumentDataset) -> None:
        self.documents = documents

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, key: tuple[int, int] | int) -> Delivered:
        return self.documents.deliver(key)


def document_seed(seed: int, epoch: int, index: int) -> int:
    """The BPE-dropout seed of document `index` in `epoch`."""
    return (seed * 1_000_003 + epoch) * 1_000_033 + index


def encode_text(
    tokenizer: TextTokenizer, vocab: UnifiedVocab, text: str, dropout: float = 0.0, seed: int | None = None
) -> Document:
    """One text as a document: `<bos>`, its unified ids, `<eos>`."""
    ids = tokenizer.encode(text, dropout=dropout or None, seed=seed)
    return [TextSegment([vocab.bos_id, *vocab.text_to_unified(ids).tolist(), vocab.eos_id])]


def decode_text(tokenizer: TextTokenizer, vocab: UnifiedVocab, ids: list[int]) -> str:
    """Unified ids -> text, dropping special tokens. Ids the model reserves but the tokenizer lacks
    (`vocab.text_size` may exceed the tokenizer's size) show as U+2047 rather than failing."""
    pieces, run = [], []
    for i in ids:
        if i not in vocab.text_range():
            continue
        local = i - vocab.text_offset
        if local < tokenizer.vocab_size:
            run.append(local)
        else:
            pieces += [tokenizer.decode(run), "\u2047"]
            run = []
    return "".join([*pieces, tokenizer.decode(run)])


class EncodeText:
    """The `map` of a text stream: a sample's `"text"` as a document, BPE-dropout seeded by the sample's
    (epoch, index) exactly as a map-style dataset seeds it. Small and picklable: workers receive it."""

    def __init__(self, tokenizer: TextTokenizer, vocab: UnifiedVocab, dropout: float, seed: int) -> None:
        self.tokenizer, self.vocab, self.dropout, self.seed = tokenizer, vocab, dropout, seed

    def __call__(self, sample: dict) -> Document:
        seed = document_seed(self.seed, sample["__epoch__"], sample["__index__"])
        return encode_text(self.tokenizer, self.vocab, sample["text"], self.dropout, seed)


class DocumentDataModule(L.LightningDataModule):
    """Base of the text-bearing datamodules: subclasses provide texts and a tokenizer.

    A split is a map-style `DocumentDataset` over `texts(split)` unless a subclass's `make_dataset` streams
    it (`StreamDataset`); the loaders follow the dataset's kind. The tokenizer's JSON travels in the
    checkpoint (`state_dict`), so a resumed or reloaded run decodes with the tokenizer it was trained with.
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
        bad_samples: BadSamplePolicy = BadSamplePolicy(),
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
        self.bad_sample_policy = bad_samples
        self.tokenizer: TextTokenizer | None = None
        self.datasets: dict[str, DocumentDataset | StreamDataset] = {}
        self.loaders: dict[str, ReportingLoader] = {}  # the loader built last per split
        # Set by `tokenize_with`: the loader's workers tokenize media (`zoo.datamodules.loader_tokenizing`).
        self.loader_tokenizers: FrozenTokenizers | None = None
        # Subclasses that offer it set this from their `tokenize_in_loader` argument: every loader built
        # during a run then tokenizes with copies of the trainer's model's tokenizers.
        self.tokenize_in_loader = False

    # -- what subclasses provide -------------------------------------------------------------------
    def texts(self, split: str) -> list[str]:
        raise NotImplementedError

    def make_tokenizer(self) -> TextTokenizer:
        raise NotImplementedError

    # -- shared machinery ----------------------------------------------------------------------------
    def encode_document(self, text: str, dropout: float = 0.0, seed: int | None = None) -> Document:
        assert self.tokenizer is not None
        return encode_text(self.tokenizer, self.vocab, text, dropout, seed)

    def decode(self, ids: list[int]) -> str:
        """Unified ids -> text (`decode_text`)."""
        assert self.tokenizer is not None
        return decode_text(self.tokenizer, self.vocab, ids)

    def setup(self, stage: str | None = None) -> None:
        if self.tokenizer is None:
            self.tokenizer = self.make_tokenizer()
        if self.tokenizer.vocab_size > self.vocab.text_size:
            raise ValueError(
                f"the tokenizer has {self.tokenizer.vocab_size} ids but the unified vocabulary reserves "
                f"text_size={self.vocab.text_size}: raise vocab.text_size or use a smaller tokenizer"
            )
        for split in ("train", "val", "test"):
            if split not in self.datasets and (dataset := self.make_dataset(split)) is not None:
                self.datasets[split] = dataset

    def tokenize_with(self, visual: nn.Module | None, audio: nn.Module | None) -> None:
        """Loaders built from now on give codes instead of pixels and waveforms, encoded where documents are
        made (in the loader's workers) by CPU copies of these frozen tokenizers (`loader_dataset`)."""
        self.loader_tokenizers = frozen_copies(visual, audio)

    def trainer_model(self) -> nn.Module | None:
        """The model of the trainer this datamodule is attached to (None outside a run)."""
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        return getattr(module, "model", None)

    def make_dataset(self, split: str) -> DocumentDataset | StreamDataset | None:
        """The dataset of `split`, None when it has no documents: map-style over `texts(split)` here."""
        texts = self.texts(split)
        if not texts:
            return None
        sampler = EpochShuffleSampler(len(texts), self.seed, shuffle=split == "train")
        make: Callable[[int, int], Document] = functools.partial(self.make_document, split)
        return DocumentDataset(len(texts), make, sampler, name=f"{type(self).__name__} {split}")

    def make_document(self, split: str, index: int, epoch: int) -> Document:
        """Document `index` of `split` as seen in `epoch`: a function of (seed, split, epoch, index) only.

        Text datamodules encode `texts(split)[index]` (BPE-dropout seeded per epoch and index); multimodal
        ones override this to build documents with media segments around the same texts.
        """
        dropout = self.bpe_dropout if split == "train" else 0.0
        return self.encode_document(self.texts(split)[index], dropout, document_seed(self.seed, epoch, index))

    def text_map(self, split: str) -> EncodeText:
        """The `map` of a streamed text split (built when a loader is, so it holds the current tokenizer:
        a checkpoint's tokenizer arrives after setup)."""
        assert self.tokenizer is not None
        return EncodeText(
            self.tokenizer, self.vocab, self.bpe_dropout if split == "train" else 0.0, self.seed
        )

    def loader_dataset(self, split: str) -> DocumentDataset | StreamDataset:
        """The dataset a loader of `split` reads: a stream gets its `map` (built now: it holds the current
        tokenizer), and with `loader_tokenizers` every document's media become codes where it is made."""
        if split not in self.datasets:
            raise RuntimeError(f"no {split} data: call setup() first or give {split} files")
        dataset, tokenizers = self.datasets[split], self.loader_tokenizers
        if isinstance(dataset, StreamDataset):
            text_map = self.text_map(split)
            dataset.map = text_map if tokenizers is None else TokenizedDocuments(text_map, tokenizers)
            return dataset
        if tokenizers is None:
            return dataset
        return dataset.with_make(TokenizedDocuments(dataset.make, tokenizers))

    def _loader(self, split: str) -> ReportingLoader:
        model = self.trainer_model()
        if self.tokenize_in_loader and model is not None:
            # Copied now, not at setup: a checkpoint's weights and a sharded model's materialised
            # tensors arrive between the two.
            self.tokenize_with(getattr(model, "visual_tokenizer", None), getattr(model, "audio_codec", None))
        dataset = self.loader_dataset(split)
        train = split == "train"
        if isinstance(dataset, StreamDataset):
            rank, world = rank_and_world(self.trainer)
            full = train and len(dataset) // world >= self.batch_size  # else one short batch per rank
            loader: ReportingLoader = StreamLoader(
                dataset, self.builder.collate, self.batch_size, rank, world, self.num_workers, drop_last=full
            )
        else:
            loader = ResumableDataLoader(
                dataset.replacing(),
                self.builder.collate,
                self.bad_sample_policy,
                batch_size=self.batch_size,
                sampler=dataset.sampler,
                num_workers=self.num_workers,
                drop_last=train and len(dataset) >= self.batch_size,
                persistent_workers=self.num_workers > 0,
            )
        self.loaders[split] = loader
        return loader

    @property
    def bad_samples(self) -> int:
        """Bad samples the current train loader has met (skipped and replaced) in this process."""
        return self.loaders["train"].bad_samples if "train" in self.loaders else 0

    def train_dataloader(self) -> ReportingLoader:
        return self._loader("train")

    def val_dataloader(self) -> ReportingLoader:
        return self._loader("val")

    def test_dataloader(self) -> ReportingLoader:
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
