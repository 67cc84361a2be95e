"""Real text: plain-text and jsonl files as documents for unified pretraining, streamed.

`.txt`/`.md`: one document per paragraph (blank-line separated). `.jsonl`: one document per line, its
`"text"` field (lines whose text is blank are not documents). No file is read whole: a first pass counts
(and checks) the documents of every file, then the streaming core (`zoo.datamodules.streaming`) reads
them, split over ranks and workers, through a shuffle buffer. The tokenizer is a trained JSON file
(`zoo train-tokenizer`) or, by default, the byte-level tokenizer that needs no training.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from itertools import islice
from pathlib import Path

from zoo.datamodules.bad_samples import BadSamplePolicy
from zoo.datamodules.documents import DocumentDataModule
from zoo.datamodules.shards import Shard
from zoo.datamodules.streaming import StreamDataset
from zoo.tokenizers.text import TextTokenizer
from zoo.tokenizers.vocab import UnifiedVocab

TEXT_SUFFIXES = (".txt", ".md")


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line without its newline), read in binary so that a UTF-8 error names its byte;
    `\r\n` and a lone `\r` end lines as in Python's text mode."""
    offset = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                at = offset + e.start
                raise ValueError(f"{path} is not valid UTF-8 ({e.reason} at byte {at})") from None
            offset += len(raw)
            parts = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
            for part in parts[:-1] if text.endswith(("\n", "\r")) else parts:
                yield number, part


