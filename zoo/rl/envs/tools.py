"""Tool use as a verifiable RL environment: a calculator the policy calls inside its response (issue 18).

The syntax is plain text in the chat format's assistant turn (the vocabulary has no tool role token, and a
new special would move every id of a trained model):

    compute 37*58                                   the prompt (after <|user|> with role tokens)
    <tool>calc: 37*58</tool>                        the policy's call
     <result>2146</result>                          the environment's answer (injected, never trained on)
     Answer: 2146<eos>                              the policy's final answer

The engine (`zoo.rl.rollout.InferenceEngine`) asks `ToolEnvironment.forced_token` after every token: once the
policy's text since the last result contains `</tool>`, the result's ids are owed and fed one a step in
place of sampling (`Rollout.injected` marks them; `zoo.rl.update` masks them out of the loss). They count
toward the response's token budget (a result cut by it leaves the rollout truncated). The result
starts with a space, so the byte-level BPE's pre-tokenizer never merges the policy's `>` with it.

`calculate` evaluates an arithmetic expression over an AST allow-list (numbers, + - * / // % **, unary
signs, parentheses), never `eval`; exponents, operands and results are bounded so that a call cannot hang
or exhaust memory. A bad call gets `<result>error: ...</result>`, not an exception.

The reward (`verify_tool_answer`, task "tool_calc") reads only the final answer: the last integer after the
last `</result>` (the whole completion when no tool was called) must equal the query's answer. `ToolTasks`
makes seeded multiplication queries ("compute 37*58") whose reference solution is the transcript above.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from zoo.rl.records import Query
from zoo.world.scenes import stable_seed

if TYPE_CHECKING:
    from zoo.models.sampling import Sampler
    from zoo.models.unified import UnifiedModel
    from zoo.rl.records import Rollout

OPEN, CLOSE = "<tool>", "</tool>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
TOOL = "calc:"
SPLITS = ("train", "heldout")
_INTEGER = re.compile(r"-?\d+")

# ---------------------------------------------------------------------------------------- calculator

_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip
_UNARY: dict[type, Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION = 80  # characters
MAX_MAGNITUDE = 10**18
MAX_EXPONENT = 64


class CalculatorError(ValueError):
    """An expression the calculator refuses, and why."""


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression (module docstring); CalculatorError says what is refused."""
    if len(expression) > MAX_EXPRESSION:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise CalculatorError(f"not an expression: {expression.strip()!r}") from err
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} exceeds {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError as err:
            raise CalculatorError("division by zero") from err
        except OverflowError as err:
            raise CalculatorError(f"a value beyond {MAX_MAGNITUDE:.0e}") from err
        if isinstance(value, complex):
            raise CalculatorError("complex result")
        return _bounded(value)
    raise CalculatorError(f"{type(node).__name__} is not allowed (numbers, + - * / // % ** and brackets)")


def _bounded(value: int | float) -> int | float:
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"a value beyond {MAX_MAGNITUDE:.0e}")
    return value


