"""Benchmark of the MoE dispatch (zoo/models/moe.py): training throughput against two baselines.

Forward + backward tokens/s of `MoEFeedForward` against
  (a) the per-expert loop most MoE code uses (HF Mixtral: one_hot mask, torch.where per expert,
      index_add_), with the same weights, and
  (b) a dense SwiGLU with the same active FLOPs (hidden = top_k * expert_hidden).
The three run interleaved, after a warm-up, and the median of the repeats is reported, so noise from a
shared machine hits all of them alike. Progress goes to stderr; the last stdout line is one JSON object.
Unlike the other benchmarks it keeps torch's default thread count (dense GEMMs use both cores, so the
dense ratio is the honest one); `--threads 1` is far less sensitive to other work on a shared machine.

    .venv/bin/python benchmarks/moe_dispatch.py [--tokens 4096 --experts 64 ...]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, log, machine_info, time_interleaved  # noqa: E402

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


def train_step(
    module: nn.Module, x: Tensor, forward: Callable[[], list[Tensor]], grads: list[Tensor]
) -> Callable[[], None]:
    """One forward + backward with fresh gradients (clearing them costs microseconds)."""

    def step() -> None:
        for p in module.parameters():
            p.grad = None
        x.grad = None
        torch.autograd.backward(forward(), grads)

    return step


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
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 keeps torch's default")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    machine = machine_info(args.threads if args.threads > 0 else torch.get_num_threads())
    torch.manual_seed(args.seed)

    moe = MoEFeedForward(args.dim, args.experts, args.expert_hidden, args.top_k)
    loop = LoopMoE(moe)
    dense = SwiGLU(args.dim, args.top_k * args.expert_hidden)
    x = torch.randn(args.tokens, args.dim, requires_grad=True)
    grad_out = torch.randn(args.tokens, args.dim)
    with torch.no_grad():
        max_abs_diff = (moe(x).out - loop(x)).abs().max().item()
    log(f"ours vs loop max |diff| = {max_abs_diff:.2e}; {machine}")

    def ours() -> list[Tensor]:
        o = moe(x)  # its backward includes the router's aux and z losses: a real training step pays them
        return [o.out, o.router.aux_loss + o.router.z_loss]

    variants = {
        "ours": train_step(moe, x, ours, [grad_out, torch.ones(())]),
        "loop": train_step(loop, x, lambda: [loop(x)], [grad_out]),
        "dense": train_step(dense, x, lambda: [dense(x)], [grad_out]),
    }
    seconds, _, spread = time_interleaved(variants, args.warmup, args.repeats)
    tps = {name: args.tokens / s for name, s in seconds.items()}
    log("median ms: " + ", ".join(f"{name} {s * 1e3:.1f}" for name, s in seconds.items()))
    emit(
        {
            "benchmark": "moe_dispatch",
            "tokens_per_s": round(tps["ours"], 1),
            "loop_tokens_per_s": round(tps["loop"], 1),
            "dense_tokens_per_s": round(tps["dense"], 1),
            "speedup_vs_loop": round(tps["ours"] / tps["loop"], 3),
            "fraction_of_dense": round(tps["ours"] / tps["dense"], 3),
            "max_abs_diff_vs_loop": max_abs_diff,
            "timing_spread": spread,
            "tokens": args.tokens,
            "dim": args.dim,
            "experts": args.experts,
            "expert_hidden": args.expert_hidden,
            "top_k": args.top_k,
            "dense_hidden": args.top_k * args.expert_hidden,
            "dtype": "float32",
            "warmup": args.warmup,
            "repeats": args.repeats,
            **machine,
        }
    )


if __name__ == "__main__":
    main()
