"""The contract between the rollout engine and an environment that takes part in a response (tool use).

An `Environment` sees a rollout after each of its tokens and may owe it tokens of its own (a tool's result):
the engine then feeds those ids one a step in place of sampling, marks them `Rollout.injected` (no decision
of the policy: the loss mask leaves them out, their l_inf is a 0.0 placeholder) and samples again once the
debt is paid. The debt is computed from the rollout alone (no state in the environment), so a rollout
interrupted in the middle of a tool result resumes where it stopped. Validation, which generates with the
trained model rather than the engine, asks the environment to `respond` (the same tool calls, in rounds).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from zoo.models.sampling import Sampler
    from zoo.models.unified import UnifiedModel
    from zoo.rl.records import Rollout


class Environment(Protocol):
    def forced_token(self, rollout: Rollout) -> int | None:
        """The next id the environment owes the rollout (fed in place of a sample), or None."""
        ...

    def respond(
        self, model: UnifiedModel, prompts: list[list[int]], decode: Callable[[list[int]], str],
        max_new_tokens: int, sampler: Sampler,
    ) -> list[str]:  # fmt: skip
        """Validation: `model`'s completions of text prompts with the environment taking part."""
        ...
