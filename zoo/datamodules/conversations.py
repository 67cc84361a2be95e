"""Conversations for supervised fine-tuning (SFT, issue 18 item 1): sources of chat turns and the datamodule
that lays them out in the chat format and packs them.

    sources (`ConversationSource`: a jsonl file in the messages format here; ShapesWorld instructions in
             `zoo.datamodules.instructions`; arithmetic in `zoo.rl.instructions`)
      -> turns (`zoo.datamodules.chat.Turn`: roles, texts, media decoded at the model's sizes)
      -> `chat_document(maker, turns, answers_predicted=True)`: the loss on the assistant's turns only
      -> packed rows (`SequenceBuilder.collate`: several conversations a row, kept apart by document ids)

A jsonl line is one conversation in the messages format most SFT corpora use:

    {"messages": [{"role": "system", "content": "be brief"},
                  {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                               {"type": "image", "path": "images/a.png"}]},
                  {"role": "assistant", "content": "a small red circle at the top left"}]}

`content` is a string or a list of parts: `{"type": "text", "text": ...}` and `{"type": "image" | "audio" |
"video", "path": ...}` (the path relative to the jsonl file; `"image": path` is read too, as Hugging Face
writes it). Media in an assistant turn are what the assistant draws or says: their codes are the targets. A
line that cannot be used (bad JSON, an unknown role, a missing file, no assistant turn, longer than a row) is
a bad sample named by `file:line`: replaced and counted as `PairedDataModule` counts (`zoo.datamodules.
bad_samples`), the run stopping past `bad_samples.max_bad_fraction`.
"""

from __future__ import annotations

import bisect
import functools
import json
from collections.abc import Iterator
from itertools import accumulate, islice
from pathlib import Path
from typing import Any, ClassVar

from zoo.datamodules.bad_samples import BadSample, BadSamplePolicy
from zoo.datamodules.chat import ROLES, ChatError, Turn, chat_document
from zoo.datamodules.documents import DocumentDataModule, DocumentDataset, EpochShuffleSampler
from zoo.datamodules.media_samples import Media, MediaSpec, decode_media
from zoo.datamodules.paired_documents import DocumentMaker, MediaSupport
from zoo.datamodules.sequence import Document, MediaLayout
from zoo.tokenizers.text import TextTokenizer
from zoo.tokenizers.vocab import UnifiedVocab

SPLITS = ("train", "val", "test")
MEDIA_PARTS = ("image", "audio", "video")


class ConversationSource:
    """Conversations by split and index. Subclasses say how many a split has (`count`), what conversation
    `index` is in `epoch` (`conversation`: turns whose media are decoded at `spec`'s sizes; `BadSample` or
    `ValueError` naming it when it cannot be used) and which texts a tokenizer could be trained on."""

    def count(self, split: str) -> int:
        raise NotImplementedError

    def conversation(self, split: str, index: int, epoch: int, spec: MediaSpec) -> list[Turn]:
        raise NotImplementedError

    def texts(self) -> Iterator[str]:
        raise NotImplementedError

    # A source with a verifier says so and scores answers: SFT's validation then answers its held-out
    # conversations greedily and logs the verifier's accuracy (`zoo.tasks.sft`), as RL's validation does.
    verifiable: ClassVar[bool] = False

    def verify(self, split: str, index: int, answer: str) -> float:
        """The reward in [0, 1] of `answer` as the assistant's last turn of conversation `index`."""
        raise NotImplementedError(f"{type(self).__name__} has no verifier (verifiable is False)")


