"""RL's text tasks as SFT conversations (issue 18 item 1): question -> worked answer.

    user: "12+7-3="      assistant: "12+7=19,19-3=16"

The queries are `zoo.rl.tasks_text.TextTasks`' (add, arith, sort, count at chosen difficulties), so SFT and
RL see the same prompts and the held-out split is RL's: SFT's "val" and "test" are the prompts RL validates
on, never a training prompt. Generated on the fly from (seed, split, index). It lives with RL's tasks rather
than in `zoo.datamodules` because the tasks are RL's (`ConversationDataModule` takes any source by
`class_path`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from zoo.datamodules.chat import Turn
from zoo.datamodules.conversations import ConversationSource
from zoo.datamodules.media_samples import MediaSpec
from zoo.rl.records import Query
from zoo.rl.scoring import safe_verify
from zoo.rl.tasks_text import TextTasks


class ArithmeticInstructions(ConversationSource):
    """`TextTasks` queries as one-turn conversations, the reference solution the assistant's answer.

    Args:
        tasks: task names of `zoo.rl.tasks_text.GENERATORS` ("add", "arith", "sort", "count").
        difficulties: difficulty levels, each in 1..6.
        seed: selects every query (the same seed as the RL data gives the same prompts and held-out set).
        heldout_fraction: share of the prompt space held out (RL's `heldout_fraction`).
        train_size: conversations per training epoch (queries 0 .. train_size - 1 of RL's train split).
        val_size: held-out conversations validated on (RL's held-out queries 0 .. val_size - 1).
    """

    def __init__(
        self,
        tasks: Sequence[str] = ("arith",),
        difficulties: Sequence[int] = (1, 2),
        seed: int = 0,
        heldout_fraction: float = 0.1,
        train_size: int = 4096,
        val_size: int = 128,
    ) -> None:
        if train_size < 1 or val_size < 0:
            raise ValueError(f"train_size must be >= 1 and val_size >= 0, got {train_size}, {val_size}")
        self.tasks = TextTasks(tasks, difficulties, seed, heldout_fraction)
        self.sizes = {"train": train_size, "val": val_size, "test": val_size}

    def __repr__(self) -> str:
        return f"ArithmeticInstructions({list(self.tasks.tasks)}, {list(self.tasks.difficulties)})"

    def count(self, split: str) -> int:
        return self.sizes[split]

    def query(self, split: str, index: int) -> Query:
        return self.tasks.query(index, "train" if split == "train" else "heldout")

    def conversation(self, split: str, index: int, epoch: int, spec: MediaSpec) -> list[Turn]:
        query = self.query(split, index)
        where = f"ArithmeticInstructions {split} {index} ({query.id})"
        return [Turn("user", (query.prompt,), where), Turn("assistant", (query.solution,), where)]

    verifiable = True

    def verify(self, split: str, index: int, answer: str) -> float:
        """RL's reward of the query (1.0: the answer the verifier reads is right); a verifier error is 0."""
        return safe_verify(self.query(split, index), answer)

    def texts(self) -> Iterator[str]:
        for index in range(min(self.sizes["train"], 4096)):
            query = self.query("train", index)
            yield query.prompt
            yield query.solution
