"""Instruction following as a verifiable RL environment (issue 18, item 3; IFEval-style constraints).

A query is a simple content (an addition such as "12+7", or a ShapesWorld scene caption to restate) and one
to three format constraints the completion must satisfy, written in the prompt:

    "12+7 (use the word sum; answer in exactly 4 words)"        -> e.g. "the sum is 19"
    "describe a small blue diamond at the left (write in capitals)" -> e.g. "A SMALL BLUE DIAMOND ..."
    "12+7 (end with 'Answer: <n>')"                               -> e.g. "12+7 is 19 Answer: 19"

Constraints (one class a kind, `CONSTRAINTS`), over the completion stripped of surrounding spaces; a *word*
is a maximal run of non-space characters:

    words        exactly N words
    include      the word X appears (case-insensitive, as a run of letters and digits)
    answer_line  the completion ends with "Answer: n", n the content's right answer (format and content)
    lowercase    no capital letter, at least one letter;   uppercase: no small letter, at least one letter
    json_key     the completion is a JSON object with the key K

The reward is the fraction of constraints satisfied (task "instructions") or 1.0 only when all are
(task "instructions_all"): the task name picks the verifier. A query's `answer` is its constraints as JSON
(`[[kind, value], ...]`), so the verifier needs nothing but the query; its `solution` is a reference
completion built to satisfy them all (checked when the query is made: a generator bug cannot ship a query
that no completion satisfies). Held-out queries are those whose prompt hashes into the held-out share.

Pure Python (no torch): verifier worker processes import this module.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from zoo.rl.records import Query
from zoo.world.scenes import ShapesWorld, stable_seed

SPLITS = ("train", "heldout")
CONTENTS = ("arith", "caption")
_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class Content:
    """What a prompt is about: its text, the words of a plain answer, words worth requiring, the exact answer
    an answer line must give ("" when the content has none)."""

    prompt: str
    words: tuple[str, ...]
    keywords: tuple[str, ...]
    answer: str = ""


def arith_content(rng: random.Random, digits: int) -> Content:
    high = 10**digits - 1
    a, b = rng.randint(0, high), rng.randint(0, high)
    return Content(f"{a}+{b}", (f"{a}+{b}", "is", str(a + b)), ("sum", "total", "result"), str(a + b))


def caption_content(world: ShapesWorld, index: int, split: str) -> Content:
    caption = world.caption(world.scene(index, split))
    words = tuple(caption.split())
    keywords = tuple(w for w in words if w not in ("a", "at", "the", "and", "in"))
    return Content(f"describe {caption}", words, keywords)


# ------------------------------------------------------------------------------------------- constraints


@dataclass(frozen=True)
class Constraint:
    """One format constraint: `describe` is what the prompt says, `check` whether a completion obeys."""

    kind: ClassVar[str]
    value: str = ""

    def describe(self) -> str:
        raise NotImplementedError

    def check(self, text: str) -> bool:
        raise NotImplementedError


@dataclass(frozen=True)
class Words(Constraint):
    kind: ClassVar[str] = "words"

    def describe(self) -> str:
        return f"answer in exactly {self.value} words"

    def check(self, text: str) -> bool:
        return len(text.split()) == int(self.value)


@dataclass(frozen=True)
class Include(Constraint):
    kind: ClassVar[str] = "include"

    def describe(self) -> str:
        return f"use the word {self.value}"

    def check(self, text: str) -> bool:
        return self.value.lower() in _WORD.findall(text.lower())


@dataclass(frozen=True)
class AnswerLine(Constraint):
    kind: ClassVar[str] = "answer_line"

    def describe(self) -> str:
        return "end with 'Answer: <n>'"

    def check(self, text: str) -> bool:
        return text.endswith(f"Answer: {self.value}") and (
            len(text) == len(f"Answer: {self.value}") or text[-len(f"Answer: {self.value}") - 1].isspace()
        )


@dataclass(frozen=True)
class Lowercase(Constraint):
    kind: ClassVar[str] = "lowercase"

    def describe(self) -> str:
        return "write in lowercase"

    def check(self, text: str) -> bool:
        return any(c.isalpha() for c in text) and text == text.lower()


@dataclass(frozen=True)
class Uppercase(Constraint):
    kind: ClassVar[str] = "uppercase"

    def describe(self) -> str:
        return "write in capitals"

    def check(self, text: str) -> bool:
        return any(c.isalpha() for c in text) and text == text.upper()


@dataclass(frozen=True)
class JsonKey(Constraint):
    kind: ClassVar[str] = "json_key"

    def describe(self) -> str:
        return f'reply as JSON with the key "{self.value}"'

    def check(self, text: str) -> bool:
        try:
            parsed = json.loads(text)
        except ValueError:
            return False
        return isinstance(parsed, dict) and self.value in parsed


CONSTRAINTS: dict[str, type[Constraint]] = {
    c.kind: c for c in (Words, Include, AnswerLine, Lowercase, Uppercase, JsonKey)
}
# Pairs no completion can satisfy together (or only absurdly: a JSON object counted in words).
_CONFLICTS = {
    frozenset(p)
    for p in [
        ("lowercase", "uppercase"), ("answer_line", "lowercase"), ("answer_line", "uppercase"),
        ("answer_line", "json_key"), ("json_key", "words"), ("json_key", "uppercase"),
    ]
}  # fmt: skip
_JSON_KEYS = ("answer", "reply", "text")


def constraints_of(query: Query) -> list[Constraint]:
    """The constraints a query's `answer` holds (JSON `[[kind, value], ...]`); errors name the query."""
    try:
        pairs = json.loads(query.answer)
        return [CONSTRAINTS[kind](str(value)) for kind, value in pairs]
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(
            f"query {query.id}: answer {query.answer!r} is not a JSON list of [kind, value] constraints "
            f"with kinds among {sorted(CONSTRAINTS)}"
        ) from err


