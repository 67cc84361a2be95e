"""Benchmark of RL rollouts on Ray (zoo/rl/ray_engines.py): rollout tokens/s of 1 and 2 engine actors
against the in-process engine, in the same run.

The tiny preset policy (`create_model("tiny")`, random weights) generates B queries x G samples a round
with the sync scheduler (every response runs to its budget: `stop_ids=()`, budgets drawn from a long
tail as in benchmarks/rollout_schedulers.py), and after every round the engine gets new weights (a real
push: `sync`, through the object store for Ray). The three set-ups are built first (actor start-up is not
timed) and then run round by round interleaved, so that the shared machine's load falls on all alike.
Tokens/s = response tokens generated / wall seconds of the rounds (pushes included); `push_s` is the mean
seconds of a Ray push (one `ray.put`, every engine loads it).

On a machine with C free cores, N engine actors can run N decode loops at once, where the in-process
engine has one; the trainer's process only waits. With 2 cores shared with other work (this project's
machine) two actors compete with each other and with Ray's own processes: read the figures with the
recorded load.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rl_ray.py [--rounds 4 --queries 8 --group 4]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, log, machine_info  # noqa: E402

from zoo.registry import create_model  # noqa: E402
from zoo.rl.engines import EngineSettings, InProcessBackend  # noqa: E402
from zoo.rl.records import Query  # noqa: E402
from zoo.rl.schedulers import SyncScheduler  # noqa: E402


class LongTail:
    """Query k, prompt of 3 ids; budget round(exp(log 8 + 0.35 d + 0.7 z)) capped, d = 1 + k % 5."""

    def __init__(self, cap: int, seed: int) -> None:
        self.drawn, self.cap = 0, cap
        self.generator = torch.Generator().manual_seed(seed)

    def next_queries(self, n: int) -> list[Query]:
        self.drawn += n
        return [Query(str(k), "", "0", "", "add", 1 + k % 5) for k in range(self.drawn - n, self.drawn)]

    def encode_prompt(self, query: Query) -> list[int]:
        return [1, 10 + int(query.id) % 50, 11]

    def response_budget(self, query: Query, j: int) -> int:
        z = float(torch.randn((), generator=self.generator))
        return max(1, min(self.cap, round(math.exp(math.log(8) + 0.35 * query.difficulty + 0.7 * z))))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--queries", type=int, default=8, help="B: queries a round")
    parser.add_argument("--group", type=int, default=4, help="G: samples a query")
    parser.add_argument("--max-len", type=int, default=96, help="cap of a response's budget")
    parser.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray cluster")
    parser.add_argument(
        "--cpus-per-engine", type=float, default=0.5, help="1 + 2 engines live at once"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    info = machine_info(1)

    import ray

    from zoo.rl.ray_backend import RayBackend

    torch.manual_seed(args.seed)
    model = create_model("tiny").eval()
    settings = EngineSettings(max_new_tokens=args.max_len, stop_ids=(), seed=args.seed)
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    begin = time.perf_counter()
    engines = {"inprocess": InProcessBackend().build_engine(model, settings, 0)}
    for n in (1, 2):
        backend = RayBackend(engines=n, num_cpus_per_engine=args.cpus_per_engine, verifier_actors=0)
        engines[f"ray{n}"] = backend.build_engine(model, settings, 0)
    log(f"engines built in {time.perf_counter() - begin:.1f} s")
    schedulers = {name: SyncScheduler() for name in engines}
    sources = {name: LongTail(args.max_len, args.seed) for name in engines}  # the same budgets for all
    wall = dict.fromkeys(engines, 0.0)
    pushes: dict[str, list[float]] = {name: [] for name in engines}
    for round_ in range(args.rounds):
        for name, engine in engines.items():
            begin = time.perf_counter()
            schedulers[name].next_batch(engine, sources[name], args.queries, args.group, round_)
            pushed = time.perf_counter()
            engine.sync(model, round_ + 1)
            pushes[name].append(time.perf_counter() - pushed)
            wall[name] += time.perf_counter() - begin
            log(f"round {round_} {name}: {engine.stats.tokens} tokens, {wall[name]:.1f} s")
    result: dict[str, object] = {"benchmark": "rl_ray"}
    for name, engine in engines.items():
        result[f"{name}_tokens_per_s"] = round(engine.stats.tokens / wall[name], 1)
        result[f"{name}_push_s"] = round(sum(pushes[name]) / len(pushes[name]), 4)
    tokens = {name: engine.stats.tokens for name, engine in engines.items()}
    if len(set(tokens.values())) != 1:
        raise RuntimeError(f"the set-ups generated different token counts {tokens}: not comparable")
    result["ray1_vs_inprocess"] = round(result["ray1_tokens_per_s"] / result["inprocess_tokens_per_s"], 3)
    result["ray2_vs_ray1"] = round(result["ray2_tokens_per_s"] / result["ray1_tokens_per_s"], 3)
    result["ray2_vs_inprocess"] = round(result["ray2_tokens_per_s"] / result["inprocess_tokens_per_s"], 3)
    result.update(tokens_per_setup=tokens["inprocess"], rounds=args.rounds, queries=args.queries,
                  group=args.group, cpus_per_engine=args.cpus_per_engine, **info)  # fmt: skip
    result["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    for engine in engines.values():
        engine.close()
    ray.shutdown()
    emit(result)


if __name__ == "__main__":
    main()