class JsonlConversations(ConversationSource):
    """A jsonl file of conversations in the messages format (module docstring).

    Args:
        path: the training conversations, one a line (blank lines skipped).
        val_path: validation conversations in the same format; None: the last `val_fraction` of `path`.
        val_fraction: without `val_path`, the share of `path`'s lines held out for validation (its last
            lines; at least one when the file has two or more and the fraction is positive).
    """

    def __init__(self, path: str, val_path: str | None = None, val_fraction: float = 0.0) -> None:
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}")
        self.path, self.val_path, self.val_fraction = Path(path), val_path, val_fraction
        self._lines: dict[str, list[tuple[Path, int, int]]] | None = None

    def __repr__(self) -> str:
        return f"JsonlConversations({self.path})"

    def lines(self) -> dict[str, list[tuple[Path, int, int]]]:
        """Per split, the (file, line number, byte offset) of each conversation, indexed once."""
        if self._lines is None:
            for file in (self.path, Path(self.val_path) if self.val_path else None):
                if file is not None and not file.is_file():
                    raise FileNotFoundError(
                        f"{file}: no such conversations file (jsonl, one conversation a line)"
                    )
            train = _index_lines(self.path)
            if self.val_path:
                val = _index_lines(Path(self.val_path))
            else:
                n_val = (
                    max(1, int(len(train) * self.val_fraction)) if self.val_fraction and len(train) > 1 else 0
                )
                train, val = train[: len(train) - n_val], train[len(train) - n_val :]
            self._lines = {"train": train, "val": val, "test": []}
        return self._lines

    def count(self, split: str) -> int:
        return len(self.lines()[split])

    def conversation(self, split: str, index: int, epoch: int, spec: MediaSpec) -> list[Turn]:
        file, number, offset = self.lines()[split][index]
        where = f"{file}:{number}"
        with open(file, "rb") as handle:
            handle.seek(offset)
            raw = handle.readline()
        try:
            record = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise BadSample(f"{where}: not a JSON object ({err})") from None
        return parse_messages(record, where, file.parent, spec)

    def texts(self) -> Iterator[str]:
        for file, _, offset in self.lines()["train"]:
            with open(file, "rb") as handle:
                handle.seek(offset)
                try:
                    record = json.loads(handle.readline())
                except ValueError:
                    continue  # a bad line is reported when it is read as a sample, not here
            for message in record.get("messages", []) if isinstance(record, dict) else []:
                content = message.get("content") if isinstance(message, dict) else None
                parts = (
                    [content] if isinstance(content, str) else content if isinstance(content, list) else []
                )
                for part in parts:
                    text = (
                        part
                        if isinstance(part, str)
                        else part.get("text")
                        if isinstance(part, dict)
                        else None
                    )
                    if isinstance(text, str) and text:
                        yield text


def _index_lines(path: Path) -> list[tuple[Path, int, int]]:
    lines, offset = [], 0
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if raw.strip():
                lines.append((path, number, offset))
            offset += len(raw)
    return lines


