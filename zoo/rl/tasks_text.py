"""Text tasks with exact answers and reference solutions, for RL on verifiable rewards (issue 5, item 5).

Three procedural families, each at an adjustable difficulty (1 = easiest):

    add    "37+58="          solution "95"                      sums of `difficulty`-digit numbers
    arith  "12+7-3="          solution "12+7=19,19-3=16"         a chain of difficulty + 1 operands, + and -
    sort   "sort 9 2 5:"      solution "2 5 9"                   difficulty + 2 numbers below 100
    count  "count a in abca:" solution "a,a=2"                   a string of 3 * difficulty + 3 letters

The prompt ends where the model's completion starts; the reference solution is what a perfect completion
says (the AHRL hint is a prefix of it), ending with the answer; the verifier (`zoo.rl.verifiers`) reads
the answer back from the completion. A query depends only on (seed, task, difficulty, split, index).
Held-out queries are those whose prompt hashes into the held-out share, and the training split skips
them, so the two splits never share a prompt even where the space of prompts is small.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from zoo.rl.records import Query
from zoo.world.scenes import stable_seed

SPLITS = ("train", "heldout")


def _add(rng: random.Random, difficulty: int) -> tuple[str, str, str]:
    high = 10**difficulty - 1
    a, b = rng.randint(0, high), rng.randint(0, high)
    return f"{a}+{b}=", str(a + b), str(a + b)


def _arith(rng: random.Random, difficulty: int) -> tuple[str, str, str]:
    operands = [rng.randint(1, 20) for _ in range(difficulty + 1)]
    signs = [rng.choice("+-") for _ in range(difficulty)]
    value, steps, prompt = operands[0], [], str(operands[0])
    for sign, operand in zip(signs, operands[1:], strict=True):
        new = value + operand if sign == "+" else value - operand
        steps.append(f"{value}{sign}{operand}={new}")
        prompt += f"{sign}{operand}"
        value = new
    return prompt + "=", ",".join(steps), str(value)


def _sort(rng: random.Random, difficulty: int) -> tuple[str, str, str]:
    numbers = [rng.randint(0, 99) for _ in range(difficulty + 2)]
    answer = " ".join(str(n) for n in sorted(numbers))
    return "sort " + " ".join(str(n) for n in numbers) + ":", answer, answer


def _count(rng: random.Random, difficulty: int) -> tuple[str, str, str]:
    letters = "abcd"
    text = "".join(rng.choice(letters) for _ in range(3 * difficulty + 3))
    target = rng.choice(letters)
    n = text.count(target)
    solution = (",".join([target] * n) if n else "none") + f"={n}"
    return f"count {target} in {text}:", solution, str(n)


GENERATORS: dict[str, Callable[[random.Random, int], tuple[str, str, str]]] = {
    "add": _add,
    "arith": _arith,
    "sort": _sort,
    "count": _count,
}
MAX_DIFFICULTY = 6


class TextTasks:
    """A seeded, unbounded stream of queries per split, over the chosen tasks and difficulties.

    Query `index` of a split cycles through (task, difficulty) pairs in order, so every pair is equally
    represented; its content is drawn from `stable_seed(seed, task, difficulty, split, index, attempt)`.

    Args:
        tasks: task names among `GENERATORS` ("add", "arith", "sort", "count").
        difficulties: difficulty levels, each in 1..6.
        seed: selects every query.
        heldout_fraction: share of the prompt space reserved for the held-out split, in (0, 0.5].
    """

    def __init__(
        self,
        tasks: Sequence[str] = ("add",),
        difficulties: Sequence[int] = (1,),
        seed: int = 0,
        heldout_fraction: float = 0.1,
    ) -> None:
        unknown = [t for t in tasks if t not in GENERATORS]
        if not tasks or unknown:
            raise ValueError(f"tasks must be a non-empty list of {sorted(GENERATORS)}, got {list(tasks)}")
        bad = [d for d in difficulties if isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= 6]
        if not difficulties or bad:
            raise ValueError(
                f"difficulties must be integers in 1..{MAX_DIFFICULTY}, got {list(difficulties)}"
            )
        if not 0.0 < heldout_fraction <= 0.5:
            raise ValueError(f"heldout_fraction must lie in (0, 0.5], got {heldout_fraction}")
        self.tasks, self.difficulties = tuple(tasks), tuple(difficulties)
        self.seed, self.heldout_fraction = seed, heldout_fraction
        self.pairs = [(t, d) for t in self.tasks for d in self.difficulties]

    def is_heldout(self, prompt: str) -> bool:
        return stable_seed("textheldout", self.seed, prompt) % 10_000 < self.heldout_fraction * 10_000

    def query(self, index: int, split: str = "train") -> Query:
        """The query at `index` of `split` ("train" or "heldout")."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        task, difficulty = self.pairs[index % len(self.pairs)]
        want_heldout = split == "heldout"
        for attempt in range(10_000):
            rng = random.Random(stable_seed("texttask", self.seed, task, difficulty, split, index, attempt))
            prompt, solution, answer = GENERATORS[task](rng, difficulty)
            if self.is_heldout(prompt) == want_heldout:
                return Query(
                    id=f"{task}/{difficulty}/{split}/{index}",
                    prompt=prompt,
                    answer=answer,
                    solution=solution,
                    task=task,
                    difficulty=difficulty,
                )
        raise RuntimeError(
            f"no {split} prompt for {task} difficulty {difficulty}: the prompt space is too small"
        )

    def queries(self, split: str, n: int, start: int = 0) -> list[Query]:
        return [self.query(i, split) for i in range(start, start + n)]


def training_text(query: Query) -> str:
    """The supervised document of a query: prompt followed by its reference solution (warm-start SFT)."""
    return query.prompt + query.solution
