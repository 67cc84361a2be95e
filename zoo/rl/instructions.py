"""RL's text tasks and environments as SFT conversations (issue 18 item 1): prompt -> reference answer.

    ArithmeticInstructions   user: "12+7-3="                          assistant: "12+7=19,19-3=16"
    FormatInstructions       user: "12+7 (answer in exactly 4 words)"   assistant: "the sum is 19"
    ToolInstructions         user: "compute 37*58"                      assistant: "<tool>calc: 37*58</tool>
                                                                          <result>2146</result> Answer: 2146"

The queries are RL's (`zoo.rl.tasks_text.TextTasks`, `zoo.rl.envs.instructions.InstructionTasks`,
`zoo.rl.envs.tools.ToolTasks`), so SFT and RL see the same prompts and the held-out split is RL's: SFT's
"val" and "test" are the prompts RL validates on, never a training prompt. Generated on the fly from (seed,
split, index). SFT on them is what lets the RL stages of the chain start (configs/rl/stages/): a policy that
never wrote a calculator call or met a format constraint gets reward 0 in every group, and GRPO then has no
signal. It lives with RL's tasks rather than in `zoo.datamodules` because the tasks are RL's
(`ConversationDataModule` takes any source by `class_path`).

A tool answer is one assistant turn, the calculator's `<result>` inside it: the chat format has no tool role
(a new special would move every id of a trained model). The result is an `EnvironmentText` part, input and
never a target: in RL the environment writes it (`zoo.rl.envs.tools`), and a policy trained to guess a
product would spend its loss on what it never has to say.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from zoo.datamodules.chat import EnvironmentText, Turn
from zoo.datamodules.conversations import ConversationSource
from zoo.datamodules.media_samples import MediaSpec
from zoo.rl.envs.instructions import CONSTRAINTS, CONTENTS, InstructionTasks
from zoo.rl.envs.tools import ToolTasks, transcript_parts
from zoo.rl.records import Query
from zoo.rl.scoring import safe_verify
from zoo.rl.tasks_text import TextTasks


class QueryMaker(Protocol):
    """What RL's task generators share: the query at `index` of "train" or "heldout"."""

    def query(self, index: int, split: str = "train") -> Query: ...


class QueryInstructions(ConversationSource):
    """RL queries (`tasks.query(index, split)`) as one-turn conversations, the reference solution the
    assistant's answer; verified with RL's verifier. Subclasses build `tasks`.

    Args:
        tasks: the queries' maker.
        train_size: conversations per training epoch (queries 0 .. train_size - 1 of RL's train split).
        val_size: held-out conversations validated on (RL's held-out queries 0 .. val_size - 1).
    """

    def __init__(self, tasks: QueryMaker, train_size: int, val_size: int) -> None:
        if train_size < 1 or val_size < 0:
            raise ValueError(f"train_size must be >= 1 and val_size >= 0, got {train_size}, {val_size}")
        self.tasks = tasks
        self.sizes = {"train": train_size, "val": val_size, "test": val_size}

    def count(self, split: str) -> int:
        return self.sizes[split]

    def query(self, split: str, index: int) -> Query:
        return self.tasks.query(index, "train" if split == "train" else "heldout")

    def conversation(self, split: str, index: int, epoch: int, spec: MediaSpec) -> list[Turn]:
        query = self.query(split, index)
        where = f"{type(self).__name__} {split} {index} ({query.id})"
        return [Turn("user", (query.prompt,), where), Turn("assistant", self.answer_parts(query), where)]

    def answer_parts(self, query: Query) -> tuple[str, ...]:
        """The assistant turn's parts: the reference solution, whole."""
        return (query.solution,)

    verifiable = True

    def verify(self, split: str, index: int, answer: str) -> float:
        """RL's reward of the query (1.0: the answer the verifier reads is right); a verifier error is 0."""
        return safe_verify(self.query(split, index), answer)

    def texts(self) -> Iterator[str]:
        for index in range(min(self.sizes["train"], 4096)):
            query = self.query("train", index)
            yield query.prompt
            yield query.solution


class ArithmeticInstructions(QueryInstructions):
    """`TextTasks` queries (stage 1's) as conversations: question -> worked answer.

    Args:
        tasks: task names of `zoo.rl.tasks_text.GENERATORS` ("add", "arith", "sort", "count").
        difficulties: difficulty levels, each in 1..6.
        seed: selects every query (the same seed as the RL data gives the same prompts and held-out set).
        heldout_fraction: share of the prompt space held out (RL's `heldout_fraction`).
        train_size, val_size: as `QueryInstructions`.
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
        super().__init__(TextTasks(tasks, difficulties, seed, heldout_fraction), train_size, val_size)

    def __repr__(self) -> str:
        return f"ArithmeticInstructions({list(self.tasks.tasks)}, {list(self.tasks.difficulties)})"


class FormatInstructions(QueryInstructions):
    """`InstructionTasks` queries (stage 3's: contents under format constraints) as conversations, the
    reference completion that satisfies every constraint the answer.

    Args:
        contents, constraints, counts, reward: as `zoo.rl.envs.data.InstructionRLDataModule`.
        seed, heldout_fraction: as RL's (the same values give the same prompts and held-out set).
        train_size, val_size: as `QueryInstructions`.
    """

    def __init__(
        self,
        contents: Sequence[str] = CONTENTS,
        constraints: Sequence[str] = tuple(CONSTRAINTS),
        counts: Sequence[int] = (1, 2),
        reward: str = "fraction",
        seed: int = 0,
        heldout_fraction: float = 0.1,
        train_size: int = 4096,
        val_size: int = 128,
    ) -> None:
        tasks = InstructionTasks(contents, constraints, counts, reward, seed, heldout_fraction)
        super().__init__(tasks, train_size, val_size)

    def __repr__(self) -> str:
        return f"FormatInstructions({list(self.tasks.contents)}, counts {list(self.tasks.counts)})"


class ToolInstructions(QueryInstructions):
    """`ToolTasks` queries (stage 4's: "compute 37*58") as conversations: the calculator call, its result
    and the final answer, the result laid out but not trained on (the module docstring says why).

    Args:
        difficulties: as `zoo.rl.envs.data.ToolRLDataModule`.
        seed, heldout_fraction: as RL's.
        train_size, val_size: as `QueryInstructions`.
    """

    def __init__(
        self,
        difficulties: Sequence[int] = (1,),
        seed: int = 0,
        heldout_fraction: float = 0.1,
        train_size: int = 4096,
        val_size: int = 128,
    ) -> None:
        super().__init__(ToolTasks(difficulties, seed, heldout_fraction), train_size, val_size)

    def __repr__(self) -> str:
        return f"ToolInstructions(difficulties {list(self.tasks.difficulties)})"

    def answer_parts(self, query: Query) -> tuple[str, ...]:
        """The call, the calculator's result (`EnvironmentText`: not trained on) and the final answer."""
        return tuple(EnvironmentText(text) if env else text for text, env in transcript_parts(query.solution))
