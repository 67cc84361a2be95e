"""Real text: plain-text and jsonl files as documents for unified pretraining.

`.txt`: one document per paragraph (blank-line separated). `.jsonl`: one document per line, its
`"text"` field. The tokenizer is a trained JSON file (`zoo train-tokenizer`) or, by default, the
byte-level tokenizer that needs no training.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from zoo.datamodules.documents import DocumentDataModule
from zoo.tokenizers.text import TextTokenizer
from zoo.tokenizers.vocab import UnifiedVocab


def read_documents(path: str | Path) -> list[str]:
    """The documents of one .txt or .jsonl file; errors name the file (and line) at fault."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file not found: {path}")
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        docs = []
        for number, line in enumerate(content.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: invalid JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f'{path}:{number}: expected an object with a string "text" field')
            if record["text"].strip():
                docs.append(record["text"])
        return docs
    if suffix in (".txt", ".md"):
        return [p.strip() for p in re.split(r"\n\s*\n", content) if p.strip()]
    raise ValueError(f"{path}: unsupported text file type {path.suffix!r}; use .txt, .md or .jsonl")


class TextFilesDataModule(DocumentDataModule):
    """Documents from text files.

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
    ) -> None:
        super().__init__(vocab, seq_len, batch_size, bpe_dropout, truncate, num_workers, seed, prompts)
        if not train_files:
            raise ValueError("train_files is empty: give at least one .txt or .jsonl file")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}")
        self.train_files, self.val_files = list(train_files), list(val_files or [])
        self.tokenizer_path, self.val_fraction = tokenizer, val_fraction
        self._split: dict[str, list[str]] | None = None

    def make_tokenizer(self) -> TextTokenizer:
        return TextTokenizer.load(self.tokenizer_path) if self.tokenizer_path else TextTokenizer.byte_level()

    def texts(self, split: str) -> list[str]:
        if self._split is None:
            train = [doc for f in self.train_files for doc in read_documents(f)]
            if not train:
                raise ValueError(f"no documents in {self.train_files}")
            if self.val_files:
                val = [doc for f in self.val_files for doc in read_documents(f)]
            else:
                n_val = max(1, int(len(train) * self.val_fraction)) if len(train) > 1 else 0
                train, val = train[: len(train) - n_val], train[len(train) - n_val :]
            self._split = {"train": train, "val": val, "test": []}
        return self._split[split]