def satisfied(query: Query, output: str) -> list[bool]:
    """Per constraint of the query, whether the completion (stripped) obeys it."""
    if not isinstance(output, str):
        got = type(output).__name__
        raise TypeError(f"an instruction verifier expects the completion as a str, got {got}")
    text = output.strip()
    return [c.check(text) for c in constraints_of(query)]


def verify_instructions(query: Query, output: str) -> float:
    """The fraction of the query's constraints the completion satisfies."""
    checks = satisfied(query, output)
    return sum(checks) / len(checks)


def verify_instructions_all(query: Query, output: str) -> float:
    """1.0 when the completion satisfies every constraint of the query, else 0.0."""
    return float(all(satisfied(query, output)))


REWARDS = {"fraction": "instructions", "all": "instructions_all"}


# ------------------------------------------------------------------------------------------ the tasks


def reference(content: Content, constraints: Sequence[Constraint]) -> str:
    """A completion that satisfies every constraint (the reference solution, the AHRL hint source)."""
    kinds = {c.kind: c for c in constraints}
    body = list(content.words)
    if "include" in kinds and kinds["include"].value not in body:
        body = [kinds["include"].value, *body]
    if "words" in kinds:
        extra = 2 if "answer_line" in kinds else 0
        want = int(kinds["words"].value) - extra
        keep = kinds["include"].value if "include" in kinds else None
        body = [w for w in body if w == keep][:1] + [w for w in body if w != keep]
        body = (body + ["indeed"] * want)[:want]
    text = " ".join(body)
    if "uppercase" in kinds:
        text = text.upper()
    if "answer_line" in kinds:
        text = f"{text} Answer: {kinds['answer_line'].value}".strip()
    if "json_key" in kinds:
        text = json.dumps({kinds["json_key"].value: text})
    return text


