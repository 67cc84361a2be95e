"""Benchmark of scaling out (zoo/parallel.py; ERNIE 5.0, "training infrastructure": FSDP sharding and FP8).

For the `tiny` and `small` presets, a few optimiser steps of UnifiedPretraining on fixed random text
batches in four variants, each in fresh processes so that peak memory is theirs alone:

    single     one process, one thread, under the allocator setting FSDP2Strategy gives its CPU ranks
               (zoo.host_memory; `--single-default-allocator`: glibc's defaults)
    fsdp       FSDP2 on two processes (gloo, one thread each): FSDP2Strategy + Parallelism(fsdp=True), the
               model built under `zoo.meta_init.deferred_init` (as `zoo fit` builds it with parallel.fsdp)
               and materialised shard by shard after `fully_shard`
    fsdp_fp8   the same with torchao float8 linears and float8 all-gathers
    fsdp_ep    FSDP2 + expert parallelism on two processes: Parallelism(fsdp=True, expert_parallel=2), each
               rank holding half of every MoE layer's routed experts, tokens sent to them by all-to-all

Reported per variant: training tokens/s (valid target tokens of every rank per second of optimiser
steps, after one untimed warm-up step), peak RSS per process (`ru_maxrss`; the largest over ranks) and
the parameter bytes each rank holds (local shards for DTensors); `rss_fsdp_over_single_<preset>` is the
fsdp rank's peak RSS over the single process's (issue 17's target for small: <= 0.65), and
`rss_fsdp_ep_over_single_<preset>` the same for fsdp_ep. Where the peak goes, on the rank that peaked:
`state_mb` (parameters, gradients and optimiser moments it holds; `grad_mb`, `optimizer_mb`), the process
before any model (`rss_before_model_mb`) and `rest_mb` (activations, gathered blocks, buffers, the data,
freed memory the allocator kept). For fsdp_ep also the all-to-all bytes one rank
sends to the other per optimiser step (dispatch and combine of every MoE layer, forward and backward; the
backward's reverse exchanges send as much as the forward's) and the routed experts' parameter bytes per
rank. Every rank gets the same batches (as in tests/test_parallel.py); tokens are counted per rank, so two
ranks process twice the tokens of one. Also the on-disk size of `save_pretrained` for the full tiny model
and for its extracted depth 0.5 / width 0.5 sub-model. Progress goes to stderr; the last stdout line is
one JSON object.

    .venv/bin/python benchmarks/scale.py [--steps 6 --presets tiny small --variants single fsdp fsdp_ep]
    .venv/bin/python benchmarks/scale.py --presets base --steps 3 --variants single fsdp   # ~24 GB machine

CPU float8 is emulated (casts and scaled matmuls in fp32 kernels), so fsdp_fp8 is expected to be slower
here; these CPU/gloo figures say nothing about GPU speed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, log, machine_info  # noqa: E402

from zoo.batch import IGNORE_INDEX  # noqa: E402
from zoo.datamodules.sequence import SequenceBuilder, TextSegment  # noqa: E402
from zoo.expert_parallel import exchanged_bytes  # noqa: E402
from zoo.host_memory import return_large_blocks_to_os  # noqa: E402
from zoo.hub import save_pretrained  # noqa: E402
from zoo.meta_init import deferred_init  # noqa: E402
from zoo.models.elastic import ElasticConfig  # noqa: E402
from zoo.models.moe import Experts  # noqa: E402
from zoo.parallel import FSDP2Strategy, Parallelism  # noqa: E402
from zoo.registry import create_model  # noqa: E402
from zoo.tasks.callbacks import ExpertBiasUpdate  # noqa: E402
from zoo.tasks.pretrain import UnifiedPretraining  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "single": (1, Parallelism()),
    "fsdp": (2, Parallelism(fsdp=True)),
    "fsdp_fp8": (2, Parallelism(fsdp=True, fp8=True, fp8_all_gather=True)),
    "fsdp_ep": (2, Parallelism(fsdp=True, expert_parallel=2)),
}


def current_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def make_batches(task: UnifiedPretraining, steps: int, batch: int, seq: int) -> list:
    """Fixed random text documents of SEQ/4 to SEQ/2 tokens, packed into rows of SEQ (seeded: every rank
    builds the same batches)."""
    vocab = task.model.vocab
    builder = SequenceBuilder(vocab, seq)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps):
        docs = []
        for _ in range(batch * 2):
            n = int(torch.randint(seq // 4, seq // 2, (1,), generator=g))
            ids = torch.randint(0, vocab.text_size, (n,), generator=g) + vocab.text_offset
            docs.append([TextSegment(ids.tolist())])
        batches.append(builder.collate(docs))
    return batches


class StepTimer(L.Callback):
    """Wall time and valid tokens of the steps after the first (the first pays for lazy initialisation)."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.end = 0.0
        self.tokens = 0
        self.steps = 0
        self.exchanged = 0  # forward all-to-all bytes this rank sent in the timed steps (expert parallelism)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        now = time.perf_counter()
        sent = exchanged_bytes(pl_module.model, reset=True)
        if self.start is None:
            self.start = now
            return
        self.end = now
        self.steps += 1
        self.tokens += int((batch.targets["text"] != IGNORE_INDEX).sum())
        self.exchanged += sent


