"""Rollout schedulers: which finished rollouts are trained at each step (REFERENCES.md part B, section 3).

One interface, `RolloutScheduler.next_batch(engine, source, batch_size, group_size, version)`, returns
`batch_size` groups of `group_size` rollouts of one query each; swap the class in YAML.

- `SyncScheduler`: sample B queries x G responses, wait for the longest, train (TRL/verl default). No
  bias, no staleness; the engine idles while stragglers finish.
- `AprilScheduler` (APRIL, slime `--partial-rollout`): launch `over_provision` x B groups (recycled
  partial groups first), stop at B finished groups, abort the rest and keep their partial responses for
  the next round, where they continue under the new weights. Fast, but a step trains the groups that
  finished first: short (easy) ones, while long ones age in the buffer.
- `URBScheduler` (ERNIE 5.0 Unbiased Replay Buffer): the inference pool holds N data groups D_t..D_{t+N-1}
  (B x G x N rollouts), the data order fixes that only D_t is trained at iteration t; when its longest
  rollout ends it is trained, the others keep generating (re-prefilled under the new weights) and, once
  the engine is synced, D_{t+N} is admitted. The speed of N-way overlap without completion-order bias;
  the lag is at most N - 1 versions.

Every rollout carries the version of each of its tokens; `statistics()` reports trained samples, engine
time and slot utilisation, policy lag (current version - oldest token version), off-policy token
fraction, order error (iteration trained - iteration drawn) and the mean length / difficulty of trained
samples against all generated / drawn ones.

Checkpoints: `checkpoint_state(engine)` holds every rollout the scheduler tracks (finished ones waiting
for their data group, partial ones in the engine or in APRIL's buffer) with their tokens, l_inf, routing
and versions, plus the data-order counters, as tensors and plain values (a `weights_only` load reads
it). After `load_checkpoint_state` the partial rollouts that were in the engine are queued again at the
next `next_batch` and continue under the restored weights, as after a sync: a resumed U-RB run trains
the same data groups in the same order. The statistics restart from zero.

`on_complete`, when set (RLTask sets it), is called with each rollout as the engine finishes it, so
that its reward can be computed while the others are still generating.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Protocol

from torch import nn

from zoo.config import Configurable
from zoo.rl.engines import RolloutEngine
from zoo.rl.prompts import Prompt
from zoo.rl.records import Rollout


class QuerySource(Protocol):
    """What a scheduler needs from the data (zoo.rl.data implements it)."""

    def next_queries(self, n: int) -> list: ...  # list[Query]

    def encode_prompt(self, query: object) -> Prompt: ...  # unified ids, or a Document with media


class RolloutScheduler(Configurable, nn.Module):
    """Base: launching groups, collecting completions and the statistics every scheduler reports.

    A source may also define `response_budget(query, sample_index) -> int`, a per-rollout token budget
    (benchmarks force a length distribution with it).
    """

    def __init__(self) -> None:
        super().__init__()
        self.reset_statistics()
        self._groups: dict[int, list[Rollout]] = {}
        self._drawn_at: dict[int, int] = {}
        self._complete: set[int] = set()
        self._next_group = 0
        self.iteration = 0
        self._to_resume: list[Rollout] = []  # partial rollouts restored from a checkpoint
        self.on_complete: Callable[[Rollout], None] | None = None

    def next_batch(
        self, engine: RolloutEngine, source: QuerySource, batch_size: int, group_size: int, version: int
    ) -> list[list[Rollout]]:
        """`batch_size` groups of `group_size` finished rollouts of one query each, ready to train."""
        if batch_size < 1 or group_size < 1:
            raise ValueError(f"batch_size and group_size must be >= 1, got {batch_size} and {group_size}")
        begin, busy = time.perf_counter(), engine.stats.busy_s
        steps, rows = engine.stats.steps, engine.stats.row_steps
        if self._to_resume:
            engine.resume(self._to_resume)
            self._to_resume = []
        groups = self._collect(engine, source, batch_size, group_size)
        self._account(groups, version)
        self._wall += time.perf_counter() - begin
        self._busy += engine.stats.busy_s - busy
        self._steps += engine.stats.steps - steps
        self._row_steps += engine.stats.row_steps - rows
        self._capacity = max(self._capacity, engine.max_batch or 0)
        self.iteration += 1
        return groups

    def _collect(
        self, engine: RolloutEngine, source: QuerySource, batch_size: int, group_size: int
    ) -> list[list[Rollout]]:
        raise NotImplementedError

    def overlap(self, engine: RolloutEngine, seconds: float) -> float:
        """Keep generating what is in flight for `seconds` while a disaggregated trainer trains (the
        engine is not synced yet: these tokens carry the old version). Sync and APRIL have nothing in
        flight after `next_batch`; U-RB's pool keeps going. Returns the seconds spent generating."""
        begin = time.perf_counter()
        busy, steps, rows = engine.stats.busy_s, engine.stats.steps, engine.stats.row_steps
        while engine.pending and time.perf_counter() - begin < seconds:
            self._step(engine)
        self._busy += engine.stats.busy_s - busy
        self._steps += engine.stats.steps - steps
        self._row_steps += engine.stats.row_steps - rows
        return time.perf_counter() - begin

    # ------------------------------------------------------------------------------------------ helpers

    def _launch(
        self,
        engine: RolloutEngine,
        source: QuerySource,
        n: int,
        group_size: int,
        assigned: int | None = None,
    ) -> list[int]:
        """Draw n queries, start group_size rollouts of each; returns the new group indices.
        assigned: the iteration the data order gives them (default: this one)."""
        if n <= 0:
            return []
        queries = source.next_queries(n)
        if len(queries) != n:
            raise ValueError(f"source.next_queries({n}) returned {len(queries)} queries")
        budget = getattr(source, "response_budget", None)
        prompts, qs, budgets, gids, new = [], [], [], [], []
        for query in queries:
            gid, self._next_group = self._next_group, self._next_group + 1
            prompt = source.encode_prompt(query)
            for j in range(group_size):
                prompts.append(prompt)
                qs.append(query)
                budgets.append(engine.max_new_tokens if budget is None else int(budget(query, j)))
                gids.append(gid)
            self._drawn_at[gid] = self.iteration if assigned is None else assigned
            self._drawn_difficulty.append(float(getattr(query, "difficulty", 0)))
            new.append(gid)
        for rollout in engine.start(prompts, qs, budgets, gids):
            self._groups.setdefault(rollout.group, []).append(rollout)
        return new

    def _step(self, engine: RolloutEngine) -> None:
        if not engine.pending:
            raise RuntimeError("the engine has nothing left to generate but the scheduler still waits")
        for rollout in engine.step(1):
            self._mark(rollout)

    def _mark(self, rollout: Rollout) -> None:
        self._complete.add(id(rollout))
        self._generated_lengths.append(len(rollout.response_ids))
        if self.on_complete is not None:
            self.on_complete(rollout)

    def _ready(self, gid: int) -> bool:
        return all(id(r) in self._complete for r in self._groups[gid])

    def _take(self, gid: int) -> list[Rollout]:
        group = self._groups.pop(gid)
        for r in group:
            self._complete.discard(id(r))
        self._trained_order_error.append(self.iteration - self._drawn_at.pop(gid))
        return group

    # ------------------------------------------------------------------------------------------ checkpoints

    def checkpoint_state(self, engine: RolloutEngine | None) -> dict:
        """Everything needed to continue the data order after a restart (see the module docstring)."""
        # Engine order is kept: the restored rows are re-prefilled and sampled in the same order.
        queued = {id(r): i for i, r in enumerate(engine.in_flight())} if engine is not None else {}
        groups = {}
        for gid, group in self._groups.items():
            groups[gid] = [
                {**r.to_state(), "complete": id(r) in self._complete, "queued": queued.get(id(r), -1)}
                for r in group
            ]
        return {
            "kind": type(self).__name__,
            "groups": groups,
            "drawn_at": dict(self._drawn_at),
            "next_group": self._next_group,
            "iteration": self.iteration,
            **self._extra_state(),
        }

    def load_checkpoint_state(self, state: dict) -> None:
        if state["kind"] != type(self).__name__:
            raise ValueError(
                f"the checkpoint's scheduler is {state['kind']}, this run's is {type(self).__name__}: "
                "in-flight rollouts of one cannot continue in the other"
            )
        self._groups, self._complete = {}, set()
        queued: list[tuple[int, Rollout]] = []
        for gid, group in state["groups"].items():
            rollouts = []
            for item in group:
                r = Rollout.from_state(item)
                # Finished by the engine but not yet handed out (a `sync` completed it): done all the same
                if item["complete"] or r.done:
                    self._complete.add(id(r))
                elif item["queued"] >= 0:
                    queued.append((int(item["queued"]), r))
                rollouts.append(r)
            self._groups[int(gid)] = rollouts
        self._to_resume = [r for _, r in sorted(queued, key=lambda pair: pair[0])]
        self._drawn_at = {int(k): int(v) for k, v in state["drawn_at"].items()}
        self._next_group, self.iteration = int(state["next_group"]), int(state["iteration"])
        self._load_extra_state(state)

    def _extra_state(self) -> dict:
        return {}

    def _load_extra_state(self, state: dict) -> None:
        pass

    # ------------------------------------------------------------------------------------------ statistics

    def reset_statistics(self) -> None:
        self._wall = self._busy = 0.0
        self._steps = self._row_steps = self._capacity = 0
        self._lags: list[int] = []
        self._lengths: list[int] = []
        self._difficulties: list[float] = []
        self._tokens = self._offpolicy_tokens = 0
        self._generated_lengths: list[int] = []
        self._drawn_difficulty: list[float] = []
        self._trained_order_error: list[int] = []

    def _account(self, groups: list[list[Rollout]], version: int) -> None:
        for group in groups:
            for r in group:
                self._lags.append(version - r.min_version if r.versions else 0)
                self._lengths.append(len(r.response_ids))
                self._difficulties.append(float(getattr(r.query, "difficulty", 0)))
                self._tokens += len(r.versions)
                self._offpolicy_tokens += sum(v < version for v in r.versions)

    def statistics(self) -> dict[str, float]:
        """Cumulative since construction or `reset_statistics()`."""

        def mean(xs: list) -> float:
            return sum(xs) / len(xs) if xs else math.nan

        length, difficulty = mean(self._lengths), mean(self._difficulties)
        data_length, data_difficulty = mean(self._generated_lengths), mean(self._drawn_difficulty)
        capacity = self._capacity or (self._row_steps / self._steps if self._steps else 1)
        return {
            "trained_samples": float(len(self._lengths)),
            "trained_tokens": float(self._tokens),
            "wall_s": self._wall,
            "engine_busy_s": self._busy,
            "slot_utilisation": self._row_steps / (capacity * self._steps) if self._steps else math.nan,
            "policy_lag_mean": mean(self._lags),
            "policy_lag_max": float(max(self._lags, default=0)),
            "offpolicy_token_frac": self._offpolicy_tokens / self._tokens if self._tokens else math.nan,
            "order_error_mean": mean(self._trained_order_error),
            "mean_length_trained": length,
            "mean_length_generated": data_length,
            "length_bias": length / data_length if data_length else math.nan,
            "mean_difficulty_trained": difficulty,
            "mean_difficulty_drawn": data_difficulty,
            "difficulty_bias": difficulty / data_difficulty if data_difficulty else math.nan,
        }


