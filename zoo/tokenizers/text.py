"""Text tokenizer: byte-level BPE with BPE-dropout (the text side of ERNIE 5.0's unified token space).

ERNIE 5.0 models text as ordinary next-token prediction over a sub-word vocabulary; this file gives the
zoo that vocabulary. It wraps Hugging Face `tokenizers`:

- Byte-level BPE (GPT-2 style): text is UTF-8 encoded and every byte is mapped to one of 256 printable
  symbols before merges apply. The 256 byte symbols are always in the vocabulary (ids 0..255, in byte
  order), so every Unicode string encodes, unseen characters fall back to their bytes, and
  `decode(encode(s)) == s` exactly. (This is the byte fallback; HF's `byte_fallback` flag, meant for
  non-byte-level BPE with `<0xNN>` tokens, stays off.)
- No special tokens: ids are local, `0 .. vocab_size-1`. Specials (`<bos>`, `<boi>`, ...) live in the
  unified vocabulary, `zoo/tokenizers/vocab.py`, which shifts these ids by `text_offset`.
- BPE-dropout (Provilkov et al., 2020, "BPE-Dropout: Simple and Effective Subword Regularization"): while
  training, each candidate merge is skipped with probability p at every step, so one text gets several
  segmentations that all decode to the same string. HF's own dropout draws from an unseedable thread RNG
  and lives on the shared model object, so we apply the trained merges ourselves, per pre-token, with a
  seeded `random.Random`; with p = 0 that loop equals HF's encoding exactly (tested).

`train_tokenizer_main` is the command line (`zoo train-tokenizer`): it trains from .txt / .jsonl files.
"""

from __future__ import annotations

import heapq
import itertools
import json
import operator
import random
from collections.abc import Iterable, Iterator, Sequence
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from zoo.command_line import command_parser

NUM_BYTES = 256


