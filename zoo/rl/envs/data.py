"""Query datamodules of the environments: instruction following and tool use (issue 18, item 3).

Both are `QueryDataModule`s (`zoo.rl.data`), so `RLTask` trains on them unchanged: the schedulers draw
their queries, the verifier pool scores completions with the task's verifier, validation reports held-out
accuracy. Prompts are text (in the chat format when the vocabulary has role tokens, as every
`QueryDataModule`'s). `ToolRLDataModule` also hands the engine and validation its `ToolEnvironment`, which
answers the policy's calculator calls inside the response.

A trained BPE (no tokenizer given, none from `init_from`) is trained on the prompts and reference
completions, so it holds the tool syntax; a tokenizer from an earlier stage covers it byte by byte.
"""

from __future__ import annotations

from zoo.rl.data import QueryDataModule
from zoo.rl.envs.instructions import CONSTRAINTS, CONTENTS, InstructionTasks
from zoo.rl.envs.tools import ToolEnvironment, ToolTasks
from zoo.rl.records import Query
from zoo.tokenizers.vocab import UnifiedVocab


class InstructionRLDataModule(QueryDataModule):
    """Instruction-following queries: contents with format constraints (`zoo.rl.envs.instructions`).

    Args:
        contents: among "arith" and "caption".
        constraints: the constraint kinds drawn from ("words", "include", "answer_line", "lowercase",
            "uppercase", "json_key").
        counts: constraints per query, each in 1..3.
        reward: "fraction" (share of the constraints satisfied) or "all" (1 only when all are).
        vocab .. val_batch_size: as `QueryDataModule`.
        heldout_fraction: share of the prompt space reserved for held-out queries.
    """

    def __init__(
        self,
        contents: tuple[str, ...] = CONTENTS,
        constraints: tuple[str, ...] = tuple(CONSTRAINTS),
        counts: tuple[int, ...] = (1, 2),
        reward: str = "fraction",
        vocab: UnifiedVocab = UnifiedVocab(),
        train_size: int = 1024,
        heldout_size: int = 128,
        seed: int = 0,
        heldout_fraction: float = 0.1,
        tokenizer: str | None = None,
        tokenizer_size: int = 320,
        steps_per_epoch: int = 1000,
        val_batch_size: int = 64,
    ) -> None:
        super().__init__(
            vocab, train_size, heldout_size, seed, tokenizer, tokenizer_size, steps_per_epoch, val_batch_size
        )
        self.tasks = InstructionTasks(contents, constraints, counts, reward, seed, heldout_fraction)

    def make_queries(self, split: str, n: int) -> list[Query]:
        return self.tasks.queries(split, n)

    def training_texts(self) -> list[str]:
        return [f"{q.prompt} {q.solution}" for q in self.train_queries()]


class ToolRLDataModule(QueryDataModule):
    """Tool-use queries ("compute 37*58") with a calculator the policy calls inside its response
    (`zoo.rl.envs.tools`); the reward reads the final answer only.

    Args:
        difficulties: difficulty levels, each in 1..3.
        max_calls: calls answered per response.
        vocab .. val_batch_size: as `QueryDataModule`.
        heldout_fraction: share of the prompt space reserved for held-out queries.
    """

    def __init__(
        self,
        difficulties: tuple[int, ...] = (1,),
        max_calls: int = 2,
        vocab: UnifiedVocab = UnifiedVocab(),
        train_size: int = 1024,
        heldout_size: int = 128,
        seed: int = 0,
        heldout_fraction: float = 0.1,
        tokenizer: str | None = None,
        tokenizer_size: int = 320,
        steps_per_epoch: int = 1000,
        val_batch_size: int = 64,
    ) -> None:
        super().__init__(
            vocab, train_size, heldout_size, seed, tokenizer, tokenizer_size, steps_per_epoch, val_batch_size
        )
        if max_calls < 1:
            raise ValueError(f"max_calls must be >= 1, got {max_calls}")
        self.tasks = ToolTasks(difficulties, seed, heldout_fraction)
        self.max_calls = max_calls
        self._environment: ToolEnvironment | None = None
        self._environment_tokenizer: object = None  # the tokenizer `_environment` encodes with

    def make_queries(self, split: str, n: int) -> list[Query]:
        return self.tasks.queries(split, n)

    def training_texts(self) -> list[str]:
        return [f"{q.prompt} {q.solution}" for q in self.train_queries()]

    def environment(self) -> ToolEnvironment:
        """The calculator, bound to this module's tokenizer (rebuilt when the tokenizer changes)."""
        tokenizer = self.ensure_tokenizer()
        if self._environment is None or self._environment_tokenizer is not tokenizer:
            self._environment = ToolEnvironment(self.decode, self.encode_text, self.max_calls)
            self._environment_tokenizer = tokenizer
        return self._environment
