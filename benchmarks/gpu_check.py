"""The prepared GPU check (issue 17, item 9): one command, under 5 minutes on one GPU, one JSON line.

Training tokens/s, MFU and peak memory of UnifiedPretraining's model (`small` and `base`), one process, a
plain loop (forward, backward, AdamW step) on fixed random packed text rows, in these variants:

    bf16_sdpa_eager      bf16 autocast, SDPA with the dense group mask, no compile (the baseline)
    bf16_sdpa_compiled   + regional compile (Parallelism(compile=True))
    bf16_flex_compiled   + FlexAttention's BlockMask (Parallelism(attention="flex"))
    fp8_flex_compiled    + torchao float8 linears (Parallelism(fp8=True))
    fp8_experts_flex_compiled  + FP8 rowwise grouped GEMMs for the routed experts (fp8_experts=True;
                         SM90+ only: `--dry` skips it and says why, zoo/float8_experts.py)

and the MoE layer against a dense SwiGLU of equal active FLOPs (hidden = (top_k + shared) * expert_hidden),
forward + backward on the same tokens (`moe_over_dense_time`: the grouped-GEMM dispatch's cost over the
dense layer's). MFU counts 6 x active parameters + the attention matmuls (12 x layers x heads x head_dim x
seq) per token against the GPU's dense bf16 peak (the FP8 variant against bf16's too, so the two compare).

    python benchmarks/gpu_check.py            # CUDA: small and base, every variant
    python benchmarks/gpu_check.py --dry      # CPU, tiny sizes, seconds: every code path, no figure

`--dry` runs every code path on the CPU: compile with the "aot_eager" backend (inductor's C++ build takes
minutes there), and the FlexAttention variant forward-only (torch has no FlexAttention backward on the CPU).
The CUDA path was written without a GPU at hand (docs/benchmarks.md says when it last ran).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zoo.batch import IGNORE_INDEX, GroupBatch  # noqa: E402
from zoo.datamodules.sequence import SequenceBuilder, TextSegment  # noqa: E402
from zoo.float8_experts import fp8_experts_unavailable  # noqa: E402
from zoo.models.moe import MoEFeedForward, SwiGLU  # noqa: E402
from zoo.models.unified import UnifiedModel  # noqa: E402
from zoo.parallel import Parallelism, parallelize  # noqa: E402
from zoo.registry import create_model  # noqa: E402

# Dense bf16 tensor-core peaks (FLOP/s, no sparsity), by a substring of torch.cuda.get_device_name().
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}
DRY_SHAPE = dict(
    dim=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, expert_hidden=16, top_k=2, mtp_depth=0
)


@dataclass(frozen=True)
class Variant:
    name: str
    fp8: bool
    attention: str
    compile: bool
    fp8_experts: bool = False


VARIANTS = (
    Variant("bf16_sdpa_eager", False, "sdpa", False),
    Variant("bf16_sdpa_compiled", False, "sdpa", True),
    Variant("bf16_flex_compiled", False, "flex", True),
    Variant("fp8_flex_compiled", True, "flex", True),
    Variant("fp8_experts_flex_compiled", True, "flex", True, fp8_experts=True),
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def packed_rows(model: UnifiedModel, rows: int, seq: int, device: torch.device) -> GroupBatch:
    """Rows of SEQ packed with random text documents of SEQ/8 to SEQ/2 tokens (seeded)."""
    vocab = model.vocab
    g = torch.Generator().manual_seed(0)
    docs = []
    while len(docs) < rows * 4:
        n = int(torch.randint(seq // 8, seq // 2, (1,), generator=g))
        ids = torch.randint(0, vocab.text_size, (n,), generator=g) + vocab.text_offset
        docs.append([TextSegment(ids.tolist())])
    return SequenceBuilder(vocab, seq).collate(docs).to(device)


def flops_per_token(model: UnifiedModel, seq: int) -> float:
    b = model.backbone
    return 6 * model.num_parameters(active=True) + 12 * b.n_layers * b.n_heads * b.head_dim * seq


def train_variant(
    preset: str, variant: Variant, rows: int, seq: int, steps: int, device: torch.device, dry: bool
) -> dict[str, object]:
    torch.manual_seed(0)
    model = create_model(preset, **(DRY_SHAPE if dry else {}), max_seq_len=seq).to(device)
    # On the CPU FlexAttention has no backward: the dry run checks its forward path only.
    forward_only = dry and variant.attention == "flex"
    parallel = Parallelism(
        fp8=variant.fp8,
        fp8_experts=variant.fp8_experts,
        attention=variant.attention,
        compile=variant.compile,
        compile_backend="aot_eager" if dry else "inductor",
    )
    parallelize(model, parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    batch = packed_rows(model, rows, seq, device)
    tokens = int((batch.targets["text"] != IGNORE_INDEX).sum())

    def step() -> float:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            if forward_only:
                with torch.no_grad():
                    return float(model(batch).loss)
            loss = model(batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    start = time.perf_counter()
    step()  # compiles
    compile_s = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    result: dict[str, object] = {
        "tokens_per_s": round(tokens * steps / seconds, 1),
        "first_step_s": round(compile_s, 2),
        "loss": round(loss, 4),
    }
    if forward_only:
        result["forward_only"] = True
    if device.type == "cuda":
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        peak = next((v for k, v in PEAK_BF16.items() if k in torch.cuda.get_device_name()), None)
        if peak is not None:
            result["mfu"] = round(flops_per_token(model, seq) * tokens * steps / seconds / peak, 4)
    log(f"  {preset}/{variant.name}: {result}")
    return result


def moe_vs_dense(preset: str, tokens: int, steps: int, device: torch.device, dry: bool) -> dict[str, object]:
    """One MoE layer of the preset against a SwiGLU of its active width: forward + backward seconds."""
    b = create_model(preset, device="meta", **(DRY_SHAPE if dry else {})).backbone
    moe_layer = next(block.ffn for block in b.layers if block.is_moe)
    shared = moe_layer.n_shared_experts
    hidden = b.init_args["expert_hidden"]
    torch.manual_seed(0)
    moe = MoEFeedForward(
        dim=b.dim, n_experts=b.n_experts, expert_hidden=hidden, top_k=b.top_k, n_shared_experts=shared
    ).to(device)
    dense = SwiGLU(b.dim, (b.top_k + shared) * hidden).to(device)
    x = torch.randn(tokens, b.dim, device=device, requires_grad=True)

    def timed(run) -> float:  # noqa: ANN001
        for _ in range(2):  # warm-up
            run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / steps

    def run_moe() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = moe(x).out
        out.float().sum().backward()

    def run_dense() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = dense(x)
        out.float().sum().backward()

    moe_s, dense_s = timed(run_moe), timed(run_dense)
    ratio = round(moe_s / dense_s, 3)
    return {"moe_s": round(moe_s, 5), "dense_s": round(dense_s, 5), "moe_over_dense_time": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry", action="store_true", help="CPU, tiny sizes: every code path in seconds")
    parser.add_argument("--presets", nargs="+", default=["small", "base"])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant (after one untimed)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()
    if args.dry:
        device, rows, seq, steps, presets = torch.device("cpu"), 2, 64, 1, ["tiny"]
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_check needs a CUDA GPU; --dry runs its code paths on the CPU")
        device, rows, seq, steps = torch.device("cuda"), args.rows, args.seq, args.steps
        presets = args.presets
    wall = time.perf_counter()
    result: dict[str, object] = {"benchmark": "gpu_check", "dry": args.dry, "rows": rows, "seq_len": seq}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    result["torch"] = torch.__version__
    for preset in presets:
        log(f"{preset}: {rows} rows of {seq}, {steps} timed steps")
        for variant in VARIANTS:
            if variant.fp8_experts and args.dry:  # no CPU kernel: the dry run records why it skipped
                result[f"{preset}_{variant.name}_skipped"] = fp8_experts_unavailable("cpu")
                continue
            try:
                figures = train_variant(preset, variant, rows, seq, steps, device, args.dry)
            except Exception as err:  # one broken variant must not hide the others' figures
                if args.dry:
                    raise
                figures = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                log(f"  {preset}/{variant.name} failed: {figures['error']}")
            for key, value in figures.items():
                result[f"{preset}_{variant.name}_{key}"] = value
        moe = moe_vs_dense(preset, rows * seq, steps, device, args.dry)
        result.update({f"{preset}_{k}": v for k, v in moe.items()})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["wall_s"] = round(time.perf_counter() - wall, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
