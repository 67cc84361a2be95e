"""Conversations as documents: the chat format of the unified model (issue 16 item 2; the SFT stage of
issue 18 trains on the same documents).

A conversation is a list of `Turn`s, each a role and its parts: texts and media (`VisualSegment`,
`AudioSegment`, decoded as training data is). With role tokens in the vocabulary (`UnifiedVocab(chat=True)`,
`zoo.tokenizers.vocab.CHAT_TOKENS`) it is laid out as

    <bos> [<|system|> text] <|user|> parts... <|assistant|> answer <eos> <|user|> parts... <|assistant|>

every part of a turn right after its role token, an assistant answer ended by `<eos>`; for generation the
document ends with `<|assistant|>` and the model answers until `<eos>`. Media of the user (and system) are
read, never predicted: an image through the vision encoder when the maker reads images as context, else as
codes. Media of the assistant are what it drew or said: codes, as generated (`<|assistant|> <boi> image <eoi>
<eos>`). `answers_predicted=True` (training, SFT) makes the assistant's answers (texts, the codes of its
images and speech, their openers) and their `<eos>` the only targets: the loss is on what the assistant says;
no position of another turn predicts anything, not even the `<boi>` of a user's image. "developer" counts as
"system" (OpenAI's newer name). An assistant part that is `EnvironmentText` (a tool's result inside the
answer) is laid out where it stands and never predicted: in RL the environment writes it into the rollout
(`zoo.rl.envs.tools`), so SFT must not train the policy to guess it.

A model trained without role tokens has never seen a conversation. For it, `plain_layout` is the rule the
zoo used before the chat format: the turns' texts joined by newlines (the roles not written) and at most one
medium, the document a captioning or transcription prompt; answers are continuations, not replies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from zoo.datamodules.media_samples import Media
from zoo.datamodules.paired_documents import DocumentMaker
from zoo.datamodules.sequence import Document, Segment, TextSegment

Role = Literal["system", "developer", "user", "assistant"]
ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant")
_ROLE_TOKEN = {
    "system": "<|system|>", "developer": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>",
}  # fmt: skip


class ChatError(ValueError):
    """A conversation that cannot be laid out. `param` names the part at fault (e.g. `messages[2]`)."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


class EnvironmentText(str):
    """Text in an assistant's turn that the environment wrote, not the assistant (a calculator's
    `<result>...</result>`): input to the positions after it, never a target. Tokenized as its own part, as
    the environment's ids enter a rollout, so SFT and RL see the same ids. Everywhere else it is a `str`."""

    __slots__ = ()


@dataclass(frozen=True)
class Turn:
    """One message: its role and its parts in order (texts, and media decoded by `zoo.media`; the pipeline
    also reads PIL images, audio arrays and file paths here). `where`: what errors call it (a request field,
    a file and line)."""

    role: Role
    parts: tuple[str | Media, ...]
    where: str = ""


def check_turns(turns: list[Turn]) -> None:
    if not turns:
        raise ChatError("the conversation is empty: expected at least one message")
    for i, turn in enumerate(turns):
        if turn.role not in ROLES:
            where = turn.where or f"messages[{i}]"
            raise ChatError(f"{where}: unknown role {turn.role!r}; expected one of {', '.join(ROLES)}", where)


def chat_document(maker: DocumentMaker, turns: list[Turn], answers_predicted: bool = False) -> Document:
    """The conversation in the chat format (module docstring). For generation (`answers_predicted=False`)
    the last turn must not be the assistant's: the document then ends with `<|assistant|>`."""
    check_turns(turns)
    vocab = maker.vocab
    if not vocab.chat:
        raise ChatError(
            "this model's vocabulary has no role tokens (UnifiedVocab.chat is false): lay the conversation "
            "out with plain_layout, or train with vocab.chat: true"
        )
    document: list[Segment] = [TextSegment([vocab.bos_id], predict=False)]
    for i, turn in enumerate(turns):
        where = turn.where or f"messages[{i}]"
        answer = turn.role == "assistant"
        document.append(TextSegment([vocab.special(_ROLE_TOKEN[turn.role])], predict=False))
        for part in turn.parts:
            predicted = answer and answers_predicted and not isinstance(part, EnvironmentText)
            if isinstance(part, str):
                document.append(TextSegment(maker.ids(part), predict=predicted))
            else:
                segment = maker.media(part, predict=predicted, where=where, context=not answer)
                document.append(replace(segment, predict_opener=predicted))
        if answer:
            document.append(TextSegment([vocab.eos_id], predict=answers_predicted))
    if not answers_predicted:
        if turns[-1].role == "assistant":
            raise ChatError("the conversation ends with the assistant's turn: nothing is asked of it")
        document.append(TextSegment([vocab.special("<|assistant|>")], predict=False))
    return document


def plain_layout(turns: list[Turn]) -> tuple[str, Media | None]:
    """For a model without role tokens (module docstring): the turns' texts joined by newlines, and the one
    medium of the conversation (or None)."""
    check_turns(turns)
    texts: list[str] = []
    media: list[tuple[str, Media]] = []
    for i, turn in enumerate(turns):
        for j, part in enumerate(turn.parts):
            if isinstance(part, str):
                if part:
                    texts.append(part)
            else:
                media.append((f"{turn.where or f'messages[{i}]'} part {j}", part))
    if len(media) > 1:
        where = ", ".join(w for w, _ in media)
        raise ChatError(
            f"{len(media)} media ({where}): a model without role tokens reads at most one image or audio a "
            "conversation",
            media[1][0],
        )
    return "\n".join(texts), media[0][1] if media else None
