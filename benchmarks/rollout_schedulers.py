"""Benchmark of the rollout schedulers (zoo/rl/schedulers.py) and of router replay (zoo/rl/rollout.py).

Schedulers: the real tiny policy (`create_model("tiny")`, random weights) generates with the
continuous-batching `InferenceEngine`, and every iteration syncs the engine to a new policy version, so
versions, re-prefills and lag are real. Two set-ups, each running all schedulers interleaved:
- colocated: one process trains a real AdamW step of the policy on the returned groups (policy-gradient
  surrogate with router replay, random rewards) while the engine waits;
- disaggregated (ERNIE's set-up, the headline keys): the trainer is elsewhere and takes as long as the
  measured AdamW step; meanwhile the engine keeps generating what is in flight (U-RB's pool; sync and
  APRIL have nothing in flight after a batch). `RolloutScheduler.overlap` does this.
Responses follow a forced long-tailed length distribution: the source gives every rollout a token budget
`round(exp(log(base) + 0.35 * difficulty + sigma * z))` (difficulty 1..5, z ~ N(0, 1), sigma 0.7,
base 8, capped at --max-len 192) and the engine never stops early (`stop_ids=()`), so a response's
length is its budget and harder queries are longer (as in REFERENCES.md 3.2). Every
scheduler runs on the same engine capacity (3 x B x G slots: U-RB N=3's pool) from the same weights
and data stream; U-RB is run with N=2 (the headline keys) and N=3.

Per scheduler: trained samples/s (wall clock, training included), engine idle fraction (1 - busy slot
time / wall), policy lag, off-policy token fraction, order error and bias: mean length and difficulty
of the trained samples over those of the data the iterations cover (the first iterations x B queries
of the stream, i.e. what a synchronous run trains on).

Router replay: mismatch KL (token-mean k3 of KL(pi_inf || pi_train) on sampled tokens) between a
bf16 / FP8-emulated engine and the float32 trainer, with and without replay, and how often the trainer
picks the recorded experts; on the random tiny model as is, and with its routed experts' output scaled
x8 (experts that matter, as after training).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rollout_schedulers.py [--plot docs/img]
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, log, machine_info  # noqa: E402

from zoo.registry import create_model  # noqa: E402
from zoo.rl.rollout import InferenceEngine, mismatch_kl, routing_agreement, sequence_logprobs  # noqa: E402
from zoo.rl.schedulers import (  # noqa: E402
    AprilScheduler,
    RolloutScheduler,
    SyncScheduler,
    URBScheduler,
)

try:
    from zoo.rl.verifiers import Query
except ImportError:  # R1's module not there yet

    @dataclass
    class Query:  # type: ignore[no-redef]
        id: str
        prompt: str
        answer: str
        solution: str
        task: str
        difficulty: int = 1


class LongTailSource:
    """A deterministic stream of queries; query k and its sample j always get the same prompt and budget."""

    def __init__(self, vocab, base: float, sigma: float, max_len: int, seed: int) -> None:
        self.vocab, self.base, self.sigma, self.max_len, self.seed = vocab, base, sigma, max_len, seed
        self.drawn = 0

    def query(self, k: int) -> Query:
        d = 1 + (k * 7919 + self.seed) % 5
        return Query(id=str(k), prompt="", answer="", solution="", task="longtail", difficulty=d)

    def next_queries(self, n: int) -> list[Query]:
        out = [self.query(k) for k in range(self.drawn, self.drawn + n)]
        self.drawn += n
        return out

    def encode_prompt(self, query: Query) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100003 + int(query.id))
        n = int(torch.randint(4, 11, (), generator=g))
        ids = torch.randint(self.vocab.text_offset, self.vocab.text_offset + 200, (n,), generator=g)
        return [self.vocab.bos_id, *ids.tolist()]

    def response_budget(self, query: Query, j: int) -> int:
        g = torch.Generator().manual_seed(self.seed * 7 + int(query.id) * 1009 + j)
        z = float(torch.randn((), generator=g))
        length = math.exp(math.log(self.base) + 0.35 * query.difficulty + self.sigma * z)
        return max(2, min(self.max_len, round(length)))


def train_step(model, optimizer, groups, generator: torch.Generator) -> None:
    """One AdamW step of a policy-gradient surrogate (random rewards) with router replay."""
    rollouts = [r for g in groups for r in g]
    rewards = torch.rand(len(rollouts), generator=generator).round()
    adv = rewards.view(len(groups), -1)
    adv = ((adv - adv.mean(1, keepdim=True)) / (adv.std(1, keepdim=True) + 1e-4)).flatten()
    logprobs = sequence_logprobs(model, rollouts, replay=True, grad=True)
    tokens = sum(len(lp) for lp in logprobs)
    loss = -sum(a * lp.sum() for a, lp in zip(adv.tolist(), logprobs, strict=True)) / tokens
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


class Run:
    """One scheduler's training run: its own policy copy, optimiser, engine and data stream."""

    def __init__(
        self, name: str, scheduler: RolloutScheduler, base_model, args, train_seconds: float | None
    ) -> None:
        self.name, self.scheduler, self.args, self.train_seconds = name, scheduler, args, train_seconds
        self.model = copy.deepcopy(base_model).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        capacity = args.capacity_groups * args.batch * args.group
        self.engine = InferenceEngine(
            self.model, max_new_tokens=args.max_len, stop_ids=(), max_batch=capacity, seed=args.seed
        )
        self.source = LongTailSource(self.model.vocab, args.base, args.sigma, args.max_len, args.seed)
        self.rewards = torch.Generator().manual_seed(args.seed)
        self.wall = self.train_s = 0.0

    def iteration(self, version: int) -> None:
        begin = time.perf_counter()
        args = self.args
        groups = self.scheduler.next_batch(self.engine, self.source, args.batch, args.group, version)
        start = time.perf_counter()
        if self.train_seconds is None:
            train_step(self.model, self.optimizer, groups, self.rewards)
        else:  # a disaggregated trainer busy for train_seconds; the engine may keep generating meanwhile
            generated = self.scheduler.overlap(self.engine, self.train_seconds)
            time.sleep(max(0.0, self.train_seconds - generated))
        self.engine.sync(self.model, version + 1)
        self.train_s += time.perf_counter() - start
        self.wall += time.perf_counter() - begin

    def result(self) -> dict[str, float]:
        args, source, stats = self.args, self.source, self.scheduler.statistics()
        # The data the iterations cover: the first iterations x B queries of the stream (what sync trains).
        data = [source.query(k) for k in range(args.iterations * args.batch)]
        budgets = [source.response_budget(q, j) for q in data for j in range(args.group)]
        data_len = sum(budgets) / len(budgets)
        data_diff = sum(q.difficulty for q in data) / len(data)
        busy_slot_s = stats["engine_busy_s"] * stats["slot_utilisation"]
        out = {
            "samples_per_s": stats["trained_samples"] / self.wall,
            "rollout_samples_per_s": stats["trained_samples"] / stats["wall_s"],
            "wall_s": self.wall,
            "train_and_sync_s": self.train_s,
            "engine_idle_frac": 1 - busy_slot_s / self.wall,
            "slot_utilisation": stats["slot_utilisation"],
            "engine_steps": float(self.engine.stats.steps),
            "policy_lag_mean": stats["policy_lag_mean"],
            "policy_lag_max": stats["policy_lag_max"],
            "offpolicy_token_frac": stats["offpolicy_token_frac"],
            "order_error_mean": stats["order_error_mean"],
            "length_bias": stats["mean_length_trained"] / data_len,
            "difficulty_bias": stats["mean_difficulty_trained"] / data_diff,
            "reprefills": float(self.engine.stats.reprefills),
        }
        log(f"{self.name}: " + ", ".join(f"{k} {v:.3f}" for k, v in out.items()))
        return {k: round(v, 4) for k, v in out.items()}


