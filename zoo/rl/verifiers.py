"""Verifiable rewards: queries, verifiers, and a pool of CPU worker processes that scores them (issue 5).

A verifier is a plain module-level function `fn(query, output) -> float` (a reward, 1.0 = correct),
where `output` is what the policy produced: a completion string for text tasks, a numpy image / video /
waveform for ShapesWorld generation (`zoo.world.render` / `zoo.world.speech`). Being a
module-level function, it pickles by reference and runs in a worker process.

`VerifierPool` runs verifiers in worker processes (forked from a clean forkserver by default: forking
the training process itself, which holds torch threads, is unsafe) so scoring overlaps generation, and
so that a verifier that raises, hangs past `timeout_s` or returns something that is not a finite number
costs reward 0, a logged error and (for a hang) a restarted worker, never the training run.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import numbers
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

from zoo.rl.envs.instructions import verify_instructions, verify_instructions_all
from zoo.rl.envs.tools import verify_tool_answer
from zoo.rl.records import Query

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ text verifiers

_INTEGER = re.compile(r"-?\d+")


def last_integer(text: str) -> str | None:
    """The last integer in `text` (the answer of a solution chain such as "12+7=19,19-3=16"), or None."""
    found = _INTEGER.findall(text)
    return found[-1] if found else None


def verify_integer(query: Query, output: str) -> float:
    """1.0 when the last integer of the completion equals the query's answer, else 0.0 (add, arith, count)."""
    value = last_integer(_text(output))
    return float(value is not None and int(value) == int(query.answer))


def verify_sorted(query: Query, output: str) -> float:
    """1.0 when the completion lists exactly the answer's numbers in order (whitespace-insensitive)."""
    return float(_INTEGER.findall(_text(output)) == query.answer.split())


def verify_shapes_caption(query: Query, output: str) -> float:
    """ShapesWorld caption reward: attribute accuracy (`zoo.world.scenes.CaptionScore`) of the
    completion against the scene the query's answer (the reference caption) describes; 1.0 iff exact."""
    scene = _scene_of(query)
    return verify_caption_score(_text(output), scene)


def verify_caption_score(text: str, scene: Any) -> float:
    from zoo.world.scenes import verify_caption

    return float(verify_caption(text, scene).attribute_accuracy)


def verify_shapes_image(query: Query, output: Any) -> float:
    """Generated image (uint8 HWC or float CHW) read back by `zoo.world.render.verify_image`."""
    from zoo.world.render import verify_image

    return float(verify_image(output, _scene_of(query)).attribute_accuracy)


def verify_shapes_video(query: Query, output: Any) -> float:
    """Generated frames (uint8 THWC or float `[3, T, H, W]`) read back by `zoo.world.render.verify_video`:
    attribute accuracy with each object's motion counted as an attribute."""
    from zoo.world.render import verify_video

    return float(verify_video(output, _scene_of(query)).attribute_accuracy)


def verify_shapes_speech(query: Query, output: Any) -> float:
    """Generated waveform (16 kHz float) read back by `zoo.world.speech.verify_speech`."""
    from zoo.world.speech import verify_speech

    return float(verify_speech(output, _scene_of(query)).attribute_accuracy)


def verify_shapes_speech_words(query: Query, output: Any) -> float:
    """Generated waveform: the share of the reference caption's words heard in place
    (`zoo.world.speech.word_accuracy` of what `read_speech` hears), a graded reward where a whole scene rarely
    parses; an empty waveform hears nothing."""
    from zoo.world.speech import read_speech, word_accuracy

    heard = read_speech(output) if len(output) else ""
    return word_accuracy(query.answer, heard)


def _text(output: object) -> str:
    if not isinstance(output, str):
        raise TypeError(f"a text verifier expects the completion as a str, got {type(output).__name__}")
    return output


def _scene_of(query: Query) -> Any:
    from zoo.world.scenes import Scene, parse_caption

    objects = parse_caption(query.answer)
    if objects is None:
        raise ValueError(f"query {query.id}: answer {query.answer!r} is not a ShapesWorld caption")
    return Scene(objects=objects, index=0, split="train")


VERIFIERS: dict[str, Callable[[Query, Any], float]] = {
    "add": verify_integer,
    "arith": verify_integer,
    "count": verify_integer,
    "sort": verify_sorted,
    "shapes_caption": verify_shapes_caption,
    # The same caption reward, named by the prompt's modality so that statistics keep them apart.
    "image_caption": verify_shapes_caption,
    "speech_caption": verify_shapes_caption,
    "video_caption": verify_shapes_caption,
    "caption_to_image": verify_shapes_image,
    "caption_to_video": verify_shapes_video,
    "caption_to_speech": verify_shapes_speech_words,
    "shapes_image": verify_shapes_image,
    "shapes_video": verify_shapes_video,
    "shapes_speech": verify_shapes_speech,
    # Environments (zoo.rl.envs): format constraints (share satisfied / all of them), a calculator tool.
    "instructions": verify_instructions,
    "instructions_all": verify_instructions_all,
    "tool_calc": verify_tool_answer,
}