def parse_messages(record: Any, where: str, base: Path, spec: MediaSpec) -> list[Turn]:
    """A messages-format record (module docstring) as turns, media decoded at `spec`'s sizes; `BadSample`
    naming `where` and the message or part at fault."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise BadSample(f'{where}: expected an object with a non-empty "messages" list')
    turns = []
    for i, message in enumerate(messages):
        at = f"{where} messages[{i}]"
        if not isinstance(message, dict):
            raise BadSample(f'{at}: expected an object with "role" and "content"')
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise BadSample(f"{at}: unknown role {role!r}; expected one of {', '.join(ROLES)}")
        if isinstance(content, str):
            parts: tuple[str | Media, ...] = (content,)
        elif isinstance(content, list):
            parts = tuple(_part(part, f"{at}.content[{j}]", base, spec) for j, part in enumerate(content))
        else:
            raise BadSample(
                f"{at}: content must be a string or a list of parts, got {type(content).__name__}"
            )
        turns.append(Turn(role, parts, at))
    if not any(t.role == "assistant" and any(p != "" for p in t.parts) for t in turns):
        raise BadSample(f"{where}: no assistant answer: an SFT conversation needs one to learn from")
    return turns


def _part(part: Any, at: str, base: Path, spec: MediaSpec) -> str | Media:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise BadSample(f'{at}: a text part needs a "text" string')
        return text
    if kind in MEDIA_PARTS:
        path = part.get("path", part.get(kind))
        if not isinstance(path, str) or not path:
            raise BadSample(f'{at}: an {kind} part needs a "path" (relative to the jsonl file)')
        try:
            return decode_media(kind, base / path, spec, name=f"{at} ({path})")
        except (ValueError, OSError) as err:  # MediaError (missing, undecodable, too large) and the like
            raise BadSample(f"{at}: {err}") from None
    raise BadSample(f'{at}: expected a part {{"type": "text" | {" | ".join(map(repr, MEDIA_PARTS))}, ...}}')


class ConversationDataModule(DocumentDataModule):
    """Conversations from several sources as chat documents, the loss on the assistant's turns, packed.

    Args:
        sources: `ConversationSource`s (`JsonlConversations`, `ShapesInstructions`, `ArithmeticInstructions`);
            a split holds every source's conversations of that split, one after another.
        vocab: the model's unified vocabulary; it needs the role tokens (`chat: true`).
        media: how media are decoded and sized (None sizes come from the model at setup).
        image_context: a user's images are read through the vision encoder instead of as codes.
        video_context: a user's videos are read frame by frame through the vision encoder instead of as codes.
        tokenizer: a tokenizer JSON; None: the starting point's (`init_from`, handed over by the task), else
            a BPE trained at setup on the sources' texts.
        tokenizer_size: vocabulary of that BPE (None: vocab.text_size).
        tokenizer_texts: most texts read to train it.
        seq_len: packed row length; a longer conversation is a bad sample (counted, named).
        batch_size: conversations per batch (packed into as few rows as they fit).
        num_workers: DataLoader workers (media decoding happens in them).
        seed: shuffling and the sources' draws.
        bad_samples: when bad conversations stop the run.
    """

    def __init__(
        self,
        sources: list[ConversationSource],
        vocab: UnifiedVocab = UnifiedVocab(chat=True),
        media: MediaSpec = MediaSpec(),
        image_context: bool = False,
        video_context: bool = False,
        tokenizer: str | None = None,
        tokenizer_size: int | None = None,
        tokenizer_texts: int = 20_000,
        seq_len: int = 256,
        batch_size: int = 16,
        num_workers: int = 0,
        seed: int = 0,
        bad_samples: BadSamplePolicy = BadSamplePolicy(),
    ) -> None:
        super().__init__(vocab, seq_len, batch_size, 0.0, False, num_workers, seed, None, bad_samples)
        if not sources:
            raise ValueError("sources is empty: give a JsonlConversations, ShapesInstructions or ...")
        if not vocab.chat:
            raise ValueError(
                "ConversationDataModule lays conversations out with role tokens: give vocab.chat: true "
                "(a model pretrained without them grows by them with init_from)"
            )
        self.sources, self.media, self.image_context = list(sources), media, image_context
        self.video_context = video_context
        self.tokenizer_path, self.tokenizer_size, self.tokenizer_texts = (
            tokenizer,
            tokenizer_size,
            tokenizer_texts,
        )
        self.resolve_media(None)

    # -- sizes from the model ----------------------------------------------------------------------
    def trainer_model(self) -> object | None:
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        return getattr(module, "model", None)

    def resolve_media(self, model: object | None) -> None:
        """Layout, media sizes and the media the model takes, from `model` (None: the defaults)."""
        self.layout = self.builder.layout = MediaLayout.of(model) if model is not None else MediaLayout()
        self.spec = self.media.resolved_for(model)
        self.support = MediaSupport.of(model)

    def setup(self, stage: str | None = None) -> None:
        model = self.trainer_model()
        if model is not None:  # without a trainer, what `resolve_media` was last given (the defaults)
            self.resolve_media(model)
        super().setup(stage)

    def maker(self) -> DocumentMaker:
        assert self.tokenizer is not None
        return DocumentMaker(
            self.vocab, self.tokenizer, self.layout, self.builder.seq_len, self.image_context,
            support=self.support, video_context=self.video_context,
        )  # fmt: skip

    # -- splits ------------------------------------------------------------------------------------
    def counts(self, split: str) -> list[int]:
        return [source.count(split) for source in self.sources]

    def make_dataset(self, split: str) -> DocumentDataset | None:  # type: ignore[override]
        total = sum(self.counts(split))
        if not total:
            return None
        sampler = EpochShuffleSampler(total, self.seed, shuffle=split == "train")
        make = functools.partial(self.make_document, split)
        return DocumentDataset(total, make, sampler, name=f"{type(self).__name__} {split}")

    def turns(self, split: str, index: int, epoch: int = 0) -> list[Turn]:
        """Conversation `index` of `split` (over all sources, in order) in `epoch`."""
        starts = list(accumulate(self.counts(split), initial=0))
        number = bisect.bisect_right(starts, index) - 1
        if not 0 <= index < starts[-1]:
            raise IndexError(f"conversation {index} out of range 0..{starts[-1] - 1} of the {split} split")
        return self.sources[number].conversation(split, index - starts[number], epoch, self.spec)

    def make_document(self, split: str, index: int, epoch: int) -> Document:
        turns = self.turns(split, index, epoch)
        where = turns[0].where.split(" messages[")[0] if turns[0].where else f"{split} conversation {index}"
        maker = self.maker()
        try:
            document = chat_document(maker, turns, answers_predicted=True)
        except ChatError as err:
            raise BadSample(f"{where}: {err}") from None
        maker.check_length(document, where, "conversation")
        return document

    # -- the tokenizer -----------------------------------------------------------------------------
    def make_tokenizer(self) -> TextTokenizer:
        if self.tokenizer_path:
            return TextTokenizer.load(self.tokenizer_path)
        texts = [t for source in self.sources for t in islice(source.texts(), self.tokenizer_texts)]
        if not texts:
            raise ValueError(
                "the conversation sources hold no text to train a tokenizer on: give `tokenizer`"
            )
        return TextTokenizer.train(
            texts, vocab_size=self.tokenizer_size or self.vocab.text_size, min_frequency=2
        )

    def texts(self, split: str) -> list[str]:
        raise NotImplementedError("conversations are made by make_document, not from texts")