class SyncScheduler(RolloutScheduler):
    """Generate B queries x G responses, wait for all of them, train on all of them."""

    def __init__(self) -> None:
        super().__init__()

    def _collect(
        self, engine: RolloutEngine, source: QuerySource, batch_size: int, group_size: int
    ) -> list[list[Rollout]]:
        if engine.pending:
            raise RuntimeError(f"SyncScheduler needs an idle engine; {engine.pending} sequences in flight")
        gids = self._launch(engine, source, batch_size, group_size)
        while not all(self._ready(g) for g in gids):
            self._step(engine)
        return [self._take(g) for g in gids]


class AprilScheduler(RolloutScheduler):
    """APRIL: over-provision, stop at the target count of finished groups, recycle the unfinished ones.

    Args:
        over_provision: groups in flight per round / batch_size (>= 1); recycled partial groups count.
    """

    def __init__(self, over_provision: float = 2.0) -> None:
        super().__init__()
        if over_provision < 1.0:
            raise ValueError(f"over_provision must be >= 1, got {over_provision}")
        self.over_provision = over_provision
        self._buffer: list[int] = []  # group ids carried over, oldest first
        self.recycled_groups = 0

    def _collect(
        self, engine: RolloutEngine, source: QuerySource, batch_size: int, group_size: int
    ) -> list[list[Rollout]]:
        if engine.pending:
            raise RuntimeError(f"AprilScheduler needs an idle engine; {engine.pending} sequences in flight")
        in_flight, self._buffer = self._buffer, []
        partial = [r for g in in_flight for r in self._groups[g] if id(r) not in self._complete]
        engine.resume(partial)
        target = math.ceil(batch_size * self.over_provision)
        in_flight += self._launch(engine, source, target - len(in_flight), group_size)
        ready: list[int] = []
        while True:
            ready += [g for g in in_flight if g not in ready and self._ready(g)]
            if len(ready) >= batch_size:
                break
            self._step(engine)
        # Abort the rest: partial responses keep their tokens, log-probs and versions for the next round.
        for rollout in engine.interrupt():
            if rollout.done:  # its last routing entry was all it still needed
                self._mark(rollout)
        trained = ready[:batch_size]
        self._buffer = ready[batch_size:] + [g for g in in_flight if g not in ready]
        self.recycled_groups += len(self._buffer)
        return [self._take(g) for g in trained]

    def _extra_state(self) -> dict:
        return {"buffer": list(self._buffer), "recycled_groups": self.recycled_groups}

    def _load_extra_state(self, state: dict) -> None:
        self._buffer = [int(g) for g in state["buffer"]]
        self.recycled_groups = int(state["recycled_groups"])