class InstructionTasks:
    """A seeded, unbounded stream of instruction-following queries per split.

    Query `index` of a split cycles through (content, number of constraints) pairs; its content and
    constraints are drawn from `stable_seed(seed, content, n, split, index, attempt)`.

    Args:
        contents: among "arith" (additions of 1-2 digit numbers) and "caption" (ShapesWorld captions).
        constraints: the constraint kinds drawn from (`CONSTRAINTS`).
        counts: how many constraints a query has, each in 1..3 (its `difficulty`).
        reward: "fraction" (the share satisfied) or "all" (all-or-nothing): the queries' verifier task.
        seed: selects every query (and the ShapesWorld of the captions).
        heldout_fraction: share of the prompt space reserved for the held-out split, in (0, 0.5].
    """

    def __init__(
        self,
        contents: Sequence[str] = CONTENTS,
        constraints: Sequence[str] = tuple(CONSTRAINTS),
        counts: Sequence[int] = (1, 2),
        reward: str = "fraction",
        seed: int = 0,
        heldout_fraction: float = 0.1,
    ) -> None:
        if not contents or any(c not in CONTENTS for c in contents):
            raise ValueError(f"contents must be a non-empty list of {list(CONTENTS)}, got {list(contents)}")
        if not constraints or any(c not in CONSTRAINTS for c in constraints):
            raise ValueError(
                f"constraints must be a non-empty list of {sorted(CONSTRAINTS)}, got {list(constraints)}"
            )
        if not counts or any(isinstance(n, bool) or n not in (1, 2, 3) for n in counts):
            raise ValueError(f"counts must be integers in 1..3, got {list(counts)}")
        if reward not in REWARDS:
            raise ValueError(f"reward must be one of {sorted(REWARDS)}, got {reward!r}")
        if not 0.0 < heldout_fraction <= 0.5:
            raise ValueError(f"heldout_fraction must lie in (0, 0.5], got {heldout_fraction}")
        self.contents, self.kinds, self.counts = tuple(contents), tuple(constraints), tuple(counts)
        self.task, self.seed, self.heldout_fraction = REWARDS[reward], seed, heldout_fraction
        self.pairs = [(c, n) for c in self.contents for n in self.counts]
        self.world = ShapesWorld(seed=seed, max_objects=1)

    def is_heldout(self, prompt: str) -> bool:
        return stable_seed("instructionheldout", self.seed, prompt) % 10_000 < self.heldout_fraction * 10_000

    def _content(self, rng: random.Random, kind: str, split: str) -> Content:
        if kind == "arith":
            return arith_content(rng, rng.choice((1, 2)))
        return caption_content(self.world, rng.randrange(1_000_000), "train" if split == "train" else "val")

    def _constraints(self, rng: random.Random, content: Content, n: int) -> list[Constraint] | None:
        kinds = [k for k in self.kinds if k != "answer_line" or content.answer]
        if len(kinds) < n:
            return None
        chosen = rng.sample(kinds, n)
        if any(frozenset((a, b)) in _CONFLICTS for a in chosen for b in chosen if a != b):
            return None
        values = {
            "words": lambda: str(rng.randint(2, 6)),
            "include": lambda: rng.choice(content.keywords),
            "answer_line": lambda: content.answer,
            "json_key": lambda: rng.choice(_JSON_KEYS),
        }
        return [CONSTRAINTS[k](values[k]() if k in values else "") for k in sorted(chosen)]

    def query(self, index: int, split: str = "train") -> Query:
        """The query at `index` of `split` ("train" or "heldout")."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        kind, n = self.pairs[index % len(self.pairs)]
        for attempt in range(10_000):
            rng = random.Random(stable_seed("instructions", self.seed, kind, n, split, index, attempt))
            content = self._content(rng, kind, split)
            constraints = self._constraints(rng, content, n)
            if constraints is None:
                continue
            prompt = f"{content.prompt} ({'; '.join(c.describe() for c in constraints)})"
            if self.is_heldout(prompt) != (split == "heldout"):
                continue
            answer = json.dumps([[c.kind, c.value] for c in constraints])
            query = Query(f"{kind}/{n}/{split}/{index}", prompt, answer, reference(content, constraints),
                          self.task, n)  # fmt: skip
            if not all(satisfied(query, query.solution)):
                raise AssertionError(f"query {query.id}: its reference {query.solution!r} breaks {answer}")
            return query
        raise RuntimeError(f"no {split} instruction query for {kind} with {n} constraints among {self.kinds}")

    def queries(self, split: str, n: int, start: int = 0) -> list[Query]:
        return [self.query(i, split) for i in range(start, start + n)]