def run_interleaved(runs: list[Run], iterations: int) -> None:
    """Iteration t of every run, in an order rotated per iteration, so that the load of a shared machine
    hits all schedulers alike."""
    for version in range(iterations):
        order = runs[version % len(runs) :] + runs[: version % len(runs)]
        for run in order:
            run.iteration(version)
        log(f"iteration {version + 1}/{iterations}: " + ", ".join(f"{r.name} {r.wall:.1f}s" for r in runs))


def replay_kl(args) -> dict[str, float]:
    """Mismatch KL and routing agreement, bf16 / fp8 engine vs float32 trainer, with and without replay."""
    out = {}
    for scale in (1.0, 8.0):
        torch.manual_seed(args.seed)
        model = create_model("tiny").eval()
        with torch.no_grad():
            for block in model.backbone.layers:
                if block.is_moe:
                    block.ffn.experts.w2.mul_(scale)
        g = torch.Generator().manual_seed(args.seed)
        prompts = [
            [model.vocab.bos_id, *torch.randint(10, 300, (6,), generator=g).tolist()] for _ in range(16)
        ]
        for precision in ("bfloat16", "fp8"):
            engine = InferenceEngine(
                model, precision=precision, max_new_tokens=48, stop_ids=(), seed=args.seed
            )
            rollouts = engine.generate(prompts, [None] * len(prompts))
            inf = [r.inf_logprobs for r in rollouts]
            tag = f"{precision}_x{scale:g}"
            with torch.no_grad():
                for replay in (False, True):
                    train = sequence_logprobs(model, rollouts, replay=replay)
                    key = f"kl_{tag}_{'replay' if replay else 'no_replay'}"
                    out[key] = float(mismatch_kl(inf, train))
            out[f"routing_agreement_{tag}"] = routing_agreement(model, rollouts, replay=False)
            out[f"routing_agreement_{tag}_replay"] = routing_agreement(model, rollouts, replay=True)
            log(f"{tag}: " + ", ".join(f"{k} {v:.3g}" for k, v in out.items() if tag in k))
    return {k: float(f"{v:.4g}") for k, v in out.items()}


