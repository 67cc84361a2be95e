"""Benchmark of text decoding (zoo/models/generation.py): the KV cache and MTP self-speculation.

1. Greedy generation of `--new-tokens` tokens with the preallocated KV cache against recomputing the
   whole sequence every step (`use_cache=False`, the reference the cache must match), at batch 1 and
   batch 8. `stop_ids=()` so every run generates exactly `--new-tokens` tokens. The greedy outputs of
   the two are compared token for token.
2. Batch-1 speculative self-decoding (the MTP module drafts one token, the backbone verifies it)
   against plain cached greedy decoding. Both stop at <eos> (speculative_generate always does), so
   a trained model generates as many tokens as its captions are long. With random weights the drafts
   are rarely accepted and the number only shows the cost of speculation that fails; give a trained
   `--checkpoint` (from `zoo fit --config configs/quickstart.yaml`, or `benchmarks/elastic.py
   --save-checkpoint`) for a meaningful speedup.

With `--compile`, part 1 also runs the static text step eagerly (`step="static"`) and through
`torch.compile` (`step="compiled"`, zoo/models/static_step.py), interleaved with the others, and reports
their tokens/s, their speedup over the dynamic cached step and whether their greedy outputs match it. The
compiled step is traced once per batch size before timing (its compile time is reported apart).

Variants run interleaved after a warm-up, and the median of the repeats is reported. Progress goes to
stderr; the last stdout line is one JSON object.

    .venv/bin/python benchmarks/decode.py [--new-tokens 256 --batch-sizes 1,8 --checkpoint last.ckpt]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, emit, load_checkpoint, log, machine_info, time_interleaved  # noqa: E402

from zoo.models.generation import speculative_generate  # noqa: E402
from zoo.models.unified import UnifiedModel  # noqa: E402
from zoo.registry import create_model  # noqa: E402

KV_CACHE_TARGET = 5.0
# Caption beginnings for speculative decoding with a trained ShapesWorld model (several, so the
# acceptance rate is not one greedy path's).
CAPTION_PREFIXES = (
    "", "a small", "a large red", "a small blue circle at the", "a green", "a large white cross in"
)  # fmt: skip


def first_difference(a: list[list[int]], b: list[list[int]]) -> int | None:
    """The first step at which any row differs, None when all rows are equal."""
    for row_a, row_b in zip(a, b, strict=True):
        for i, (x, y) in enumerate(zip(row_a, row_b, strict=False)):
            if x != y:
                return i
        if len(row_a) != len(row_b):
            return min(len(row_a), len(row_b))
    return None


def speculative_prompts(model: UnifiedModel, raw: dict | None, fallback: list[int]) -> list[list[int]]:
    """`<bos>` + caption prefixes when the checkpoint carries the datamodule's tokenizer, else `fallback`."""
    from zoo.tokenizers.text import TextTokenizer

    state = next((v for v in (raw or {}).values() if isinstance(v, dict) and "tokenizer" in v), None)
    if state is None:
        return [fallback]
    tokenizer = TextTokenizer.from_json(state["tokenizer"])
    vocab = model.vocab
    return [[vocab.bos_id, *vocab.text_to_unified(tokenizer.encode(p)).tolist()] for p in CAPTION_PREFIXES]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="tiny", help="model preset when no --checkpoint is given")
    parser.add_argument("--checkpoint", default=None, help="a Lightning .ckpt of UnifiedPretraining")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--batch-sizes", default="1,8", help="comma-separated; the first is the headline")
    parser.add_argument("--prompt", default="1,20,21,22", help="unified ids of the prompt (all rows)")
    parser.add_argument("--no-speculative", action="store_true", help="skip the speculative-decoding part")
    parser.add_argument(
        "--compile", action="store_true", help="also time the static and the compiled text step (part 1)"
    )
    add_common_args(parser, repeats=3)
    args = parser.parse_args()

    wall = time.perf_counter()
    info = machine_info(args.threads)
    log(f"machine: {info}")
    torch.manual_seed(args.seed)
    raw = None
    if args.checkpoint:
        model, raw, how = load_checkpoint(args.checkpoint)
        weights = f"trained ({raw.get('global_step', '?')} steps)"
        log(f"loaded {args.checkpoint} with {how}")
    else:
        model, how = create_model(args.preset).eval(), None
        weights = "random"
    prompt = [int(t) for t in args.prompt.split(",")]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    n = args.new_tokens
    log(f"model: {args.checkpoint or args.preset}, {model.num_parameters():,} parameters, weights {weights}")

    # -- 1. KV cache against recomputation ------------------------------------------------------------
    def decoder(batch: int, use_cache: bool, new_tokens: int, step: str = "dynamic"):
        prompts = [prompt] * batch
        return lambda: model.generate(
            prompts, new_tokens, temperature=0, stop_ids=(), use_cache=use_cache, step=step
        )

    variants = {}
    for b in batch_sizes:
        variants[f"cache_b{b}"] = decoder(b, True, n)
        variants[f"recompute_b{b}"] = decoder(b, False, n)
        if args.compile:
            variants[f"static_b{b}"] = decoder(b, True, n, "static")
            variants[f"compiled_b{b}"] = decoder(b, True, n, "compiled")
    compile_s = {}
    if args.compile:
        # A trace per (rows, cache width): warm up at the timed width, so no round compiles.
        for b in batch_sizes:
            start = time.perf_counter()
            decoder(b, True, n, "compiled")()
            compile_s[b] = round(time.perf_counter() - start, 1)
            log(f"compiled step, batch {b}: first run (trace and compile) {compile_s[b]} s")
    log(f"warm-up (16 tokens each), then {args.repeats} interleaved rounds of {n} tokens")
    for _ in range(args.warmup):
        for b in batch_sizes:
            decoder(b, True, 16)()
            decoder(b, False, 16)()
    seconds, outputs, spread = time_interleaved(variants, warmup=0, repeats=args.repeats)

    result: dict[str, object] = {
        "benchmark": "decode",
        "model": args.checkpoint or args.preset,
        "weights": weights,
        "new_tokens": n,
        "prompt_len": len(prompt),
    }
    all_match = True
    for i, b in enumerate(batch_sizes):
        suffix = "" if i == 0 and b == 1 else f"_b{b}"
        cached, recomputed = seconds[f"cache_b{b}"], seconds[f"recompute_b{b}"]
        result[f"tokens_per_s_cache_b{b}"] = round(b * n / cached, 1)
        result[f"tokens_per_s_recompute_b{b}"] = round(b * n / recomputed, 1)
        result[f"kv_cache_speedup{suffix}"] = round(recomputed / cached, 2)
        diff = first_difference(outputs[f"cache_b{b}"], outputs[f"recompute_b{b}"])
        all_match &= diff is None
        if diff is not None:
            result[f"outputs_first_difference_b{b}"] = diff
            log(f"batch {b}: cached and recomputed greedy outputs first differ at step {diff}")
        if args.compile:
            for kind in ("static", "compiled"):
                result[f"tokens_per_s_{kind}_b{b}"] = round(b * n / seconds[f"{kind}_b{b}"], 1)
                result[f"{kind}_speedup{suffix}"] = round(cached / seconds[f"{kind}_b{b}"], 2)
                diff = first_difference(outputs[f"cache_b{b}"], outputs[f"{kind}_b{b}"])
                all_match &= diff is None
                if diff is not None:
                    result[f"{kind}_outputs_first_difference_b{b}"] = diff
                    log(f"batch {b}: {kind} and dynamic cached greedy outputs first differ at step {diff}")
            result[f"compile_s_b{b}"] = compile_s[b]
    result["outputs_match"] = all_match
    result["timing_spread"] = spread
    result["kv_cache_target"] = KV_CACHE_TARGET
    if "kv_cache_speedup" in result:
        result["kv_cache_meets_target"] = result["kv_cache_speedup"] >= KV_CACHE_TARGET

    # -- 2. speculative self-decoding against cached greedy ------------------------------------------
    if not args.no_speculative and model.text_head.mtp_depth > 0:
        prompts = speculative_prompts(model, raw, prompt)
        log(f"speculative decoding on {len(prompts)} prompt(s), up to {n} tokens each (stopping at <eos>)")

        def greedy() -> list[list[int]]:
            return [model.generate([p], n, temperature=0)[0] for p in prompts]

        def speculative() -> tuple[list[list[int]], list[float]]:
            runs = [speculative_generate(model, p, n) for p in prompts]
            return [r[0] for r in runs], [r[1] for r in runs]

        seconds, outputs, spec_spread = time_interleaved(
            {"greedy": greedy, "speculative": speculative}, args.warmup, args.repeats, label="speculative "
        )
        greedy_out, (spec_out, acceptance) = outputs["greedy"], outputs["speculative"]
        tokens = sum(len(o) for o in greedy_out)
        diff = first_difference(greedy_out, spec_out)
        if diff is not None:
            log(f"speculative and greedy outputs first differ at step {diff}")
        result.update(
            {
                "speculative_prompts": len(prompts),
                "speculative_tokens": tokens,
                "tokens_per_s_greedy": round(tokens / seconds["greedy"], 1),
                "tokens_per_s_speculative": round(sum(len(o) for o in spec_out) / seconds["speculative"], 1),
                "speculative_speedup": round(seconds["greedy"] / seconds["speculative"], 2),
                "mtp_acceptance": round(sum(acceptance) / len(acceptance), 3),
                "speculative_outputs_match": diff is None,
                "speculative_timing_spread": spec_spread,
            }
        )
        if weights == "random":
            result["speculative_note"] = "random weights: drafts rarely accepted, pass --checkpoint"

    if how is not None:
        result["checkpoint_loader"] = how
    result.update(info)
    result["repeats"] = args.repeats
    result["wall_s"] = round(time.perf_counter() - wall, 1)
    emit(result)


if __name__ == "__main__":
    main()