def param_bytes(model: torch.nn.Module, experts_only: bool = False) -> int:
    """Bytes of the parameters this rank holds (local shards of DTensors); of the routed experts if asked."""
    params = model.parameters()
    if experts_only:
        params = (p for m in model.modules() if isinstance(m, Experts) for p in m.parameters())
    total = 0
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The training state this rank holds: parameters, gradients (one per trainable parameter, the size of
    its local shard; Lightning frees them after each step, so they are counted, not read) and the
    optimiser's moments (local shards of DTensors)."""

    def local_bytes(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    moments = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return {
        "param_bytes": sum(local_bytes(p) for p in model.parameters()),
        "grad_bytes": sum(local_bytes(p) for p in model.parameters() if p.requires_grad),
        "optimizer_bytes": sum(local_bytes(v) for v in moments if v.dim() > 0),  # not AdamW's step counts
    }


def worker(args: argparse.Namespace) -> None:
    """One variant of one preset; under FSDP Lightning re-runs this script for rank 1 with the same argv."""
    torch.set_num_threads(1)  # two processes on two cores: OpenMP threads would oversubscribe
    rss_before = current_rss_mb()
    devices, parallel = VARIANTS[args.variant]
    if devices == 1 and args.single_host_policy:
        # The allocator setting FSDP2Strategy gives its CPU ranks (zoo.host_memory), so that the ratio
        # compares the memory each holds, not two allocator policies.
        return_large_blocks_to_os(FSDP2Strategy().host_mmap_threshold_mb)
    torch.manual_seed(0)
    if parallel.fsdp:  # no rank builds the whole model: parallelize materialises its shards
        with deferred_init():
            model = create_model(args.preset)
    else:
        model = create_model(args.preset)
    task = UnifiedPretraining(model, lr=1e-3, warmup_steps=2, parallel=parallel)
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=FSDP2Strategy() if devices > 1 else "auto",
        max_epochs=1,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[timer, ExpertBiasUpdate()],
    )
    batches = make_batches(task, args.steps, args.batch, args.seq)
    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)
    trainer.fit(task, train_dataloaders=loader)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    state = state_bytes(task.model, trainer.optimizers[0])
    result = {
        "state_mb": sum(state.values()) / 2**20,
        "grad_mb": state["grad_bytes"] / 2**20,
        "optimizer_mb": state["optimizer_bytes"] / 2**20,
        "seconds": timer.end - timer.start,
        "tokens": timer.tokens,
        "timed_steps": timer.steps,
        "param_bytes": param_bytes(task.model),
        "expert_param_bytes": param_bytes(task.model, experts_only=True),
        # Forward and backward: each reverse exchange of the backward moves the forward's bytes back.
        "all_to_all_bytes_per_step": 2 * timer.exchanged // max(timer.steps, 1),
        "params": sum(p.numel() for p in task.model.parameters()),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_before_model_mb": rss_before,
        "loss_last": float(trainer.callback_metrics.get("loss", float("nan"))),
    }
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(result))


