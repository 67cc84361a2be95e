"""Rollout engines as Ray actors: `RayEngineGroup`, N `InferenceEngine`s in actor processes, driven by the
schedulers through the same `RolloutEngine` protocol as the in-process engine (`zoo.rl.engines`).

What runs where:
- each actor (`EngineWorker`) builds the policy from the trained model's config, loads the pushed state
  dict and runs one `InferenceEngine` (continuous batching, l_inf, router replay) with its own sampling
  seed (`EngineSettings.seed + i` for engine i);
- the group, in the trainer's process, routes new sequences to engines (all G rollouts of scheduler group
  g go to engine g mod N; a sequence without a group goes round-robin), steps every busy engine in
  lock-step (`step(n)` is one call per engine, issued to all before waiting for any) and keeps the
  scheduler's `Rollout` objects: what an actor returns is written into them, so the schedulers track
  them by identity as they do in-process.

Weights: `sync(model, version)` gathers the trained state dict, puts it in the object store once
(`ray.put`) and hands the same reference to every actor (never one copy per engine). The reference of the
latest push is kept: an engine that is recreated loads the current weights from it.

Failures: an actor that dies (or, with `call_timeout_s`, does not answer in time and is killed) is
recreated from the current weights and version, and the rollouts it held are queued on it again from the
trainer's copies: tokens it sampled since they were last handed back are lost and sampled again (the
trainer never saw them, so nothing is trained twice). After `max_restarts` recreations the group raises.

What crosses the wire is plain values and tensors: queries, documents and rollouts in their checkpoint
form (`zoo.rl.records`), weights as a state dict.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from zoo.config import to_config
from zoo.rl.engines import EngineSettings
from zoo.rl.policy import full_state_dict
from zoo.rl.prompts import is_document
from zoo.rl.records import Query, Rollout, document_from_state, document_state
from zoo.rl.rollout import EngineStats, GeneratesToEnd

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError
except ImportError as err:  # the `ray` extra
    raise ImportError("zoo.rl.ray_engines needs Ray: pip install 'zoo[ray]' (ray>=2.60)") from err

if TYPE_CHECKING:
    from zoo.models.unified import UnifiedModel
    from zoo.rl.prompts import Prompt

log = logging.getLogger(__name__)

Update = dict[str, Any]  # what an actor says about a rollout: its handle and the fields that changed


def rollout_update(handle: int, r: Rollout) -> Update:
    """The fields the engine fills in as it generates, as tensors and plain values."""
    return {
        "handle": handle,
        "response_ids": list(r.response_ids),
        "inf_logprobs": r.inf_logprobs.detach().cpu(),
        "routing": None if r.routing is None else {k: v.cpu() for k, v in r.routing.items()},
        "versions": list(r.versions),
        "finished": r.finished,
        "truncated": r.truncated,
    }


def apply_update(r: Rollout, update: Update) -> Rollout:
    r.response_ids, r.versions = update["response_ids"], update["versions"]
    r.inf_logprobs, r.routing = update["inf_logprobs"], update["routing"]
    r.finished, r.truncated = update["finished"], update["truncated"]
    return r


def _prompt_state(prompt: Prompt) -> dict:
    if is_document(prompt):
        return {"document": document_state(prompt)}
    return {"ids": list(prompt)}


def _prompt_from_state(state: dict) -> Prompt:
    return document_from_state(state["document"]) if "document" in state else state["ids"]


class EngineWorker:
    """One `InferenceEngine` in a Ray actor process (see the module docstring).

    Args:
        config: the policy's `to_config` (rebuilt with `zoo.hub.build_from_config`: zoo classes only).
        decodable_text_ids: the trained model's `decodable_text_ids` (what text ids may be sampled).
        weights: the pushed state dict (the group passes the object-store reference; Ray resolves it).
        version: the policy version of `weights`.
        settings: the engine's arguments; `seed` is this engine's seed.
        device: "cpu" or "cuda" (an actor given a GPU).
    """

    def __init__(
        self,
        config: dict,
        decodable_text_ids: int | None,
        weights: dict[str, Tensor],
        version: int,
        settings: EngineSettings,
        device: str = "cpu",
    ) -> None:
        from zoo.hub import build_from_config

        model = build_from_config(config)
        model.load_state_dict(weights, strict=True)
        model.decode_text_with(decodable_text_ids)
        self.engine = settings.build(model.to(device))
        self.engine.version = version
        self._handles: dict[int, int] = {}  # id(rollout in the engine) -> the group's handle

    def ready(self) -> bool:
        return True

    def report(self) -> dict:
        return {"pending": self.engine.pending, "stats": dataclasses.asdict(self.engine.stats)}

    def start(
        self,
        prompts: list[dict],
        index: list[int],
        queries: list[dict],
        budgets: list[int],
        groups: list[int],
        handles: list[int],
    ) -> tuple[list[Update], dict]:
        """Queue sequences: prompt `index[k]` of `prompts` for query k. Returns each one's laid-out prompt
        (documents: their codes) with its update."""
        distinct = [_prompt_from_state(p) for p in prompts]  # one object per distinct prompt: tokenized once
        rollouts = self.engine.start(
            [distinct[i] for i in index], [Query.from_state(q) for q in queries], budgets, groups
        )
        prepared = []
        for handle, r in zip(handles, rollouts, strict=True):
            self._handles[id(r)] = handle
            update = rollout_update(handle, r)
            update["prompt_ids"], update["prompt_document"] = (
                list(r.prompt_ids),
                document_state(r.prompt_document),
            )
            prepared.append(update)
        return prepared, self.report()

    def resume(self, states: list[dict], handles: list[int]) -> dict:
        rollouts = [Rollout.from_state(s) for s in states]
        for handle, r in zip(handles, rollouts, strict=True):
            self._handles[id(r)] = handle
        self.engine.resume(rollouts)
        return self.report()

    def step(self, n_steps: int) -> tuple[list[Update], dict]:
        return self._updates(self.engine.step(n_steps), release=True), self.report()

    def interrupt(self) -> tuple[list[Update], dict]:
        return self._updates(self.engine.interrupt(), release=True), self.report()

    def in_flight(self) -> tuple[list[Update], dict]:
        return self._updates(self.engine.in_flight(), release=False), self.report()

    def sync(self, weights: dict[str, Tensor], version: int) -> dict:
        self.engine.sync_weights(weights, version)
        return self.report()

    def rng_state(self) -> Tensor:
        return self.engine.rng_state()

    def load_rng_state(self, state: Tensor) -> None:
        self.engine.load_rng_state(state)

    def _updates(self, rollouts: list[Rollout], release: bool) -> list[Update]:
        handles = [self._handles.pop(id(r)) if release else self._handles[id(r)] for r in rollouts]
        return [rollout_update(h, r) for h, r in zip(handles, rollouts, strict=True)]


class RayEngineGroup(GeneratesToEnd):
    """N engine actors behind the `RolloutEngine` protocol (see the module docstring).

    Args:
        model: the trained policy (its config and current weights start the actors).
        settings: every engine's arguments (engine i samples with `settings.seed + i`).
        version: the policy version of `model`'s weights.
        engines: number of engine actors.
        num_cpus_per_engine, num_gpus_per_engine: each actor's Ray resources (fractions allowed); an actor
            with a GPU runs its engine on it.
        threads_per_engine: OMP_NUM_THREADS (torch's intra-op threads) in each actor's runtime env.
        max_restarts: engine actors the group may recreate over the run before it gives up.
        call_timeout_s: longest a call (a step, a push) may take before the actor is killed and recreated
            (None: wait for ever; a dead actor is noticed either way).
        startup_s: how long the actors may take to start (placed, imported, weights loaded) before the
            group gives up, naming the resources it asked for.
    """

    def __init__(
        self,
        model: UnifiedModel,
        settings: EngineSettings,
        version: int = 0,
        engines: int = 1,
        num_cpus_per_engine: float = 1.0,
        num_gpus_per_engine: float = 0.0,
        threads_per_engine: int = 1,
        max_restarts: int = 3,
        call_timeout_s: float | None = None,
        startup_s: float = 300.0,
    ) -> None:
        if engines < 1:
            raise ValueError(f"engines must be >= 1, got {engines}")
        if num_cpus_per_engine < 0 or num_gpus_per_engine < 0 or threads_per_engine < 1:
            raise ValueError(
                "num_cpus_per_engine and num_gpus_per_engine must be >= 0 and threads_per_engine >= 1, got "
                f"{num_cpus_per_engine}, {num_gpus_per_engine} and {threads_per_engine}"
            )
        self.settings, self.version, self.max_restarts = settings, version, max_restarts
        self.max_new_tokens, self.call_timeout_s = settings.max_new_tokens, call_timeout_s
        config = to_config(model)
        config["class_path"] = "zoo.models.unified.UnifiedModel"  # FSDP2 renames the class
        self._config, self._decodable = config, model.decodable_text_ids
        self._options = {
            "num_cpus": num_cpus_per_engine,
            "num_gpus": num_gpus_per_engine,
            "max_restarts": 0,  # the group recreates a dead engine itself: it knows the weights and rollouts
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads_per_engine)}},
        }
        self._device = "cuda" if num_gpus_per_engine > 0 else "cpu"
        self._weights = ray.put(_cpu_state(model))
        self.restarts = 0
        self._actors = [self._create(i) for i in range(engines)]
        try:  # construction errors surface here, by name
            ray.get([a.ready.remote() for a in self._actors], timeout=startup_s)
        except GetTimeoutError as err:
            self.close()
            raise RuntimeError(
                f"{engines} engine actors of {num_cpus_per_engine} CPUs and {num_gpus_per_engine} GPUs "
                f"did not start within {startup_s} s: does the cluster have those resources free "
                f"({ray.available_resources()} available)?"
            ) from err
        self._rollouts: dict[int, Rollout] = {}  # handle -> the scheduler's rollout, while in an engine
        self._where: dict[int, int] = {}  # handle -> engine index
        self._completed: list[Rollout] = []  # done without an engine (recovered ones), handed out by `step`
        self._next_handle = 0
        self._sequence = 0  # round-robin counter of sequences without a group
        self._pending = [0] * engines
        self._stats = [EngineStats() for _ in range(engines)]
        self._stats_before = [EngineStats() for _ in range(engines)]  # of the actors an engine replaced
        self._busy_s = 0.0

    # ------------------------------------------------------------------------------------------ the protocol

    @property
    def engines(self) -> int:
        return len(self._actors)

    @property
    def actors(self) -> list:
        """The engine actors' handles (engine i is `actors[i]`)."""
        return list(self._actors)

    @property
    def max_batch(self) -> int | None:
        return None if self.settings.max_batch is None else self.settings.max_batch * self.engines

    @property
    def pending(self) -> int:
        return sum(self._pending) + len(self._completed)

    @property
    def stats(self) -> EngineStats:
        """Summed over the engines (steps: the most any engine took, as they step together); busy_s: the
        trainer's seconds inside the group's calls (transfers included)."""
        total = [_add(a, b) for a, b in zip(self._stats, self._stats_before, strict=True)]
        return EngineStats(
            steps=max(s.steps for s in total),
            row_steps=sum(s.row_steps for s in total),
            busy_s=self._busy_s,
            prefill_tokens=sum(s.prefill_tokens for s in total),
            tokens=sum(s.tokens for s in total),
            reprefills=sum(s.reprefills for s in total),
        )

    def start(
        self,
        prompts: list[Prompt],
        queries: list[Query],
        max_new_tokens: list[int] | None = None,
        groups: list[int] | None = None,
    ) -> list[Rollout]:
        if len(prompts) != len(queries):
            raise ValueError(
                f"{len(prompts)} prompts but {len(queries)} queries: expected one query a prompt"
            )
        budgets = max_new_tokens or [self.max_new_tokens] * len(prompts)
        if len(budgets) != len(prompts):
            raise ValueError(f"max_new_tokens has {len(budgets)} entries for {len(prompts)} prompts")
        groups = [-1] * len(prompts) if groups is None else list(groups)
        for query in queries:
            if not isinstance(query, Query):
                raise TypeError(f"Ray engines take zoo.rl.records.Query queries, got {type(query).__name__}")
        handles = list(range(self._next_handle, self._next_handle + len(prompts)))
        self._next_handle += len(prompts)
        shares: list[list[int]] = [[] for _ in self._actors]
        for k, group in enumerate(groups):
            shares[self._engine_for(group)].append(k)
        arguments = {
            i: self._start_arguments(share, prompts, queries, budgets, groups, handles)
            for i, share in enumerate(shares)
            if share
        }
        results = self._gather({i: self._actors[i].start.remote(*a) for i, a in arguments.items()}, "start")
        # An engine that died while queuing its share was recreated: queue that share on the new actor.
        again = {i: self._actors[i].start.remote(*a) for i, a in arguments.items() if i not in results}
        results.update(self._gather(again, "start"))
        rollouts: list[Rollout | None] = [None] * len(prompts)
        for i, (prepared, report) in results.items():
            for k, update in zip(shares[i], prepared, strict=True):
                r = Rollout(queries[k], update["prompt_ids"], [], torch.zeros(0), None, [], False, False)
                r.max_new_tokens, r.group = budgets[k], groups[k]
                r.prompt_document = document_from_state(update["prompt_document"])
                rollouts[k] = apply_update(r, update)
                self._rollouts[handles[k]], self._where[handles[k]] = r, i
            self._note(i, report)
        missing = [k for k, r in enumerate(rollouts) if r is None]
        if missing:
            raise RuntimeError(f"sequences {missing[:5]} could not be queued: their engine failed twice")
        return rollouts

    def resume(self, rollouts: list[Rollout]) -> None:
        for r in rollouts:
            if r.done:
                raise ValueError("cannot resume a rollout that is already finished or truncated")
        by_engine: dict[int, list[tuple[int, Rollout]]] = {}
        for r in rollouts:
            handle, self._next_handle = self._next_handle, self._next_handle + 1
            i = self._engine_for(r.group)
            self._rollouts[handle], self._where[handle] = r, i
            by_engine.setdefault(i, []).append((handle, r))
        calls = {
            i: self._actors[i].resume.remote(*_resume_arguments(items)) for i, items in by_engine.items()
        }
        for i, report in self._gather(calls, "resume").items():
            self._note(i, report)

    def step(self, n_steps: int = 1) -> list[Rollout]:
        completed, self._completed = self._completed, []
        busy = {i: self._actors[i].step.remote(n_steps) for i in range(self.engines) if self._pending[i]}
        for i, (updates, report) in self._gather(busy, "step").items():
            completed += self._take(updates)
            self._note(i, report)
        return completed

    def interrupt(self) -> list[Rollout]:
        rollouts, self._completed = self._completed, []
        calls = {i: self._actors[i].interrupt.remote() for i in range(self.engines) if self._pending[i]}
        for i, (updates, report) in self._gather(calls, "interrupt", requeue=False).items():
            rollouts += self._take(updates)
            self._note(i, report)
        rollouts += [self._rollouts.pop(h) for h in sorted(self._rollouts)]  # held by engines that died
        self._where.clear()
        return rollouts

    def in_flight(self) -> list[Rollout]:
        calls = {i: self._actors[i].in_flight.remote() for i in range(self.engines) if self._pending[i]}
        listed = []
        for i, (updates, report) in self._gather(calls, "in_flight").items():
            listed += [apply_update(self._rollouts[u["handle"]], u) for u in updates]
            self._note(i, report)
        seen = {id(r) for r in listed}  # requeued after a death: as the trainer last knew them
        listed += [self._rollouts[h] for h in sorted(self._rollouts) if id(self._rollouts[h]) not in seen]
        return listed

    def sync(self, model: UnifiedModel, version: int) -> None:
        """Push `model`'s weights as policy `version`: one `ray.put`, the same reference to every engine."""
        self.sync_weights(_cpu_state(model), version)

    def sync_weights(self, state: dict[str, Tensor], version: int) -> None:
        self._weights, self.version = ray.put(state), version
        calls = {i: a.sync.remote(self._weights, version) for i, a in enumerate(self._actors)}
        for i, report in self._gather(calls, "sync").items():
            self._note(i, report)

    def rng_state(self) -> Tensor:
        """Every engine's sampling generator state, stacked `[engines, S]`."""
        return torch.stack(ray.get([a.rng_state.remote() for a in self._actors]))

    def load_rng_state(self, state: Tensor) -> None:
        if state.dim() == 1 and self.engines == 1:  # an in-process engine's checkpoint
            state = state[None]
        if state.dim() != 2 or state.shape[0] != self.engines:
            raise ValueError(
                f"the checkpoint holds the sampling state of {state.shape[0] if state.dim() == 2 else 1} "
                f"engines, this run has {self.engines}: set `engines` to match or start the engines afresh"
            )
        ray.get([a.load_rng_state.remote(s) for a, s in zip(self._actors, state, strict=True)])

    def close(self) -> None:
        for actor in self._actors:
            ray.kill(actor)
        self._actors = []

    # ------------------------------------------------------------------------------------------ internals

    def _create(self, i: int) -> Any:
        settings = dataclasses.replace(self.settings, seed=self.settings.seed + i)
        return _REMOTE_WORKER.options(**self._options).remote(
            self._config, self._decodable, self._weights, self.version, settings, self._device
        )

    def _engine_for(self, group: int) -> int:
        if group >= 0:
            return group % self.engines
        self._sequence += 1
        return (self._sequence - 1) % self.engines

    def _start_arguments(self, share, prompts, queries, budgets, groups, handles) -> tuple:  # noqa: ANN001
        distinct: dict[int, int] = {}  # id(prompt) -> its index among the distinct prompts sent
        states, index = [], []
        for k in share:
            if id(prompts[k]) not in distinct:
                distinct[id(prompts[k])] = len(states)
                states.append(_prompt_state(prompts[k]))
            index.append(distinct[id(prompts[k])])
        return (
            states, index, [queries[k].to_state() for k in share], [budgets[k] for k in share],
            [groups[k] for k in share], [handles[k] for k in share],
        )  # fmt: skip

    def _take(self, updates: list[Update]) -> list[Rollout]:
        """The scheduler's rollouts the engines handed back, updated, no longer in an engine."""
        taken = []
        for u in updates:
            self._where.pop(u["handle"])
            taken.append(apply_update(self._rollouts.pop(u["handle"]), u))
        return taken

    def _note(self, i: int, report: dict) -> None:
        self._pending[i], self._stats[i] = report["pending"], EngineStats(**report["stats"])

    def _gather(self, calls: dict[int, Any], what: str, requeue: bool = True) -> dict[int, Any]:
        """The results of one call per engine; an engine that died (or timed out) is recreated and left
        out of the results (`_recover`)."""
        begin, results = time.perf_counter(), {}
        for i, ref in calls.items():
            try:
                results[i] = ray.get(ref, timeout=self.call_timeout_s)
            except (RayActorError, GetTimeoutError) as err:
                self._recover(i, f"{what}: {type(err).__name__}", requeue)
        self._busy_s += time.perf_counter() - begin
        return results

    def _recover(self, i: int, why: str, requeue: bool) -> None:
        """Recreate engine i from the current weights and version; queue its rollouts on it again (or, with
        requeue=False, leave them in `_rollouts` for the caller to hand back)."""
        if self.restarts >= self.max_restarts:
            raise RuntimeError(
                f"engine actor {i} failed ({why}) and the group's {self.max_restarts} restarts are spent"
            )
        self.restarts += 1
        log.warning("engine actor %d failed (%s): recreated from policy version %d", i, why, self.version)
        ray.kill(self._actors[i])
        self._actors[i] = self._create(i)
        self._stats_before[i] = _add(self._stats_before[i], self._stats[i])
        self._stats[i], self._pending[i] = EngineStats(), 0
        held = sorted(h for h, e in self._where.items() if e == i)
        if not requeue:
            for h in held:
                self._where.pop(h)
            return
        # A rollout already decided (waiting only for its last routing forward) is complete as it stands,
        # as a restored checkpoint treats it (`RolloutScheduler.load_checkpoint_state`).
        done = [h for h in held if self._rollouts[h].done]
        for h in done:
            self._where.pop(h)
            self._completed.append(self._rollouts.pop(h))
        again = [(h, self._rollouts[h]) for h in held if h not in done]
        if again:
            self._note(i, ray.get(self._actors[i].resume.remote(*_resume_arguments(again))))
        else:
            ray.get(self._actors[i].ready.remote())


def _resume_arguments(items: list[tuple[int, Rollout]]) -> tuple[list[dict], list[int]]:
    return [r.to_state() for _, r in items], [h for h, _ in items]


def _cpu_state(model: torch.nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in full_state_dict(model).items()}


def _add(a: EngineStats, b: EngineStats) -> EngineStats:
    return EngineStats(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in dataclasses.fields(a)})


_REMOTE_WORKER = ray.remote(EngineWorker)
