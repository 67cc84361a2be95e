"""The server's text engine: continuous batching of concurrent requests over one model (issue 16, item 4).

One thread owns the model. Each turn of its loop:
1. runs the queued jobs (`call`: media generation, prompts with media), one after another, whole;
2. admits waiting requests into the running batch while there are free slots: each is prefilled apart
   (`zoo.models.decode.prefill`), its first token sampled, and its cache joined to the batch's
   (`KVCache.join`): rows are right-aligned, so rows of any history decode together;
3. runs one `text_step` for every running row and samples each row's next token with its own `Sampler`
   (its own seeded generator: a request's tokens do not depend on who else is in the batch);
4. pushes every new token to its request's callback, and retires finished and aborted rows
   (`KVCache.select`).

This is the pattern of the RL engine (`zoo.rl.rollout.InferenceEngine`: `_admit`/`_decode`/`_retire`/
`_merge`) without what RL needs (log-probs, routing, weight syncs, versions). Callbacks run on the engine
thread: they must be quick and must not raise (the app hands each event to the event loop and returns).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import torch
from torch import Tensor

from zoo.batch import GroupBatch
from zoo.models.decode import Cursor, prefill, text_step
from zoo.models.kv_cache import KVCache
from zoo.models.sampling import Sampler
from zoo.models.unified import UnifiedModel

log = logging.getLogger(__name__)

_CACHE_HEADROOM = 32  # columns added at a time when decoding outgrows the cache
FinishReason = Literal["stop", "length", "abort", "error"]
T = TypeVar("T")


class QueueFull(RuntimeError):
    """The engine holds as many requests as it may (running and waiting): come back later."""


@dataclass(frozen=True)
class Token:
    """A request's next text id."""

    id: int


@dataclass(frozen=True)
class Finished:
    """A request's end. reason: "stop" (a stop id was sampled: not pushed as a Token), "length" (max_tokens
    reached), "abort" (`abort`), "error" (the engine failed on it: `error` says how)."""

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    error: str = ""


Event = Token | Finished


@dataclass
class Request:
    """One text generation. prompt: a one-row prompt batch (`Pipeline.prompt_batch`); max_tokens: most ids
    generated; stop_ids: ids that end it (not pushed); emit: receives every `Token`, then one `Finished`."""

    prompt: GroupBatch
    max_tokens: int
    emit: Callable[[Event], None]
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    id: int = -1


@dataclass
class _Row:
    """A running request: its sampler, the pending (sampled, not yet fed) token and where it goes."""

    request: Request
    sampler: Sampler
    pending: int = -1
    generated: int = 0
    next_t: int = 0
    next_group: int = 0
    finish: FinishReason | None = None


@dataclass
class EngineStats:
    """decode_steps: `text_step`s run (each over every running row); row_steps: rows summed over them;
    prefills: requests admitted; tokens: ids pushed; jobs: `call`s run."""

    decode_steps: int = 0
    row_steps: int = 0
    prefills: int = 0
    tokens: int = 0
    jobs: int = 0


@dataclass
class _Job:
    fn: Callable[[], object]
    future: Future = field(default_factory=Future)