def run_variant(
    preset: str, variant: str, steps: int, batch: int, seq: int, tmp: str, single_host_policy: bool = True
) -> dict[str, float]:
    out = os.path.join(tmp, f"{preset}_{variant}.json")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("MASTER_PORT", None)
    command = [sys.executable, __file__, "--worker", "--variant", variant, "--preset", preset]
    command += ["--steps", str(steps), "--batch", str(batch), "--seq", str(seq), "--out", out]
    command += [] if single_host_policy else ["--single-default-allocator"]
    start = time.perf_counter()
    # 30 minutes: base builds and steps 918M parameters on one thread per process.
    proc = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{preset}/{variant} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(VARIANTS[variant][0])]
    seconds = max(r["seconds"] for r in ranks)
    tokens = sum(r["tokens"] for r in ranks)
    bytes_key = "param_bytes" if variant == "single" else "param_bytes_per_rank"
    result = {
        "tokens_per_s": round(tokens / seconds, 1),
        "step_s": round(seconds / ranks[0]["timed_steps"], 3),
        "peak_rss_mb": round(max(r["peak_rss_mb"] for r in ranks), 1),
        "rss_before_model_mb": round(max(r["rss_before_model_mb"] for r in ranks), 1),
        bytes_key: max(r["param_bytes"] for r in ranks),
        "loss_last": round(ranks[0]["loss_last"], 4),
    }
    # Where the peak goes, on the rank that peaked: the training state (parameters, gradients, optimiser
    # moments), the process before any model (interpreter, torch, Lightning) and the rest (activations,
    # FSDP2's gathered blocks and reduce buffers, the data, freed memory the allocator kept).
    top = max(ranks, key=lambda r: r["peak_rss_mb"])
    result["state_mb"] = round(top["state_mb"], 1)
    result["grad_mb"], result["optimizer_mb"] = round(top["grad_mb"], 1), round(top["optimizer_mb"], 1)
    result["rest_mb"] = round(top["peak_rss_mb"] - top["rss_before_model_mb"] - top["state_mb"], 1)
    if VARIANTS[variant][1].expert_parallel > 1:
        result["expert_param_bytes_per_rank"] = max(r["expert_param_bytes"] for r in ranks)
        result["all_to_all_bytes_per_step_per_rank"] = max(r["all_to_all_bytes_per_step"] for r in ranks)
    log(f"  {preset}/{variant}: {result} (process wall {time.perf_counter() - start:.1f}s)")
    return result


