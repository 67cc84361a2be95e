"""The records RL passes between its parts: a `Query` (a prompt and its ground truth: data -> engine ->
verifiers) and a `Rollout` (one sampled response and what the engine knew when it sampled it: engine ->
scheduler -> verifiers -> trainer), with their checkpoint form.

RL checkpoints load with `torch.load(weights_only=True)` (no code runs on loading), so a record is stored
as tensors and plain values only: `Query.to_state` / `Query.from_state`, `Rollout.to_state` /
`Rollout.from_state` (a prompt with media as its segments' fields). The form is the one checkpoints have
always had (tests/test_rl_records.py loads states written before the RL package was rebuilt).

Verifier worker processes unpickle queries, so this module imports neither torch nor the datamodules at
import time (each function that needs them imports them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from zoo.datamodules.sequence import Document


@dataclass
class Query:
    """One RL prompt with its ground truth (the contract between data, rollouts and verifiers).

    Attributes:
        id: unique and stable across runs (per-query statistics key on it: WPSM, AHRL pass rates).
        prompt: the text the policy continues.
        answer: the exact answer the verifier checks.
        solution: a reference completion ending with the answer (AHRL hints are prefixes of it).
        task: selects the verifier (`zoo.rl.verifiers.VERIFIERS`).
        difficulty: the task's difficulty level (for per-difficulty statistics).
    """

    id: str
    prompt: str
    answer: str
    solution: str
    task: str
    difficulty: int = 1

    def to_state(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> Query:
        return cls(**state)


@dataclass
class Rollout:
    """One sampled response and what the engine knew when it sampled it.

    query: the task item. prompt_ids: unified ids fed before the response (any hint included; `hint_len`
    of them are the hint); for a prompt with media, the laid-out ids of `prompt_document` (`pad_id` where
    media sit). prompt_document: the prompt with media (as codes), None for a text prompt.
    response_ids: the sampled tokens (a stop id, when one ended it, included).
    inf_logprobs: `[len(response)]` float32 l_inf. routing: MoE layer -> `[len(prompt) + positions of the
    response, top_k]` expert ids, the backbone's `routing` argument for a forward of this one sequence
    (also for a partial rollout from `interrupt`). versions: the policy version that sampled each
    response token. finished: a stop id ended it. truncated: its token budget ended it.
    max_new_tokens: this rollout's own budget (None: the engine's). group: the scheduler's group index.
    injected: per response token, True where an environment fed it (a tool's result: no decision of the
    policy, l_inf 0.0, out of the loss); empty when no environment took part (`zoo.rl.envs.protocol`).
    """

    query: Query
    prompt_ids: list[int]
    response_ids: list[int]
    inf_logprobs: Tensor
    routing: dict[int, Tensor] | None
    versions: list[int]
    finished: bool
    truncated: bool
    reward: float | None = None
    hint_len: int = 0
    max_new_tokens: int | None = None
    group: int = -1
    prompt_document: Document | None = None
    injected: list[bool] = dataclasses.field(default_factory=list)

    @property
    def policy_mask(self) -> list[bool]:
        """Per response token, True where the policy decided it (everything but environment tokens)."""
        return [not forced for forced in self.injected] if self.injected else [True] * len(self.response_ids)

    @property
    def done(self) -> bool:
        return self.finished or self.truncated

    @property
    def min_version(self) -> int | None:
        return min(self.versions) if self.versions else None

    def to_state(self) -> dict:
        """The rollout as tensors and plain values (on the CPU); its query as a `Query`'s fields."""
        if not isinstance(self.query, Query):
            raise TypeError(f"only zoo.rl.records.Query rollouts can be checkpointed, got {type(self.query)}")
        state = {
            "query": self.query.to_state(),
            "prompt_ids": list(self.prompt_ids),
            "response_ids": list(self.response_ids),
            "inf_logprobs": self.inf_logprobs.detach().cpu(),
            "routing": None if self.routing is None else {k: v.cpu() for k, v in self.routing.items()},
            "versions": list(self.versions),
            "finished": self.finished,
            "truncated": self.truncated,
            "reward": self.reward,
            "hint_len": self.hint_len,
            "max_new_tokens": self.max_new_tokens,
            "group": self.group,
            "prompt_document": document_state(self.prompt_document),
        }
        if self.injected:  # only rollouts an environment took part in (the form of older states otherwise)
            state["injected"] = list(self.injected)
        return state

    @classmethod
    def from_state(cls, state: dict) -> Rollout:
        """The rollout `to_state` gave (other keys of `state`, such as a scheduler's, are ignored)."""
        import torch

        routing = state["routing"]
        return cls(
            query=Query.from_state(state["query"]),
            prompt_ids=list(state["prompt_ids"]),
            response_ids=list(state["response_ids"]),
            inf_logprobs=torch.as_tensor(state["inf_logprobs"], dtype=torch.float32),
            routing=None if routing is None else {int(k): v.long() for k, v in routing.items()},
            versions=list(state["versions"]),
            finished=bool(state["finished"]),
            truncated=bool(state["truncated"]),
            reward=state["reward"],
            hint_len=int(state["hint_len"]),
            max_new_tokens=state["max_new_tokens"],
            group=int(state["group"]),
            prompt_document=document_from_state(state.get("prompt_document")),
            injected=[bool(x) for x in state.get("injected", [])],
        )


def document_state(document: Document | None) -> list[dict] | None:
    """A document as plain values and tensors (a `weights_only` load reads it)."""
    from zoo.datamodules.sequence import AudioSegment, ContextSegment, TextSegment, VisualSegment

    if document is None:
        return None
    state = []
    for s in document:
        if isinstance(s, TextSegment):
            state.append({"kind": "text", "ids": list(s.ids), "predict": s.predict})
        elif isinstance(s, VisualSegment):
            visual = {"pixels": s.pixels, "codes": s.codes, "video": s.video, "predict": s.predict}
            state.append({"kind": "visual", **visual})
        elif isinstance(s, AudioSegment):
            state.append({"kind": "audio", "wave": s.wave, "codes": s.codes, "predict": s.predict})
        elif isinstance(s, ContextSegment):
            state.append({"kind": "context", "pixels": s.pixels})
        else:
            raise TypeError(f"unknown segment type {type(s).__name__}")
    return state


def document_from_state(state: list[dict] | None) -> Document | None:
    from zoo.datamodules.sequence import AudioSegment, ContextSegment, TextSegment, VisualSegment

    if state is None:
        return None
    kinds = {"text": TextSegment, "visual": VisualSegment, "audio": AudioSegment, "context": ContextSegment}
    for item in state:
        if item.get("kind") not in kinds:
            expected = ", ".join(sorted(kinds))
            raise ValueError(f"a prompt document segment of kind {item.get('kind')!r}: expected {expected}")
    return [kinds[item["kind"]](**{k: v for k, v in item.items() if k != "kind"}) for item in state]
