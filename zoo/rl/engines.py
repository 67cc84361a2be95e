"""Where rollouts are generated: the engine protocol the schedulers drive, and the backend that builds it.

RL generates with an inference engine apart from the trained module (`zoo.rl.rollout.InferenceEngine`).
Everything that drives it (the schedulers, `RLTask`) goes through the `RolloutEngine` protocol below, so
the engine may be one in this process (`InProcessBackend`, the default) or a group of engine actors on a
Ray cluster (`zoo.rl.ray_backend.RayBackend`): the same calls, the same `Rollout` objects.

The one seam for new weights is `RolloutEngine.sync(model, version)`, called by `RLTask` after each
update (the scheduler decides what is in flight when it happens: nothing for sync and APRIL, the next data
groups for U-RB). In-process it copies the state dict into the engine's `PolicyCopy`; on Ray the state
dict is put in the object store once and every engine actor loads it.

A `RolloutBackend` is a typed, YAML-buildable component (`RLTask(rollout_backend=...)`): it builds the
engine from the trained model and the `EngineSettings`, and the verifier pool the scorer submits to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

from zoo.config import Configurable
from zoo.rl.policy import Precision

if TYPE_CHECKING:
    from zoo.models.unified import UnifiedModel
    from zoo.rl.envs.protocol import Environment
    from zoo.rl.prompts import Prompt
    from zoo.rl.records import Query, Rollout
    from zoo.rl.rollout import EngineStats, InferenceEngine
    from zoo.rl.verifiers import VerifierResult


@dataclass(frozen=True)
class EngineSettings:
    """The arguments of every `InferenceEngine` a backend builds (see `InferenceEngine`).

    `seed` is engine 0's sampling seed; engine i of a group samples with `seed + i`.
    """

    precision: Precision = "float32"
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    record_routing: bool = True
    stop_ids: tuple[int, ...] | None = None
    max_batch: int | None = None
    seed: int = 0
    max_audio_frames: int = 128
    video_frames: int | None = None  # frames of a video response (None: 1 + the tokenizer's temporal stride)
    # Takes part in text responses (the calculator of the tool-use stage); the Ray engines receive it with the
    # settings, so it must be picklable (the zoo's are plain objects over the tokenizer's encode and decode).
    environment: Environment | None = None

    def build(self, model: UnifiedModel, seed: int | None = None) -> InferenceEngine:
        """An engine on a private copy of `model` (seed: this engine's, default `self.seed`)."""
        from zoo.rl.rollout import InferenceEngine

        return InferenceEngine(
            model,
            precision=self.precision,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            record_routing=self.record_routing,
            stop_ids=self.stop_ids,
            max_batch=self.max_batch,
            seed=self.seed if seed is None else seed,
            max_audio_frames=self.max_audio_frames,
            environment=self.environment,
            video_frames=self.video_frames,
        )


class RolloutEngine(Protocol):
    """What schedulers and `RLTask` call on an engine (`InferenceEngine` and `RayEngineGroup` implement it).

    `start` returns the rollouts it queued; `step`, `interrupt` and `in_flight` return those same objects,
    filled in, so that a scheduler can track them by identity.
    """

    max_new_tokens: int
    version: int

    @property
    def max_batch(self) -> int | None: ...  # sequences decoded at once over all engines (None: no limit)

    @property
    def stats(self) -> EngineStats: ...

    @property
    def pending(self) -> int: ...

    def start(
        self,
        prompts: list[Prompt],
        queries: list[Query],
        max_new_tokens: list[int] | None = None,
        groups: list[int] | None = None,
    ) -> list[Rollout]: ...

    def resume(self, rollouts: list[Rollout]) -> None: ...

    def step(self, n_steps: int = 1) -> list[Rollout]: ...

    def interrupt(self) -> list[Rollout]: ...

    def in_flight(self) -> list[Rollout]: ...

    def generate(
        self, prompts: list[Prompt], queries: list[Query], max_new_tokens: list[int] | None = None
    ) -> list[Rollout]: ...

    def sync(self, model: UnifiedModel, version: int) -> None: ...

    def rng_state(self) -> Tensor: ...

    def load_rng_state(self, state: Tensor) -> None: ...

    def close(self) -> None: ...


class ScoringPool(Protocol):
    """What the scorer submits verifier calls to (`VerifierPool`, `RayVerifierPool`)."""

    counts: dict[str, int]

    def submit(self, fn: object, *args: object) -> int: ...

    def collect(
        self, tickets: list[int] | None = None, timeout: float | None = None
    ) -> dict[int, VerifierResult]: ...

    def close(self) -> None: ...


class RolloutBackend(Configurable):
    """Base of the backends: builds the engine and the verifier pool of an RL run."""

    def build_engine(self, model: UnifiedModel, settings: EngineSettings, version: int) -> RolloutEngine:
        raise NotImplementedError

    def verifier_pool(self, workers: int, timeout_s: float) -> ScoringPool:
        """The pool of `ScoringConfig.verifier_workers` workers (0: inline) with `verifier_timeout_s`."""
        from zoo.rl.verifiers import VerifierPool

        return VerifierPool(workers, timeout_s)

    def close(self) -> None:
        """Release what the backend holds beyond its engine and pool (a Ray cluster it started)."""


class InProcessBackend(RolloutBackend):
    """One `InferenceEngine` in the trainer's process and a `VerifierPool` of local worker processes
    (the default: what RL did before backends existed)."""

    def __init__(self) -> None:
        super().__init__()

    def build_engine(self, model: UnifiedModel, settings: EngineSettings, version: int) -> InferenceEngine:
        engine = settings.build(model)
        engine.version = version
        return engine