def checkpoint_sizes(tmp: str) -> dict[str, object]:
    model = create_model("tiny")
    b = model.backbone
    config = ElasticConfig.from_fractions(b.n_layers, b.n_experts, b.top_k, depth=0.5, width=0.5)
    full = save_pretrained(model, Path(tmp) / "full") / "model.safetensors"
    sub = model.extract(config)
    extracted = save_pretrained(sub, Path(tmp) / "extracted") / "model.safetensors"
    return {
        "ckpt_bytes_full": full.stat().st_size,
        "ckpt_bytes_extracted": extracted.stat().st_size,
        "ckpt_extracted_config": config.describe(b.n_layers, b.n_experts, b.top_k),
        "ckpt_params_full": model.num_parameters(),
        "ckpt_params_extracted": sub.num_parameters(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=6, help="optimiser steps per run (the first untimed)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--tiny-batch", type=int, default=8, help="tiny: documents per batch / 2")
    parser.add_argument("--tiny-seq", type=int, default=256)
    parser.add_argument("--small-batch", type=int, default=4, help="small: documents per batch / 2")
    parser.add_argument("--small-seq", type=int, default=128, help="small: row length (preset allows 2048)")
    # base (918M parameters): a single process holds ~15 GB of training state, so it is not in the defaults.
    parser.add_argument("--base-batch", type=int, default=4, help="base: documents per batch / 2")
    parser.add_argument("--base-seq", type=int, default=128, help="base: row length (preset allows 4096)")
    # Worker mode (internal): one variant in this process (and rank 1, which Lightning starts).
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--preset", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument(
        "--single-default-allocator",
        dest="single_host_policy",
        action="store_false",
        help="run the single process under glibc's default allocator policy, not the one FSDP2Strategy "
        "gives its CPU ranks (zoo.host_memory)",
    )
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    wall = time.perf_counter()
    info = machine_info(1)
    log(f"machine: {info}")
    result: dict[str, object] = {"benchmark": "scale", "steps": args.steps, "timed_steps": args.steps - 1}
    with tempfile.TemporaryDirectory(prefix="zoo-bench-scale-") as tmp:
        for preset in args.presets:
            batch, seq = getattr(args, f"{preset}_batch"), getattr(args, f"{preset}_seq")
            result[f"{preset}_batch_docs"], result[f"{preset}_seq_len"] = batch * 2, seq
            log(f"{preset}: {args.steps} steps, {batch * 2} documents packed into rows of {seq}")
            for variant in args.variants:
                measured = run_variant(preset, variant, args.steps, batch, seq, tmp, args.single_host_policy)
                for key, value in measured.items():
                    result[f"{preset}_{variant}_{key}"] = value
            for variant in ("fsdp", "fsdp_ep"):
                if "single" in args.variants and variant in args.variants:
                    ratio = result[f"{preset}_{variant}_peak_rss_mb"] / result[f"{preset}_single_peak_rss_mb"]
                    result[f"rss_{variant}_over_single_{preset}"] = round(ratio, 3)
        log("checkpoint sizes")
        result.update(checkpoint_sizes(tmp))
    result["note_fp8"] = (
        "FP8 on CPU is emulated (float8 casts plus scaled fp32 matmuls), so fsdp_fp8 is expected to be "
        "slower than fsdp here; its point is GPU tensor cores and half-size all-gathers."
    )
    result["note_ep"] = (
        "fsdp_ep: EP=2 over the 2 ranks, so each rank holds half of every layer's experts whole (FSDP2 "
        "shards them over the remaining expert_data_parallel=1) and the rest sharded over both; all-to-all "
        "bytes are those one rank sends to the other per step. On gloo/CPU the exchange is a copy through "
        "loopback TCP: tokens/s here says nothing about NVLink or InfiniBand."
    )
    result["note_tokens"] = (
        "tokens/s counts valid target tokens of every rank (all ranks see the same batches), over the "
        "steps after one warm-up step; peak_rss_mb is the largest ru_maxrss over ranks, including "
        "the interpreter, torch and lightning (rss_before_model_mb)."
    )
    result["note_memory"] = (
        "FSDP halves the parameter bytes each rank holds; the FSDP ranks build the model on meta "
        "(zoo.meta_init) and materialise only their shards, so the full fp32 model never exists in a rank. "
        "peak_rss_mb includes the ~0.7 GB interpreter baseline of every process."
    )
    if "small" in args.presets:
        result["note_small"] = (
            f"small runs at seq_len {args.small_seq} and {args.small_batch * 2} documents per batch (preset "
            "max 2048) so that a step fits a couple of seconds on one CPU thread."
        )
    result.update(info)
    result["wall_s"] = round(time.perf_counter() - wall, 1)
    emit(result)


if __name__ == "__main__":
    main()