class Engine:
    """Continuous-batching text generation on one model, in a thread of its own (module docstring).

    Args:
        model: the unified model (eval mode, on its device; `Pipeline.model`).
        max_batch: most requests decoded at once.
        max_queue: most requests waiting for a slot beyond those; past it `submit` raises QueueFull.
    """

    def __init__(self, model: UnifiedModel, max_batch: int = 8, max_queue: int = 64) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.model, self.max_batch, self.max_queue = model, max_batch, max_queue
        self.device = next(model.parameters()).device
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._waiting: list[Request] = []
        self._jobs: list[_Job] = []
        self._aborted: set[int] = set()
        self._rows: list[_Row] = []  # the running batch, in the cache's row order
        self._cache: KVCache | None = None
        self._joining: list[tuple[_Row, KVCache]] = []  # prefilled this turn, not yet in the batch
        self._admitted = 0  # running rows, as `submit` counts them (the engine thread owns `_rows`)
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- the caller's side (any thread) -------------------------------------------------------------------
    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="zoo-serve-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """End the loop; requests still in flight finish with reason "abort"."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def submit(self, request: Request) -> int:
        """Queue a request; returns its id. Raises QueueFull when `max_batch` run and `max_queue` wait."""
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
        context = self.model.backbone.max_seq_len
        if request.prompt.batch_size != 1 or request.prompt.seq_len + request.max_tokens > context:
            raise ValueError(
                f"a request is one prompt row of up to {context} positions with its max_tokens; got "
                f"{request.prompt.batch_size} row(s) of {request.prompt.seq_len} + {request.max_tokens}"
            )
        Sampler(request.temperature, request.top_k, request.top_p)  # refuses bad settings here, not later
        with self._lock:
            if self._admitted + len(self._waiting) >= self.max_batch + self.max_queue:
                raise QueueFull(
                    f"the server holds {self._admitted} running and {len(self._waiting)} waiting requests "
                    f"(max_batch {self.max_batch} + max_queue {self.max_queue})"
                )
            request.id = next(self._ids)
            self._waiting.append(request)
            self._lock.notify()
        return request.id

    def abort(self, request_id: int) -> None:
        """Stop a request (a client that went away): its slot is freed at the next step; no-op once done."""
        with self._lock:
            self._aborted.add(request_id)
            self._lock.notify()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the engine thread between decode steps (media generation, media prompts: the model
        is never used by two threads at once); its result or exception comes back in the future. Raises
        QueueFull past `max_queue` waiting jobs."""
        job = _Job(fn)
        with self._lock:
            if len(self._jobs) >= max(self.max_queue, 1):
                raise QueueFull(
                    f"the server holds {len(self._jobs)} media jobs waiting (max_queue {self.max_queue})"
                )
            self._jobs.append(job)
            self._lock.notify()
        return job.future

    @property
    def active(self) -> int:
        """Requests running or waiting."""
        with self._lock:
            return self._admitted + len(self._waiting)

    # -- the engine thread ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stopping or self._jobs or self._waiting or self._rows):
                    self._lock.wait()
                if self._stopping:
                    break
                jobs, self._jobs = self._jobs, []
                aborted, self._aborted = self._aborted, set()
                dropped = [r for r in self._waiting if r.id in aborted]
                self._waiting = [r for r in self._waiting if r.id not in aborted]
                free = self.max_batch - len(self._rows)
                admit, self._waiting = self._waiting[:free], self._waiting[free:]
                self._admitted = len(self._rows) + len(admit)
            for request in dropped:
                _send(request, Finished("abort", request.prompt.seq_len, 0))
            for job in jobs:
                self._run(job)
            try:
                with torch.no_grad():
                    self._step(admit, aborted)
            except Exception as error:  # a failed step must not kill the server: fail its requests
                log.exception("decode step failed")
                self._fail(error)
        self._shutdown()

    def _run(self, job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            with torch.no_grad():
                job.future.set_result(job.fn())
        except BaseException as error:  # the caller's job: its error is the caller's to handle
            job.future.set_exception(error)
        self.stats.jobs += 1

    def _step(self, admit: list[Request], aborted: set[int]) -> None:
        for row in self._rows:
            if row.request.id in aborted:
                row.finish = "abort"
        self._retire()
        self._joining = []
        for request in admit:
            if (prefilled := self._prefill(request)) is not None:
                self._joining.append(prefilled)
        if self._joining:
            self._merge([row for row, _ in self._joining], [cache for _, cache in self._joining])
        self._joining = []
        if self._rows:
            self._decode()
            self._retire()

    def _prefill(self, request: Request) -> tuple[_Row, KVCache] | None:
        """Feed a request's prompt into a cache of its own and sample its first id; None when it failed
        (its Finished "error" pushed: one bad request does not fail the batch)."""
        generator = None
        if request.seed is not None:
            generator = torch.Generator(self.device).manual_seed(request.seed)
        row = _Row(request, Sampler(request.temperature, request.top_k, request.top_p, generator))
        try:
            out, cursor, cache = prefill(self.model, request.prompt.to(self.device), extra=0)
        except Exception as error:
            log.exception("prefill of request %d failed", request.id)
            message = f"generation failed: {type(error).__name__}: {error}"
            self._count_out()
            _send(request, Finished("error", request.prompt.seq_len, 0, message))
            return None
        row.next_t, row.next_group = int(cursor.t[0]), int(cursor.group[0])
        self.stats.prefills += 1
        self._take(row, self.model.sampling_logits(out.hidden[:, -1]))
        return row, cache

    def _merge(self, rows: list[_Row], caches: list[KVCache]) -> None:
        """Join freshly prefilled rows (those still running) to the batch."""
        keep = [i for i, row in enumerate(rows) if row.finish is None]
        for row in rows:
            if row.finish is not None:  # a stop id first, or max_tokens 1: done before joining
                self._finished(row)
        if not keep:
            return
        parts = (
            [caches[i] for i in keep] if self._cache is None else [self._cache, *(caches[i] for i in keep)]
        )
        self._cache = KVCache.join(parts, headroom=_CACHE_HEADROOM)
        self._rows = self._rows + [rows[i] for i in keep]

    def _decode(self) -> None:
        rows, cache = self._rows, self._cache
        if cache.length + 1 > cache.max_len:
            cache.grow(_CACHE_HEADROOM)
        ids = torch.tensor([[row.pending] for row in rows], device=self.device)
        cursor = Cursor.at([r.next_t for r in rows], [r.next_group for r in rows], self.device)
        out, _ = text_step(self.model, cache, ids, cursor)
        logits = self.model.sampling_logits(out.hidden[:, -1])
        for row in rows:
            row.next_t, row.next_group = row.next_t + 1, row.next_group + 1
        for indices, tokens in self._sample(logits):
            for i, token in zip(indices, tokens, strict=True):
                self._push(rows[i], token)
        self.stats.decode_steps += 1
        self.stats.row_steps += len(rows)

    def _sample(self, logits: Tensor) -> list[tuple[list[int], list[int]]]:
        """Every running row's next id from its row of `[R, V]` logits, as (rows, ids) groups. A seeded
        row draws alone from its own generator (its tokens must not depend on the batch); rows with the
        same settings and no seed (greedy ones among them) draw together, from torch's global stream."""
        groups: dict[tuple, list[int]] = {}
        for i, row in enumerate(self._rows):
            sampler = row.sampler
            key = ("row", i) if sampler.generator is not None and not sampler.greedy else (
                "shared", sampler.temperature, sampler.top_k, sampler.top_p
            )  # fmt: skip
            groups.setdefault(key, []).append(i)
        drawn = []
        for indices in groups.values():
            sampler = self._rows[indices[0]].sampler
            index = torch.tensor(indices, device=logits.device)
            drawn.append((indices, sampler.sample(logits.index_select(0, index)).tolist()))
        return drawn

    def _take(self, row: _Row, logits: Tensor) -> None:
        """Sample a row's next id from its `[1, V]` logits with its own sampler, and push it."""
        self._push(row, int(row.sampler.sample(logits)[0]))

    def _push(self, row: _Row, token: int) -> None:
        request = row.request
        if token in request.stop_ids:
            row.finish = "stop"
            return
        row.pending, row.generated = token, row.generated + 1
        _send(request, Token(token))
        self.stats.tokens += 1
        if row.generated >= request.max_tokens:
            row.finish = "length"

    def _retire(self) -> None:
        """Rows that finished leave the batch (their Finished pushed); the cache keeps the others."""
        keep = []
        for i, row in enumerate(self._rows):
            if row.finish is None:
                keep.append(i)
            else:
                self._finished(row)
        if len(keep) < len(self._rows):
            self._rows = [self._rows[i] for i in keep]
            if keep:
                self._cache.select(keep)
            else:
                self._cache = None

    def _count_out(self) -> None:
        with self._lock:
            self._admitted -= 1

    def _finished(self, row: _Row) -> None:
        self._count_out()  # before the client hears of it: a next request then finds the slot free
        _send(row.request, Finished(row.finish, row.request.prompt.seq_len, row.generated))

    def _fail(self, error: Exception) -> None:
        """Every running request ends with reason "error"; the engine goes on with an empty batch."""
        message = f"generation failed: {type(error).__name__}: {error}"
        rows = self._rows + [row for row, _ in self._joining if row.finish is None]
        self._rows, self._cache, self._joining = [], None, []
        with self._lock:
            self._admitted = 0  # nothing runs now; requests admitted in this turn were all prefilled
        for row in rows:
            _send(row.request, Finished("error", row.request.prompt.seq_len, row.generated, message))

    def _shutdown(self) -> None:
        with self._lock:
            waiting, self._waiting = self._waiting, []
            jobs, self._jobs = self._jobs, []
        for row in self._rows:
            row.finish = "abort"
            self._finished(row)
        for request in waiting:
            _send(request, Finished("abort", request.prompt.seq_len, 0))
        for job in jobs:
            job.future.cancel()
        self._rows, self._cache, self._admitted = [], None, 0


def _send(request: Request, event: Event) -> None:
    """Push an event; a callback that fails (an event loop already closed) costs its request, not the
    engine."""
    try:
        request.emit(event)
    except Exception:
        log.exception("the callback of request %d failed on %s", request.id, type(event).__name__)