def iter_documents(path: str | Path) -> Iterator[tuple[int, str]]:
    """(first line, text) of each document of one .txt/.md/.jsonl file, in file order, holding one
    paragraph at a time; errors name the file (and line) at fault."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _jsonl_documents(path)
    if suffix in TEXT_SUFFIXES:
        return _paragraphs(path)
    raise ValueError(f"{path}: unsupported text file type {path.suffix!r}; use .txt, .md or .jsonl")


def _jsonl_documents(path: Path) -> Iterator[tuple[int, str]]:
    for number, line in _lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: invalid JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f'{path}:{number}: expected an object with a string "text" field')
        if record["text"].strip():
            yield number, record["text"]


def _paragraphs(path: Path) -> Iterator[tuple[int, str]]:
    r"""Paragraphs as `re.split(r"\n\s*\n", text)` gives them, stripped, without holding the file."""
    lines: list[str] = []
    first = 0
    for number, line in _lines(path):
        if line.strip():
            first = first if lines else number
            lines.append(line)
        elif lines:
            yield first, "\n".join(lines).strip()
            lines = []
    if lines:
        yield first, "\n".join(lines).strip()


def read_documents(path: str | Path) -> list[str]:
    """All documents of one file (for small files and tests; training streams them)."""
    return [text for _, text in iter_documents(path)]


class TextDocuments:
    """The `SampleFormat` of text files: one document a sample, `{"__url__", "__key__": "line N", "text"}`."""

    def count(self, path: str) -> int:
        return sum(1 for _ in iter_documents(path))

    def read(self, url: str, start: int) -> Iterator[dict]:
        for line, text in islice(iter_documents(url), start, None):
            yield {"__url__": url, "__key__": f"line {line}", "text": text}


def split_shards(shards: Sequence[Shard], head: int) -> tuple[list[Shard], list[Shard]]:
    """The first `head` documents of `shards` and the rest, cutting a file in two where needed."""
    first, rest, left = [], [], head
    for shard in shards:
        take = min(left, shard.samples)
        if take:
            first.append(Shard(shard.url, take, shard.start))
        if shard.samples > take:
            rest.append(Shard(shard.url, shard.samples - take, shard.start + take))
        left -= take
    return first, rest


class TextFilesDataModule(DocumentDataModule):
    """Documents from text files, streamed (see the module doc).

    The order of an epoch is a function of (seed, epoch); BPE-dropout is seeded per (seed, epoch, document
    index), the index counting documents in file order across `train_files`, so resumed and multi-worker
    runs draw exactly what one process would. Every rank trains `N // world_size // batch_size` full
    batches an epoch (equal step counts for DDP); the remaining documents, fewer than `world_size *
    batch_size`, sit out that epoch, a different part each epoch (`zoo.datamodules.partition`).

    Args:
        train_files: .txt / .jsonl files for training.
        val_files: files for validation; when empty, the last `val_fraction` of the training documents.
        tokenizer: path of a tokenizer JSON; None uses the byte-level tokenizer (256 ids).
        vocab: the model's unified vocabulary (its `text_size` must cover the tokenizer).
        seq_len: packed row length.
        batch_size: documents per batch (packed into as many rows as they need).
        bpe_dropout: BPE-dropout probability on training documents (0 disables).
        val_fraction: share of training documents held out when no val_files are given.
        truncate: cut documents longer than seq_len (with a warning) instead of refusing them.
        num_workers: dataloader workers.
        seed: shuffling and dropout seed.
        prompts: texts that `zoo predict` continues (default: free generation from `<bos>`).
        shuffle_buffer: training documents each worker holds to shuffle; files are also permuted per epoch.
            Documents of one large file mix only within this window: split a corpus into several files.
        bad_samples: when bad documents stop the run.
    """

    def __init__(
        self,
        train_files: list[str],
        val_files: list[str] | None = None,
        tokenizer: str | None = None,
        vocab: UnifiedVocab = UnifiedVocab(),
        seq_len: int = 256,
        batch_size: int = 16,
        bpe_dropout: float = 0.0,
        val_fraction: float = 0.05,
        truncate: bool = False,
        num_workers: int = 0,
        seed: int = 0,
        prompts: list[str] | None = None,
        shuffle_buffer: int = 10_000,
        bad_samples: BadSamplePolicy = BadSamplePolicy(),
    ) -> None:
        super().__init__(
            vocab, seq_len, batch_size, bpe_dropout, truncate, num_workers, seed, prompts, bad_samples
        )
        if not train_files:
            raise ValueError("train_files is empty: give at least one .txt or .jsonl file")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}")
        if shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer must be >= 1, got {shuffle_buffer}")
        self.train_files, self.val_files = list(train_files), list(val_files or [])
        self.tokenizer_path, self.val_fraction = tokenizer, val_fraction
        self.shuffle_buffer = shuffle_buffer
        self._shards: dict[str, list[Shard]] | None = None

    def make_tokenizer(self) -> TextTokenizer:
        return TextTokenizer.load(self.tokenizer_path) if self.tokenizer_path else TextTokenizer.byte_level()

    def shards(self, split: str) -> list[Shard]:
        """The files (or parts of files) of `split` with their document counts: the first pass, made once."""
        if self._shards is None:
            count = TextDocuments().count
            train = [Shard(f, count(f)) for f in self.train_files]
            total = sum(s.samples for s in train)
            if not total:
                raise ValueError(f"no documents in {self.train_files}")
            if self.val_files:
                val = [Shard(f, count(f)) for f in self.val_files]
            else:
                n_val = max(1, int(total * self.val_fraction)) if total > 1 else 0
                train, val = split_shards(train, total - n_val)
            self._shards = {"train": train, "val": [s for s in val if s.samples], "test": []}
        return self._shards[split]

    def texts(self, split: str) -> list[str]:
        """Every document of `split`, read into a list (to look at a small corpus; training streams)."""
        read = TextDocuments().read
        return [d["text"] for s in self.shards(split) for d in islice(read(s.url, s.start), s.samples)]

    def make_dataset(self, split: str) -> StreamDataset | None:
        shards = self.shards(split)
        if not shards:
            return None
        train = split == "train"
        return StreamDataset(
            shards,
            TextDocuments(),
            self.text_map(split),
            seed=self.seed,
            shuffle=train,
            shuffle_buffer=self.shuffle_buffer,
            bad_samples=self.bad_sample_policy,
        )