def format_value(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def run_call(call: str) -> str:
    """The result text of a call's body ("calc: 37*58" -> "2146"; a refusal -> "error: ...")."""
    call = call.strip()
    if not call.startswith(TOOL):
        return f"error: unknown tool, expected '{TOOL} <expression>'"
    try:
        return format_value(calculate(call[len(TOOL) :]))
    except CalculatorError as err:
        return f"error: {err}"


def result_text(call: str) -> str:
    """What the environment appends after a call (a leading space: see the module docstring)."""
    return f" {RESULT_OPEN}{run_call(call)}{RESULT_CLOSE}"


def transcript_parts(text: str) -> list[tuple[str, bool]]:
    """A transcript cut where the environment wrote into it: `(text, written by the environment)` in order,
    each result (`result_text`, its leading space included) a part of its own, as a rollout holds it
    ("<tool>calc: 2*3</tool> <result>6</result> Answer: 6" -> call, result, answer)."""
    parts: list[tuple[str, bool]] = []
    rest = text
    while (at := rest.find(f" {RESULT_OPEN}")) >= 0 and (end := rest.find(RESULT_CLOSE, at)) >= 0:
        end += len(RESULT_CLOSE)
        parts += [(rest[:at], False), (rest[at:end], True)]
        rest = rest[end:]
    return [(part, env) for part, env in [*parts, (rest, False)] if part]


def call_of(text: str) -> str | None:
    """The body of the first complete call in `text` ("" when `</tool>` has no `<tool>` before it)."""
    end = text.find(CLOSE)
    if end < 0:
        return None
    start = text.rfind(OPEN, 0, end)
    return "" if start < 0 else text[start + len(OPEN) : end]


# ------------------------------------------------------------------------------------------- verifier


def final_answer(text: str) -> str:
    """What follows the last tool result (the whole text when no tool answered)."""
    at = text.rfind(RESULT_CLOSE)
    return text if at < 0 else text[at + len(RESULT_CLOSE) :]


def verify_tool_answer(query: Query, output: str) -> float:
    """1.0 when the last integer of the final answer (after the last tool result) is the query's answer."""
    if not isinstance(output, str):
        raise TypeError(f"a tool verifier expects the completion as a str, got {type(output).__name__}")
    found = _INTEGER.findall(final_answer(output))
    return float(bool(found) and int(found[-1]) == int(query.answer))


# ------------------------------------------------------------------------------------------- the tasks


class ToolTasks:
    """Seeded multiplication queries worth a calculator: "compute 37*58", answer 2146.

    Difficulty d multiplies a (d + 1)-digit number by a 2-digit one. Held-out queries are those whose prompt
    hashes into the held-out share (the training split skips them).

    Args:
        difficulties: difficulty levels, each in 1..3.
        seed: selects every query.
        heldout_fraction: share of the prompt space held out, in (0, 0.5].
    """

    def __init__(
        self, difficulties: Sequence[int] = (1,), seed: int = 0, heldout_fraction: float = 0.1
    ) -> None:
        if not difficulties or any(isinstance(d, bool) or d not in (1, 2, 3) for d in difficulties):
            raise ValueError(f"difficulties must be integers in 1..3, got {list(difficulties)}")
        if not 0.0 < heldout_fraction <= 0.5:
            raise ValueError(f"heldout_fraction must lie in (0, 0.5], got {heldout_fraction}")
        self.difficulties, self.seed, self.heldout_fraction = tuple(difficulties), seed, heldout_fraction

    def is_heldout(self, prompt: str) -> bool:
        return stable_seed("toolheldout", self.seed, prompt) % 10_000 < self.heldout_fraction * 10_000

    def query(self, index: int, split: str = "train") -> Query:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        difficulty = self.difficulties[index % len(self.difficulties)]
        for attempt in range(10_000):
            rng = random.Random(stable_seed("tooltask", self.seed, difficulty, split, index, attempt))
            a, b = rng.randint(10**difficulty, 10 ** (difficulty + 1) - 1), rng.randint(10, 99)
            prompt = f"compute {a}*{b}"
            if self.is_heldout(prompt) == (split == "heldout"):
                call = f"{TOOL} {a}*{b}"
                solution = f"{OPEN}{call}{CLOSE}{result_text(call)} Answer: {a * b}"
                return Query(f"tool/{difficulty}/{split}/{index}", prompt, str(a * b), solution, "tool_calc",
                             difficulty)  # fmt: skip
        raise RuntimeError(f"no {split} tool query at difficulty {difficulty}")

    def queries(self, split: str, n: int, start: int = 0) -> list[Query]:
        return [self.query(i, split) for i in range(start, start + n)]


# ---------------------------------------------------------------------------------------- environment


class ToolEnvironment:
    """The calculator inside rollouts: what the engine must feed after a call (`zoo.rl.envs.protocol`).

    Args:
        decode: unified ids -> text (the datamodule's, specials dropped).
        encode: text -> unified ids (no specials).
        max_calls: calls answered per response; later calls are left as plain text.
        tasks: the query tasks the environment takes part in (other rollouts are never touched).
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        encode: Callable[[str], list[int]],
        max_calls: int = 2,
        tasks: tuple[str, ...] = ("tool_calc",),
    ) -> None:
        if max_calls < 1:
            raise ValueError(f"max_calls must be >= 1, got {max_calls}")
        self.decode, self.encode, self.max_calls, self.tasks = decode, encode, max_calls, tasks

    def owed(self, response_ids: list[int], injected: list[bool]) -> list[int]:
        """The result ids still owed to a response whose last policy token completed a call."""
        mask = injected or [False] * len(response_ids)
        policy = [i for i, forced in enumerate(mask) if not forced]
        if not policy:
            return []
        last = policy[-1]
        start = last  # the policy's text since the previous result
        while start > 0 and not mask[start - 1]:
            start -= 1
        calls = sum(1 for i in range(1, start + 1) if mask[i - 1] and (i == start or not mask[i]))
        if calls >= self.max_calls:
            return []
        segment = response_ids[start : last + 1]
        text = self.decode(segment)
        if CLOSE not in text or CLOSE in self.decode(segment[:-1]):
            return []
        result = self.encode(result_text(call_of(text) or ""))
        return result[len(response_ids) - 1 - last :]

    def forced_token(self, rollout: Rollout) -> int | None:
        if rollout.query.task not in self.tasks:
            return None
        owed = self.owed(rollout.response_ids, rollout.injected)
        return owed[0] if owed else None

    def respond(
        self, model: UnifiedModel, prompts: list[list[int]], decode: Callable[[list[int]], str],
        max_new_tokens: int, sampler: Sampler,
    ) -> list[str]:  # fmt: skip
        """Validation: generate in rounds; a round that writes a call is cut after it, the result appended,
        and the row generates again from there (the trained model, no engine)."""
        from zoo.models.generation import generate_text

        eos, room = model.vocab.eos_id, model.backbone.max_seq_len
        budgets = [min(max_new_tokens, room - len(p)) for p in prompts]
        responses: list[list[int]] = [[] for _ in prompts]
        injected: list[list[bool]] = [[] for _ in prompts]
        live = [i for i, b in enumerate(budgets) if b > 0]
        while live:
            left = max(budgets[i] - len(responses[i]) for i in live)
            outs = generate_text(
                model, [prompts[i] + responses[i] for i in live], left, sampler.temperature, sampler.top_k,
                sampler.top_p, generator=sampler.generator,
            )  # fmt: skip
            still = []
            for i, out in zip(live, outs, strict=True):
                for token in out:
                    if len(responses[i]) >= budgets[i]:
                        break
                    responses[i].append(token)
                    injected[i].append(False)
                    if token == eos:
                        break
                    owed = self.owed(responses[i], injected[i])[: budgets[i] - len(responses[i])]
                    if owed:
                        responses[i] += owed
                        injected[i] += [True] * len(owed)
                        if len(responses[i]) < budgets[i]:
                            still.append(i)
                        break
            live = still
        return [decode(r) for r in responses]