@lru_cache(maxsize=1)
def byte_symbols() -> tuple[str, ...]:
    """The printable symbol that byte-level BPE uses for each byte value 0..255 (GPT-2's table).

    Printable Latin-1 bytes stand for themselves; the others (controls, space, ...) are shifted to
    code points from 256 up, so that no symbol is whitespace and merges never see raw control bytes.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[int, str] = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(NUM_BYTES):
        if b not in table:
            table[b] = chr(NUM_BYTES + shifted)
            shifted += 1
    return tuple(table[b] for b in range(NUM_BYTES))


def _empty_config() -> dict:
    """HF tokenizer JSON of a byte-level BPE with the 256 byte tokens and no merges."""
    tok = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(byte_symbols())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return json.loads(tok.to_str())


def _bytes_first(config: dict) -> dict:
    """Renumber a trained vocabulary so that ids 0..255 are the bytes in byte order, then the merged tokens.

    HF's trainer sorts its alphabet by symbol, not by byte value; putting the bytes first makes every
    trained tokenizer agree with `TextTokenizer.byte_level()` on ids 0..255. Merged tokens keep their
    relative order (the order in which they were learned).
    """
    vocab: dict[str, int] = config["model"]["vocab"]
    symbols = byte_symbols()
    byte_set = set(symbols)
    merged = sorted((i, t) for t, i in vocab.items() if t not in byte_set)
    new_vocab = {s: i for i, s in enumerate(symbols)}
    for i, (_, token) in enumerate(merged):
        new_vocab[token] = NUM_BYTES + i
    config["model"]["vocab"] = new_vocab
    return config


def _check_config(config: object, source: str) -> None:
    """Refuse any tokenizer JSON that would break the guarantees of this class, naming what is wrong."""

    def fail(what: str) -> None:
        raise ValueError(f"{source}: not a byte-level BPE tokenizer as TextTokenizer expects: {what}")

    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        fail("expected a Hugging Face tokenizer JSON object with a 'model' entry")
    model = config["model"]
    if model.get("type") != "BPE":
        fail(f"model type must be 'BPE', got {model.get('type')!r}")
    pre = config.get("pre_tokenizer")
    if not isinstance(pre, dict) or pre.get("type") != "ByteLevel" or pre.get("add_prefix_space", False):
        fail(f"pre_tokenizer must be ByteLevel with add_prefix_space=false, got {pre}")
    if not isinstance(config.get("decoder"), dict) or config["decoder"].get("type") != "ByteLevel":
        fail(f"decoder must be ByteLevel, got {config.get('decoder')}")
    if config.get("normalizer") is not None:
        fail("a normalizer would break the exact round trip; expected normalizer null")
    if config.get("added_tokens"):
        fail("special/added tokens belong to the unified vocabulary (zoo/tokenizers/vocab.py); expected none")
    if model.get("dropout") not in (None, 0, 0.0):
        fail("model.dropout must be null: dropout is chosen per call, encode(text, dropout=...)")
    if any(model.get(k) for k in ("continuing_subword_prefix", "end_of_word_suffix", "ignore_merges")):
        fail("continuing_subword_prefix, end_of_word_suffix and ignore_merges must be unset")
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or sorted(vocab.values()) != list(range(len(vocab))):
        fail("vocabulary ids must be exactly 0..vocab_size-1")
    missing = [b for b, s in enumerate(byte_symbols()) if s not in vocab]
    if missing:
        fail(f"{len(missing)} of the 256 byte tokens are missing (first: byte {missing[0]})")


class TextTokenizer:
    """Byte-level BPE text tokenizer with local ids `0 .. vocab_size-1` and per-call BPE-dropout.

    Build one with `TextTokenizer.train(texts)`, `TextTokenizer.load(path)` or `TextTokenizer.byte_level()`.

    Args:
        path: a tokenizer JSON file written by `save`; None gives the byte-level tokenizer (256 byte
            tokens, no merges), which needs no training.
    """

    def __init__(self, path: str | Path | None = None) -> None:
        config = _empty_config() if path is None else self._read_config(Path(path))
        self._set_config(config, source=str(path) if path is not None else "byte-level default")

    # construction ------------------------------------------------------------------------------

    @staticmethod
    def _read_config(path: Path) -> dict:
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist (write one with save())")
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"tokenizer file {str(path)!r} is not valid JSON: {e}") from None

    def _set_config(self, config: dict, source: str) -> None:
        _check_config(config, source)
        try:
            self._tok = Tokenizer.from_str(json.dumps(config))
        except Exception as e:  # HF raises a bare Exception for inconsistent merges and the like
            raise ValueError(f"{source}: Hugging Face tokenizers could not build it: {e}") from None
        vocab: dict[str, int] = config["model"]["vocab"]
        self._vocab = vocab
        # (left id, right id) -> (rank, merged id): the same map HF's BPE model builds from the merge list.
        self._merges: dict[tuple[int, int], tuple[int, int]] = {}
        for rank, merge in enumerate(config["model"].get("merges") or []):
            left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
            if left + right not in vocab:
                raise ValueError(
                    f"{source}: merge {rank} ({left!r}, {right!r}) makes a token not in the vocabulary"
                )
            self._merges[(vocab[left], vocab[right])] = (rank, vocab[left + right])

    @classmethod
    def _from_config(cls, config: dict, source: str) -> TextTokenizer:
        self = cls.__new__(cls)
        self._set_config(config, source)
        return self

    @classmethod
    def byte_level(cls) -> TextTokenizer:
        """The untrained tokenizer: one token per UTF-8 byte, id == byte value."""
        return cls(None)

    @classmethod
    def load(cls, path: str | Path) -> TextTokenizer:
        """Load a tokenizer JSON written by `save` (refuses missing, corrupt or incompatible files)."""
        return cls(path)

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int = 512,
        min_frequency: int = 2,
        show_progress: bool = False,
    ) -> TextTokenizer:
        """Learn BPE merges from `texts` (streamed once, never held in memory by us).

        Args:
            texts: training documents.
            vocab_size: the largest vocabulary wanted, bytes included (>= 257: the 256 bytes and at least
                one merge). The result's `vocab_size` is smaller when the corpus runs out of pairs seen
                at least `min_frequency` times: read it back rather than assume it.
            min_frequency: a pair must occur this often to be merged (>= 1).
            show_progress: show HF's progress bar.
        """
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < NUM_BYTES + 1:
            raise ValueError(
                f"vocab_size must be an int >= {NUM_BYTES + 1} (the 256 byte tokens plus at least one "
                f"merge), got {vocab_size!r}"
            )
        if isinstance(min_frequency, bool) or not isinstance(min_frequency, int) or min_frequency < 1:
            raise ValueError(f"min_frequency must be an int >= 1, got {min_frequency!r}")
        if isinstance(texts, str):
            raise TypeError("texts must be an iterable of documents, got a single str")
        tok = Tokenizer.from_str(json.dumps(_empty_config()))
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            show_progress=show_progress,
            special_tokens=[],
            initial_alphabet=list(byte_symbols()),
        )
        tok.train_from_iterator(_checked_texts(texts), trainer=trainer)
        return cls._from_config(_bytes_first(json.loads(tok.to_str())), source="trained tokenizer")

    def save(self, path: str | Path) -> None:
        """Write the tokenizer as one Hugging Face tokenizer JSON file (no pickle); creates parent folders."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(path), pretty=False)

    def to_json(self) -> str:
        """The tokenizer as a JSON string (what `save` writes): it travels inside checkpoints as text."""
        return self._tok.to_str()

    @classmethod
    def from_json(cls, text: str, source: str = "tokenizer JSON string") -> TextTokenizer:
        """Rebuild from `to_json` output, with the same checks as `load`."""
        try:
            config = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source} is not valid JSON: {e}") from None
        return cls._from_config(config, source)

    # size ----------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"TextTokenizer(vocab_size={self.vocab_size}, merges={len(self._merges)})"

    # encoding ------------------------------------------------------------------------------------

    def encode(self, text: str, dropout: float | None = None, seed: int | None = None) -> list[int]:
        """Token ids of `text`.

        Args:
            text: any Unicode string (lone surrogates, which are not Unicode text, are refused).
            dropout: BPE-dropout probability in [0, 1]; None or 0 gives the deterministic segmentation
                (use that for evaluation), 1 gives raw bytes.
            seed: makes a dropout segmentation reproducible; ignored without dropout.
        """
        _check_text(text)
        if not _check_dropout(dropout):
            return self._hf_encode([text])[0]
        return self._encode_with_merges(text, float(dropout), random.Random(seed))

    def encode_batch(
        self, texts: Sequence[str], dropout: float | None = None, seed: int | None = None
    ) -> list[list[int]]:
        """`[encode(t) for t in texts]`, through HF's parallel batch path when there is no dropout.

        With dropout, one generator seeded by `seed` serves the whole batch, in order.
        """
        if isinstance(texts, str):
            raise TypeError("encode_batch expects a list of str, got a single str; use encode()")
        texts = list(texts)
        for i, text in enumerate(texts):
            _check_text(text, where=f"texts[{i}]")
        if not _check_dropout(dropout):
            return self._hf_encode(texts)
        rng = random.Random(seed)
        return [self._encode_with_merges(t, float(dropout), rng) for t in texts]

    def _hf_encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def _encode_with_merges(self, text: str, dropout: float, rng: random.Random) -> list[int]:
        """Apply the merge list per pre-token, skipping each candidate merge with probability `dropout`.

        Mirrors HF's `Word::merge_all`: a min-heap of (rank, position) candidates over a linked list
        of symbols, so that dropout=0 reproduces HF exactly. A skipped candidate is put back after the
        next merge that does happen, so it is drawn afresh at the next step, as in Provilkov et al.
        """
        ids: list[int] = []
        for piece, _ in self._tok.pre_tokenizer.pre_tokenize_str(text):
            ids.extend(self._merge_piece([self._vocab[ch] for ch in piece], dropout, rng))
        return ids

    def _merge_piece(self, symbols: list[int], dropout: float, rng: random.Random) -> list[int]:
        n = len(symbols)
        if n < 2:
            return symbols
        merges = self._merges
        nxt = [*range(1, n), -1]
        prv = list(range(-1, n - 1))
        alive = [True] * n
        heap: list[tuple[int, int, int]] = []  # (rank, position, merged id): lowest rank, then leftmost
        for pos, pair in enumerate(zip(symbols, symbols[1:], strict=False)):
            if (merge := merges.get(pair)) is not None:
                heap.append((merge[0], pos, merge[1]))
        heapq.heapify(heap)
        skipped: list[tuple[int, int, int]] = []
        while heap:
            rank, pos, new = heapq.heappop(heap)
            right = nxt[pos]
            # Entries go stale when a neighbour merged since they were pushed; HF checks the same way.
            if not alive[pos] or right < 0 or merges.get((symbols[pos], symbols[right]), (0, -1))[1] != new:
                continue
            if dropout > 0.0 and rng.random() < dropout:
                skipped.append((rank, pos, new))
                continue
            for entry in skipped:
                heapq.heappush(heap, entry)
            skipped.clear()
            symbols[pos] = new
            alive[right] = False
            nxt[pos] = nxt[right]
            if nxt[pos] >= 0:
                prv[nxt[pos]] = pos
            if prv[pos] >= 0 and (left := merges.get((symbols[prv[pos]], new))) is not None:
                heapq.heappush(heap, (left[0], prv[pos], left[1]))
            if nxt[pos] >= 0 and (after := merges.get((new, symbols[nxt[pos]]))) is not None:
                heapq.heappush(heap, (after[0], pos, after[1]))
        return [s for s, keep in zip(symbols, alive, strict=True) if keep]

    # decoding ------------------------------------------------------------------------------------

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`. A slice that cuts a multi-byte character decodes that character as U+FFFD."""
        checked: list[int] = []
        for i in ids:
            try:
                token = operator.index(i)
            except TypeError:
                raise TypeError(f"token ids must be integers, got {i!r} ({type(i).__name__})") from None
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"token id {token} is outside the text vocabulary 0..{self.vocab_size - 1}")
            checked.append(token)
        return self._tok.decode(checked, skip_special_tokens=False)


def _check_text(text: object, where: str = "text") -> None:
    if not isinstance(text, str):
        raise TypeError(f"{where} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{where} contains {text[e.start]!r} at index {e.start}, a lone surrogate, which is not Unicode "
            "text and has no UTF-8 bytes (decode the source with errors='replace' or 'surrogatepass')"
        ) from None


def _check_dropout(dropout: float | None) -> bool:
    """True when dropout is on; refuses values outside [0, 1]."""
    if dropout is None:
        return False
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0.0 <= dropout <= 1.0:
        raise ValueError(f"dropout must be a probability in [0, 1] or None, got {dropout!r}")
    return dropout > 0.0


def _checked_texts(texts: Iterable[str]) -> Iterator[str]:
    for i, text in enumerate(texts):
        _check_text(text, where=f"training text {i}")
        yield text


# command line --------------------------------------------------------------------------------------


def iter_corpus(files: Sequence[str | Path]) -> Iterator[str]:
    """Documents of text files: `.jsonl` gives each line's "text" field, any other file each non-empty line.

    Raises ValueError naming the file and line for bad JSON, a missing or non-string "text", or bytes
    that are not UTF-8.
    """
    paths = [Path(f) for f in files]
    for path in paths:  # fail before any training starts
        if not path.is_file():
            raise FileNotFoundError(f"corpus file {str(path)!r} does not exist")
    for path in paths:
        jsonl = path.suffix.lower() == ".jsonl"
        with path.open(encoding="utf-8", newline="") as f:
            lineno = 0
            try:
                for lineno, line in enumerate(f, start=1):  # noqa: B007 (read after the loop for errors)
                    line = line.rstrip("\r\n")
                    if not line.strip():
                        continue
                    yield _jsonl_text(line, path, lineno) if jsonl else line
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: not UTF-8 text after line {lineno}: {e}") from None


def _jsonl_text(line: str, path: Path, lineno: int) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict) or "text" not in record:
        raise ValueError(f'{path}:{lineno}: expected an object with a "text" field, got {line[:80]!r}')
    if not isinstance(record["text"], str):
        raise ValueError(f'{path}:{lineno}: "text" must be a string, got {type(record["text"]).__name__}')
    return record["text"]


def train_tokenizer_main(argv: list[str] | None = None) -> None:
    """`zoo train-tokenizer --files a.txt b.jsonl --vocab_size 512 --out tokenizer.json`."""
    parser = command_parser(
        "zoo train-tokenizer", "Train the byte-level BPE text tokenizer and write it as one JSON file."
    )
    parser.add_argument(
        "--files",
        nargs="+",
        required=True,
        help='corpus files: .jsonl gives each line\'s "text"; other files one document per non-empty line',
    )
    parser.add_argument("--vocab_size", type=int, default=512, help="largest vocabulary incl. bytes (>= 257)")
    parser.add_argument("--min_frequency", type=int, default=2, help="fewest occurrences of a pair to merge")
    parser.add_argument("--out", default="tokenizer.json", help="output tokenizer JSON file")
    args = parser.parse_args(argv)

    num_docs = num_chars = num_tokens = 0
    try:
        tok = TextTokenizer.train(iter_corpus(args.files), args.vocab_size, args.min_frequency)
        # A second pass measures compression with the final vocabulary, in batches for HF's fast path.
        docs = iter_corpus(args.files)
        while batch := list(itertools.islice(docs, 1024)):
            num_docs += len(batch)
            num_chars += sum(len(doc) for doc in batch)
            num_tokens += sum(len(ids) for ids in tok.encode_batch(batch))
    except (ValueError, FileNotFoundError, TypeError) as e:
        parser.error(str(e))
    if num_docs == 0:
        parser.error(f"no documents found in {', '.join(args.files)}")
    tok.save(args.out)
    print(
        f"vocab size {tok.vocab_size} (requested {args.vocab_size}); "
        f"{num_tokens / max(num_chars, 1):.4f} tokens per character over {num_docs} documents "
        f"({num_chars} characters); wrote {args.out}"
    )