def verifier_for(task: str) -> Callable[[Query, Any], float]:
    if task not in VERIFIERS:
        raise KeyError(f"no verifier for task {task!r}; known tasks: {sorted(VERIFIERS)}")
    return VERIFIERS[task]


# ------------------------------------------------------------------------------------------ the pool


@dataclass(frozen=True)
class VerifierResult:
    """reward: the verifier's number, or 0.0 on failure. error: why it failed (None when it did not)."""

    reward: float
    error: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


def as_reward(value: object) -> tuple[float, str | None]:
    """Accept a finite real number (bools and numpy scalars included); anything else is garbage."""
    if isinstance(value, numbers.Real):
        reward = float(value)
        if math.isfinite(reward):
            return reward, None
        return 0.0, f"garbage: non-finite reward {reward}"
    shown = repr(value)
    return 0.0, f"garbage: expected a finite number, got {type(value).__name__} {shown[:80]}"


def run_verifier(fn: Callable[..., object], args: tuple) -> tuple[float, str | None]:
    """Call a verifier; an exception or a garbage result becomes (0.0, error)."""
    try:
        return as_reward(fn(*args))
    except Exception as e:  # a verifier may raise anything; the run must go on
        return 0.0, f"raised {type(e).__name__}: {e}"


def _worker_main(conn: Connection) -> None:
    """Receive (ticket, fn, args), acknowledge (so the deadline starts after imports), run, send back."""
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        ticket, fn, args = job
        conn.send(("started", ticket))
        reward, error = run_verifier(fn, args)
        conn.send(("done", ticket, reward, error))


@dataclass
class _Worker:
    process: Any
    conn: Connection
    ticket: int | None = None  # the job it holds
    started: float | None = None  # when it acknowledged that job
    sent: float = 0.0


class TicketPool:
    """The ticket side of a verifier pool, shared by `VerifierPool` (worker processes) and
    `zoo.rl.ray_verifiers.RayVerifierPool` (Ray actors): `submit` hands out tickets, `_pump(wait_s)` moves
    calls along and files finished ones in `_results`; collecting, mapping and scoring are the same over both.
    """

    _submitted_at: dict[int, float]  # ticket -> when it was submitted, until collected
    _results: dict[int, VerifierResult]  # finished, not yet collected

    def submit(self, fn: Callable[..., object], *args: object) -> int:
        raise NotImplementedError

    def _pump(self, wait_s: float) -> None:
        raise NotImplementedError

    def collect(
        self, tickets: Iterable[int] | None = None, timeout: float | None = None
    ) -> dict[int, VerifierResult]:
        """Results of `tickets` (default: every submitted call not yet collected), waiting for them.

        Every ticket gets a result: a hang is cut by `timeout_s`, so this returns in bounded time.
        `timeout` (optional) bounds the wait itself; calls still running then are left for later.
        """
        wanted = list(self._submitted_at) if tickets is None else list(tickets)
        unknown = [t for t in wanted if t not in self._submitted_at and t not in self._results]
        if unknown:
            raise KeyError(f"unknown or already collected tickets: {unknown[:5]}")
        end = None if timeout is None else time.perf_counter() + timeout
        while any(t not in self._results for t in wanted):
            if end is not None and time.perf_counter() >= end:
                break
            self._pump(0.05)
        out = {}
        for t in wanted:
            if t in self._results:
                out[t] = self._results.pop(t)
                self._submitted_at.pop(t, None)
        return out

    def map(self, fn: Callable[..., object], calls: Sequence[tuple]) -> list[VerifierResult]:
        """Run `fn(*args)` for every tuple in `calls`; results in order."""
        tickets = [self.submit(fn, *args) for args in calls]
        results = self.collect(tickets)
        return [results[t] for t in tickets]

    def score(self, queries: Sequence[Query], outputs: Sequence[object]) -> list[VerifierResult]:
        """Each output scored by its query's task verifier (`VERIFIERS`)."""
        if len(queries) != len(outputs):
            raise ValueError(f"{len(queries)} queries but {len(outputs)} outputs")
        tickets = [self.submit(verifier_for(q.task), q, o) for q, o in zip(queries, outputs, strict=True)]
        results = self.collect(tickets)
        return [results[t] for t in tickets]

    def __enter__(self) -> TicketPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError


class VerifierPool(TicketPool):
    """Scores outputs in CPU worker processes, with a per-call timeout.

        pool = VerifierPool(workers=2, timeout_s=5.0)
        tickets = [pool.submit(verify_integer, query, text) for query, text in ...]
        results = pool.collect(tickets)        # {ticket: VerifierResult}, blocks until all are done
        pool.close()

    Args:
        workers: worker processes; 0 runs verifiers inline in `submit` (no timeout can interrupt a hang
            then: use it for trusted, fast verifiers and tests).
        timeout_s: longest a call may run (from the moment the worker starts it); past that the worker is
            killed and replaced, and the call gets reward 0.
        start_method: 'forkserver' (default: one server process imports this module once, and workers,
            restarts included, fork from it in milliseconds) or 'spawn' (each worker imports afresh);
            never plain 'fork' of the training process (torch threads and fork do not mix).
        startup_s: how long a fresh worker may take to import a verifier's module before its job fails.
    """

    def __init__(
        self,
        workers: int = 2,
        timeout_s: float = 10.0,
        start_method: Literal["spawn", "forkserver"] = "forkserver",
        startup_s: float = 120.0,
    ) -> None:
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
        self.workers, self.timeout_s, self.startup_s = workers, timeout_s, startup_s
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # Only takes effect if the server is not running yet; harmless otherwise.
            self._ctx.set_forkserver_preload([__name__])
        self._pool: list[_Worker] = []
        self._pending: deque[tuple[int, Callable[..., object], tuple]] = deque()
        self._results: dict[int, VerifierResult] = {}
        self._submitted_at: dict[int, float] = {}
        self._next_ticket = 0
        self.counts = {"calls": 0, "errors": 0, "timeouts": 0, "garbage": 0, "restarts": 0}

    # -- lifecycle -----------------------------------------------------------------------------------
    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=_worker_main, args=(child,), daemon=True, name="zoo-verifier")
        process.start()
        child.close()
        return _Worker(process, parent)

    def _ensure_workers(self) -> None:
        while len(self._pool) < self.workers:
            self._pool.append(self._spawn())

    def close(self) -> None:
        """Stop the workers (a busy one is killed)."""
        for worker in self._pool:
            try:
                if worker.ticket is None:
                    worker.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for worker in self._pool:
            worker.process.join(timeout=1.0)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=1.0)
            worker.conn.close()
        self._pool = []

    def __del__(self) -> None:
        if getattr(self, "_pool", None):
            self.close()

    # -- submitting and collecting ---------------------------------------------------------------------
    def submit(self, fn: Callable[..., object], *args: object) -> int:
        """Queue `fn(*args)`; returns a ticket for `collect`. `fn` must be a module-level function."""
        ticket = self._next_ticket
        self._next_ticket += 1
        self.counts["calls"] += 1
        self._submitted_at[ticket] = time.perf_counter()
        if self.workers == 0:
            reward, error = run_verifier(fn, args)
            self._finish(ticket, reward, error)
        else:
            self._pending.append((ticket, fn, args))
            self._pump(0.0)
        return ticket


    # -- internals -----------------------------------------------------------------------------------
    def _finish(self, ticket: int, reward: float, error: str | None) -> None:
        elapsed = time.perf_counter() - self._submitted_at.get(ticket, time.perf_counter())
        if error is not None:
            kind = (
                "timeouts"
                if error.startswith("timeout")
                else "garbage"
                if error.startswith("garbage")
                else None
            )
            if kind:
                self.counts[kind] += 1
            self.counts["errors"] += 1
            logger.warning("verifier call %d failed, reward 0: %s", ticket, error)
        self._results[ticket] = VerifierResult(reward, error, elapsed)

    def _replace(self, index: int, error: str) -> None:
        worker = self._pool[index]
        if worker.ticket is not None:
            self._finish(worker.ticket, 0.0, error)
        worker.process.kill()
        worker.process.join(timeout=5.0)
        worker.conn.close()
        self.counts["restarts"] += 1
        self._pool[index] = self._spawn()

    def _pump(self, wait_s: float) -> None:
        """Hand pending calls to idle workers, read what came back, and cut calls past their deadline."""
        self._ensure_workers()
        self._assign()
        busy = [w.conn for w in self._pool if w.ticket is not None]
        if busy:
            for conn in wait(busy, timeout=wait_s):
                worker = next(w for w in self._pool if w.conn is conn)
                try:
                    while worker.ticket is not None and conn.poll():
                        message = conn.recv()
                        if message[0] == "started":
                            worker.started = time.perf_counter()
                        elif message[0] == "done" and message[1] == worker.ticket:
                            _, ticket, reward, error = message
                            worker.ticket, worker.started = None, None
                            self._finish(ticket, reward, error)
                except (EOFError, OSError):
                    continue  # the process died: handled below
        now = time.perf_counter()
        for i, worker in enumerate(self._pool):
            if worker.ticket is None:
                if not worker.process.is_alive():
                    self._pool[i] = self._spawn()
                    self.counts["restarts"] += 1
                continue
            if not worker.process.is_alive():
                self._replace(i, f"worker died (exit code {worker.process.exitcode}) running the verifier")
            elif worker.started is not None and now - worker.started > self.timeout_s:
                self._replace(i, f"timeout: the verifier ran longer than {self.timeout_s} s")
            elif worker.started is None and now - worker.sent > self.startup_s + self.timeout_s:
                self._replace(i, f"timeout: the worker did not start the call within {self.startup_s} s")
        self._assign()

    def _assign(self) -> None:
        now = time.perf_counter()
        for worker in self._pool:
            while worker.ticket is None and self._pending and worker.process.is_alive():
                ticket, fn, args = self._pending.popleft()
                try:
                    worker.conn.send((ticket, fn, args))
                except Exception as e:  # e.g. arguments that do not pickle
                    self._finish(ticket, 0.0, f"raised {type(e).__name__} sending the call to a worker: {e}")
                    continue
                worker.ticket, worker.started, worker.sent = ticket, None, now
