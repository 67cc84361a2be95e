"""AHRL: adaptive hints for RL (ERNIE 5.0 RL stage; REFERENCES.md Part B, 2.10).

A hard query gives a group of all-wrong answers, hence zero advantage and no learning signal. AHRL
puts the first p fraction of the query's reference solution on the prompt side, so the policy only has
to finish it, and withdraws the hint as training goes on, faster for queries the starting policy
already solved:

    p(x, t) = p_init * exp(-gamma * t * max(pass_init(x), pass_floor)) * exp(-global_decay * t)

pass_init(x) is measured once, with the starting policy, before any update. Without `pass_floor` (or
`global_decay`) a query the starting policy never solved (pass_init = 0) would keep its hint forever;
with them every hint decays. Below `min_ratio` the hint is dropped altogether. The hint tokens belong
to the prompt: they are conditioned on and never trained on (`Rollout.hint_len` counts them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class HintSchedule:
    """The AHRL schedule.

    Args:
        p_init: hint fraction at step 0, in [0, 1) (0 disables hints).
        gamma: decay rate per step and unit of pass rate.
        pass_floor: the pass rate assumed at least, so never-solved queries lose their hints too.
        global_decay: extra decay per step for every query (0 disables).
        min_ratio: fractions below this give no hint.
        unit: the hint is a prefix of the solution's "tokens" or "characters".
        pass_samples: samples per query when measuring pass_init.
    """

    p_init: float = 0.5
    gamma: float = 0.05
    pass_floor: float = 0.1
    global_decay: float = 0.0
    min_ratio: float = 0.02
    unit: Literal["tokens", "characters"] = "tokens"
    pass_samples: int = 4

    def __post_init__(self) -> None:
        if not 0.0 <= self.p_init < 1.0:
            raise ValueError(
                f"p_init must lie in [0, 1) (1 would give the whole solution away), got {self.p_init}"
            )
        for name in ("gamma", "pass_floor", "global_decay", "min_ratio"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.pass_floor == 0 and self.global_decay == 0 and self.p_init > 0:
            raise ValueError(
                "with pass_floor = 0 and global_decay = 0 a query never solved at the start keeps its hint "
                "forever: set pass_floor > 0 or global_decay > 0"
            )
        if self.unit not in ("tokens", "characters"):
            raise ValueError(f"unit must be 'tokens' or 'characters', got {self.unit!r}")
        if self.pass_samples < 1:
            raise ValueError(f"pass_samples must be >= 1, got {self.pass_samples}")

    @property
    def enabled(self) -> bool:
        return self.p_init > 0

    def ratio(self, step: int, pass_init: float) -> float:
        """p(x, t) as in the module docstring (0 below `min_ratio`)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if not 0.0 <= pass_init <= 1.0:
            raise ValueError(f"pass_init must lie in [0, 1], got {pass_init}")
        rate = self.gamma * max(pass_init, self.pass_floor) + self.global_decay
        p = self.p_init * math.exp(-rate * step)
        return p if p >= self.min_ratio else 0.0


def hint_prefix_length(length: int, ratio: float) -> int:
    """floor(ratio * length), the number of tokens (or characters) of a solution given away."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"hint ratio must lie in [0, 1), got {ratio}")
    return math.floor(ratio * length)


class HintController:
    """Per-query pass_init (measured once) and the hint each query gets at a step.

    Args:
        schedule: the AHRL schedule.
    """

    def __init__(self, schedule: HintSchedule) -> None:
        self.schedule = schedule
        self.pass_init: dict[str, float] = {}

    def unmeasured(self, query_ids: Sequence[str]) -> list[str]:
        """The queries whose pass_init is still unknown (in order, without repeats)."""
        return list(dict.fromkeys(q for q in query_ids if q not in self.pass_init))

    def set_pass_init(self, query_id: str, rate: float) -> None:
        """Record pass_init(x). It is measured once, with the starting policy: a second value is refused."""
        if query_id in self.pass_init:
            raise ValueError(f"pass_init of {query_id!r} was already measured ({self.pass_init[query_id]})")
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"pass rate of {query_id!r} must lie in [0, 1], got {rate}")
        self.pass_init[query_id] = float(rate)

    def ratio(self, query_id: str, step: int) -> float:
        """The hint fraction of a query at `step`; an unmeasured query counts as never solved."""
        if not self.schedule.enabled:
            return 0.0
        return self.schedule.ratio(step, self.pass_init.get(query_id, 0.0))

    def hint_ids(self, query_id: str, solution_ids: Sequence[int], step: int) -> list[int]:
        """The token prefix of the solution that goes on the prompt side (unit "tokens")."""
        return list(solution_ids[: hint_prefix_length(len(solution_ids), self.ratio(query_id, step))])

    def hint_text(self, query_id: str, solution: str, step: int) -> str:
        """The character prefix of the solution (unit "characters")."""
        return solution[: hint_prefix_length(len(solution), self.ratio(query_id, step))]

    def hint(self, query_id: str, solution: str, step: int, encode: Callable[[str], list[int]]) -> list[int]:
        """The hint as token ids in the schedule's unit (`encode` turns text into the same ids as prompts)."""
        if self.schedule.unit == "characters":
            text = self.hint_text(query_id, solution, step)
            return encode(text) if text else []
        return self.hint_ids(query_id, encode(solution), step)

    def state_dict(self) -> dict[str, dict[str, float]]:
        return {"pass_init": dict(self.pass_init)}

    def load_state_dict(self, state: dict[str, dict[str, float]]) -> None:
        self.pass_init = {str(k): float(v) for k, v in state["pass_init"].items()}
