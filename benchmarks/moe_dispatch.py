"""Benchmark of the MoE dispatch (zoo/models/moe.py): training throughput against two baselines.

Forward + backward tokens/s of `MoEFeedForward` against
  (a) the per-expert loop most MoE code uses (HF Mixtral: one_hot mask, torch.where per expert,
      index_add_), with the same weights, and
  (b) a dense SwiGLU with the same active FLOPs (hidden = top_k * expert_hidden).
The three run interleaved, after a warm-up, and the median of the repeats is reported, so noise from a
shared machine hits all of them alike. Progress goes to stderr; the last stdout line is one JSON object.

    .venv/bin/python benchmarks/moe_dispatch.py [--tokens 4096 --experts 64 ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout without `pip install -e` works too
from zoo.models.moe import MoEFeedForward, SwiGLU  # noqa: E402


class LoopMoE(nn.Module):
    """The HF Mixtral sparse block (transformers' MixtralSparseMoeBlock), sharing our MoE's weights."""

    def __init__(self, moe: MoEFeedForward) -> None:
        super().__init__()
        self.top_k = moe.router.top_k
        self.gate = moe.router.gate
        self.experts = nn.ModuleList()
        for e in range(moe.router.n_experts):
            expert = SwiGLU(moe.dim, moe.expert_hidden)
            with torch.no_grad():  # ours stores [E, D, H] for x @ w; nn.Linear stores [H, D]
                expert.w1.weight.copy_(moe.experts.w1[e].t())
                expert.w3.weight.copy_(moe.experts.w3[e].t())
                expert.w2.weight.copy_(moe.experts.w2[e].t())
            self.experts.append(expert)

    def forward(self, x: Tensor) -> Tensor:
        routing_weights = F.softmax(self.gate(x), dim=1, dtype=torch.float)
        routing_weights, selected = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(x.dtype)
        out = torch.zeros_like(x)
        expert_mask = F.one_hot(selected, num_classes=len(self.experts)).permute(2, 1, 0)
        for e, expert in enumerate(self.experts):
            idx, top_x = torch.where(expert_mask[e])
            y = expert(x[top_x]) * routing_weights[top_x, idx, None]
            out.index_add_(0, top_x, y.to(x.dtype))
        return out


def train_step(module: nn.Module, forward: Callable[[], list[Tensor]], grads: list[Tensor]) -> float:
    for p in module.parameters():
        p.grad = None
    start = time.perf_counter()
    outputs = forward()
    torch.autograd.backward(outputs, grads)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--expert-hidden", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 keeps torch's default")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    moe = MoEFeedForward(args.dim, args.experts, args.expert_hidden, args.top_k)
    loop = LoopMoE(moe)
    dense = SwiGLU(args.dim, args.top_k * args.expert_hidden)
    x = torch.randn(args.tokens, args.dim, requires_grad=True)
    grad_out = torch.randn(args.tokens, args.dim)
    one = torch.ones(())

    def ours() -> list[Tensor]:
        o = moe(x)  # its backward includes the router's aux and z losses: a real training step pays them
        return [o.out, o.router.aux_loss + o.router.z_loss]

    cases: dict[str, tuple[nn.Module, Callable[[], list[Tensor]], list[Tensor]]] = {
        "ours": (moe, ours, [grad_out, one]),
        "loop": (loop, lambda: [loop(x)], [grad_out]),
        "dense": (dense, lambda: [dense(x)], [grad_out]),
    }
    with torch.no_grad():
        max_abs_diff = (moe(x).out - loop(x)).abs().max().item()
    print(f"ours vs loop max |diff| = {max_abs_diff:.2e}", file=sys.stderr)

    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(args.warmup + args.repeats):
        names = list(cases)
        names = names[i % len(names) :] + names[: i % len(names)]  # rotate who goes first
        for name in names:
            module, forward, grads = cases[name]
            elapsed = train_step(module, forward, grads)
            x.grad = None
            if i >= args.warmup:
                times[name].append(elapsed)
        if i >= args.warmup:
            done = i - args.warmup + 1
            line = " ".join(f"{n}={statistics.median(t) * 1e3:.1f}ms" for n, t in times.items())
            print(f"repeat {done}/{args.repeats}: median {line}", file=sys.stderr)

    tps = {name: args.tokens / statistics.median(t) for name, t in times.items()}
    result = {
        "benchmark": "moe_dispatch",
        "tokens_per_s": round(tps["ours"], 1),
        "loop_tokens_per_s": round(tps["loop"], 1),
        "dense_tokens_per_s": round(tps["dense"], 1),
        "speedup_vs_loop": round(tps["ours"] / tps["loop"], 3),
        "fraction_of_dense": round(tps["ours"] / tps["dense"], 3),
        "max_abs_diff_vs_loop": max_abs_diff,
        "tokens": args.tokens,
        "dim": args.dim,
        "experts": args.experts,
        "expert_hidden": args.expert_hidden,
        "top_k": args.top_k,
        "dense_hidden": args.top_k * args.expert_hidden,
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "warmup": args.warmup,
        "repeats": args.repeats,
        "torch": torch.__version__,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
