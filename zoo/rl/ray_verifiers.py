"""The verifier pool as Ray actors: `RayVerifierPool`, the `VerifierPool` interface (`submit`, `collect`,
`map`, `score`, `close`, `counts`) over actors that may run on any node of a Ray cluster.

Each actor (`VerifierWorker`) runs one verifier call at a time (`zoo.rl.verifiers.run_verifier`: an
exception or a result that is not a finite number gives reward 0 and an error), so a call's deadline
starts when it is sent to an idle, started actor:
- a call that runs past `timeout_s` gets reward 0 and a timeout error; its actor is killed and replaced
  (an actor task cannot be interrupted otherwise);
- a call whose actor dies under it (killed, out of memory, its node lost) is sent again to the
  replacement, up to `retries` times, and then gets reward 0 with the error. Every ticket gets exactly one
  result: the result of a call whose actor died was never received, so no call is scored twice;
- an actor that does not start within `startup_s` is replaced, and its place's calls wait for the next.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from zoo.rl.verifiers import TicketPool, VerifierResult, run_verifier

try:
    import ray
    from ray.exceptions import RayActorError, RayError
except ImportError as err:  # the `ray` extra
    raise ImportError("zoo.rl.ray_verifiers needs Ray: pip install 'zoo[ray]' (ray>=2.60)") from err

logger = logging.getLogger(__name__)


class VerifierWorker:
    """A Ray actor that runs verifier calls (`fn` must be a module-level function: it travels by name)."""

    def ready(self) -> bool:
        return True

    def run(self, fn: Callable[..., object], args: tuple) -> tuple[float, str | None]:
        return run_verifier(fn, args)


_REMOTE_WORKER = ray.remote(VerifierWorker)


@dataclass
class _Job:
    ticket: int
    fn: Callable[..., object]
    args: tuple
    attempts: int = 0


@dataclass
class _Slot:
    actor: Any
    ready: Any  # the `ready` call's reference until the actor has started, then None
    created: float
    job: _Job | None = None
    ref: Any = None  # the running call's reference
    sent: float = 0.0


class RayVerifierPool(TicketPool):
    """Scores outputs in Ray actors, with a per-call timeout (see the module docstring).

    Args:
        actors: verifier actors (>= 1).
        timeout_s: longest a call may run; past that its actor is killed and replaced, and the call gets 0.
        num_cpus_per_actor: each actor's Ray CPUs (a fraction lets several share a core).
        threads_per_actor: OMP_NUM_THREADS in each actor's runtime env.
        retries: times a call is sent again after its actor died under it.
        startup_s: how long an actor may take to start (imports included) before it is replaced.
    """

    def __init__(
        self,
        actors: int = 2,
        timeout_s: float = 10.0,
        num_cpus_per_actor: float = 0.25,
        threads_per_actor: int = 1,
        retries: int = 1,
        startup_s: float = 120.0,
    ) -> None:
        if actors < 1:
            raise ValueError(f"actors must be >= 1, got {actors}")
        if timeout_s <= 0 or startup_s <= 0:
            raise ValueError(f"timeout_s and startup_s must be > 0, got {timeout_s} and {startup_s}")
        if retries < 0 or num_cpus_per_actor < 0:
            raise ValueError(
                f"retries and num_cpus_per_actor must be >= 0, got {retries}, {num_cpus_per_actor}"
            )
        self.n_actors, self.timeout_s, self.retries, self.startup_s = actors, timeout_s, retries, startup_s
        self._options = {
            "num_cpus": num_cpus_per_actor,
            "max_restarts": 0,  # the pool replaces a dead actor itself: it knows which call it held
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads_per_actor)}},
        }
        self._slots: list[_Slot] = []
        self._pending: deque[_Job] = deque()
        self._results: dict[int, VerifierResult] = {}
        self._submitted_at: dict[int, float] = {}
        self._next_ticket = 0
        self.counts = {"calls": 0, "errors": 0, "timeouts": 0, "garbage": 0, "restarts": 0, "resent": 0}

    @property
    def actors(self) -> list:
        """The actors' handles (started on the first `submit`)."""
        return [s.actor for s in self._slots]

    @property
    def busy_actors(self) -> list:
        """The handles of the actors running a call now."""
        return [s.actor for s in self._slots if s.job is not None]

    # -- submitting and collecting ---------------------------------------------------------------------
    def submit(self, fn: Callable[..., object], *args: object) -> int:
        """Queue `fn(*args)`; returns a ticket for `collect`. `fn` must be a module-level function."""
        ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
        self.counts["calls"] += 1
        self._submitted_at[ticket] = time.perf_counter()
        self._pending.append(_Job(ticket, fn, args))
        self._pump(0.0)
        return ticket

    def collect(
        self, tickets: Iterable[int] | None = None, timeout: float | None = None
    ) -> dict[int, VerifierResult]:
        self._pump(0.0)  # results that came back, deadlines and dead actors are seen even when none is wanted
        return super().collect(tickets, timeout)

    def close(self) -> None:
        """Stop the actors (a busy one is killed; its call gets no result)."""
        for slot in self._slots:
            ray.kill(slot.actor)
        self._slots = []

    # -- internals -----------------------------------------------------------------------------------
    def _finish(self, ticket: int, reward: float, error: str | None) -> None:
        elapsed = time.perf_counter() - self._submitted_at.get(ticket, time.perf_counter())
        if error is not None:
            for kind in ("timeout", "garbage"):
                if error.startswith(kind):
                    self.counts[f"{kind}s" if kind == "timeout" else kind] += 1
            self.counts["errors"] += 1
            logger.warning("verifier call %d failed, reward 0: %s", ticket, error)
        self._results[ticket] = VerifierResult(reward, error, elapsed)

    def _new_slot(self) -> _Slot:
        actor = _REMOTE_WORKER.options(**self._options).remote()
        return _Slot(actor, actor.ready.remote(), time.perf_counter())

    def _replace(self, i: int) -> None:
        ray.kill(self._slots[i].actor)
        self.counts["restarts"] += 1
        self._slots[i] = self._new_slot()

    def _lost(self, i: int, why: str) -> None:
        """Slot i's actor died under its call: send the call again (up to `retries`) or fail it."""
        job = self._slots[i].job
        logger.warning("verifier actor died (%s) running call %d: replaced", why, job.ticket)
        if job.attempts < self.retries:
            job.attempts += 1
            self.counts["resent"] += 1
            self._pending.appendleft(job)
        else:
            self._finish(job.ticket, 0.0, f"the verifier actor died running the call ({why})")
        self._replace(i)

    def _pump(self, wait_s: float) -> None:
        """Start actors, hand pending calls to idle ones, read results, cut calls past their deadline."""
        while len(self._slots) < self.n_actors:
            self._slots.append(self._new_slot())
        self._assign()
        waiting = [s.ref for s in self._slots if s.ref is not None] + [
            s.ready for s in self._slots if s.ready
        ]
        done = set()
        if waiting:  # wait for the first, then take every one that is done
            ray.wait(waiting, num_returns=1, timeout=wait_s)
            done = set(ray.wait(waiting, num_returns=len(waiting), timeout=0)[0])
        now = time.perf_counter()
        for i, slot in enumerate(self._slots):
            if slot.ready is not None:
                if slot.ready in done:
                    try:
                        ray.get(slot.ready)
                        slot.ready = None
                    except RayError as err:
                        logger.warning("verifier actor failed to start (%s): replaced", type(err).__name__)
                        self._replace(i)
                elif now - slot.created > self.startup_s:
                    logger.warning("verifier actor did not start within %s s: replaced", self.startup_s)
                    self._replace(i)
            elif slot.ref is not None and slot.ref in done:
                try:
                    reward, error = ray.get(slot.ref)
                except RayActorError as err:
                    self._lost(i, type(err).__name__)
                    continue
                except RayError as err:  # e.g. arguments that did not deserialize in the actor
                    reward, error = 0.0, f"raised {type(err).__name__} in the verifier actor: {err}"
                self._finish(slot.job.ticket, reward, error)
                slot.job, slot.ref = None, None
            elif slot.ref is not None and now - slot.sent > self.timeout_s:
                self._finish(
                    slot.job.ticket, 0.0, f"timeout: the verifier ran longer than {self.timeout_s} s"
                )
                self._replace(i)
        self._assign()

    def _assign(self) -> None:
        for slot in self._slots:
            if slot.ready is None and slot.job is None and self._pending:
                slot.job = self._pending.popleft()
                slot.ref, slot.sent = slot.actor.run.remote(slot.job.fn, slot.job.args), time.perf_counter()