def plot(results: dict, directory: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    modes = results["schedulers"]
    names = list(modes["colocated"])
    fig, axes = plt.subplots(1, 3, figsize=(10, 3))
    panels = (
        ("samples_per_s", "trained samples / s"),
        ("policy_lag_mean", "mean policy lag (versions)"),
        ("length_bias", "length bias (trained / data)"),
    )
    for ax, (key, title) in zip(axes, panels, strict=True):
        for shift, mode in ((-0.2, "colocated"), (0.2, "disaggregated")):
            x = [i + shift for i in range(len(names))]
            ax.bar(x, [modes[mode][n][key] for n in names], 0.4, label=mode)
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_title(title, fontsize=9)
        if key == "length_bias":
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_ylim(0.8, 1.05)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(directory / "rl_rollout_schedulers.png", dpi=80)
    plt.close(fig)

    kl = results["replay"]
    fig, ax = plt.subplots(figsize=(6, 3))
    tags = ["bfloat16_x1", "fp8_x1", "bfloat16_x8", "fp8_x8"]
    x = range(len(tags))
    ax.bar([i - 0.2 for i in x], [kl[f"kl_{t}_no_replay"] for t in tags], 0.4, label="no replay")
    ax.bar([i + 0.2 for i in x], [kl[f"kl_{t}_replay"] for t in tags], 0.4, label="router replay")
    ax.set_xticks(list(x), ["bf16", "fp8", "bf16, experts x8", "fp8, experts x8"], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("mismatch KL (k3, per token)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(directory / "rl_rollout_mismatch_kl.png", dpi=80)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=4, help="B: queries per training step")
    parser.add_argument("--group", type=int, default=8, help="G: responses per query")
    parser.add_argument("--iterations", type=int, default=16)
    parser.add_argument(
        "--capacity-groups", type=int, default=3, help="engine slots = this x B x G (U-RB N=3's pool)"
    )
    parser.add_argument("--over-provision", type=float, default=2.0, help="APRIL over-provisioning")
    parser.add_argument("--base", type=float, default=8.0, help="length scale of the budget distribution")
    parser.add_argument("--sigma", type=float, default=0.7, help="log-normal spread of the budgets")
    parser.add_argument("--max-len", type=int, default=192)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument(
        "--train-seconds",
        type=float,
        default=None,
        help="cost of the disaggregated trainer's step (default: the measured colocated AdamW step)",
    )
    parser.add_argument("--plot", type=Path, default=None, help="write rl_rollout_*.png here")
    args = parser.parse_args()
    info = machine_info(args.threads)
    torch.manual_seed(args.seed)
    base_model = create_model("tiny")
    log("warm-up: one untimed synchronous iteration (first calls pay one-time allocation costs)")
    Run("warm-up", SyncScheduler(), base_model, args, None).iteration(0)
    results, train_cost = {}, args.train_seconds
    for mode in ("colocated", "disaggregated"):
        log(f"--- {mode}")
        cost = None if mode == "colocated" else train_cost
        schedulers: dict[str, RolloutScheduler] = {
            "sync": SyncScheduler(),
            "urb": URBScheduler(2),
            "urb_n3": URBScheduler(3),
            "april": AprilScheduler(args.over_provision),
        }
        runs = [Run(name, scheduler, base_model, args, cost) for name, scheduler in schedulers.items()]
        run_interleaved(runs, args.iterations)
        results[mode] = {run.name: run.result() for run in runs}
        if train_cost is None:  # the disaggregated trainer takes as long as the measured AdamW steps
            train_cost = results[mode]["sync"]["train_and_sync_s"] / args.iterations
    replay = replay_kl(args)

    def ratio(mode: str, name: str, key: str = "samples_per_s") -> float:
        return round(results[mode][name][key] / results[mode]["sync"][key], 3)

    main_run = results["disaggregated"]
    result = {
        "benchmark": "rollout_schedulers",
        "urb_speedup_vs_sync": ratio("disaggregated", "urb"),
        "urb_length_bias": main_run["urb"]["length_bias"],
        "urb_difficulty_bias": main_run["urb"]["difficulty_bias"],
        "april_speedup_vs_sync": ratio("disaggregated", "april"),
        "april_length_bias": main_run["april"]["length_bias"],
        "april_difficulty_bias": main_run["april"]["difficulty_bias"],
        "urb_n3_speedup_vs_sync": ratio("disaggregated", "urb_n3"),
        "urb_n3_length_bias": main_run["urb_n3"]["length_bias"],
        "urb_speedup_vs_sync_colocated": ratio("colocated", "urb"),
        "april_speedup_vs_sync_colocated": ratio("colocated", "april"),
        "urb_rollout_speedup_vs_sync": ratio("colocated", "urb", "rollout_samples_per_s"),
        "train_step_s": round(train_cost, 3),
        "kl_reduction_bf16_x8": round(
            replay["kl_bfloat16_x8_no_replay"] / replay["kl_bfloat16_x8_replay"], 2
        ),
        "schedulers": results,
        "replay": replay,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": info,
    }
    if args.plot is not None:
        plot(result, args.plot)
    emit(result)


if __name__ == "__main__":
    main()