class URBScheduler(RolloutScheduler):
    """ERNIE's Unbiased Replay Buffer: N data groups generate together, only D_t is trained at step t.

    Args:
        n_groups: N, data groups in the inference pool (1 = synchronous).
    """

    def __init__(self, n_groups: int = 2) -> None:
        super().__init__()
        if n_groups < 1:
            raise ValueError(f"n_groups must be >= 1, got {n_groups}")
        self.n_groups = n_groups
        self._pool: list[list[int]] = []  # data groups D_t, D_t+1, ... as lists of group ids
        self._assigned = 0  # the iteration of the next data group to admit

    def _collect(
        self, engine: RolloutEngine, source: QuerySource, batch_size: int, group_size: int
    ) -> list[list[Rollout]]:
        while len(self._pool) < self.n_groups:
            self._admit(engine, source, batch_size, group_size)
        current = self._pool.pop(0)
        if len(current) != batch_size:
            raise ValueError(
                f"batch_size changed from {len(current)} to {batch_size} while data groups were in flight"
            )
        while not all(self._ready(g) for g in current):
            self._step(engine)  # D_t+1.. keep generating in the same steps
        # D_{t+N} joins at the next call, after the trainer has synced the engine: its first token is
        # sampled by policy t+1, so the lag of anything trained stays below N versions.
        return [self._take(g) for g in current]

    def _admit(self, engine: RolloutEngine, source: QuerySource, batch_size: int, group_size: int) -> None:
        self._pool.append(self._launch(engine, source, batch_size, group_size, assigned=self._assigned))
        self._assigned += 1

    def _extra_state(self) -> dict:
        return {"pool": [list(g) for g in self._pool], "assigned": self._assigned}

    def _load_extra_state(self, state: dict) -> None:
        self._pool = [[int(g) for g in data_group] for data_group in state["pool"]]
        self._assigned = int(state["assigned"])
