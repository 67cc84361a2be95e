"""Benchmark against a peer: the zoo beside Hugging Face's Qwen3-MoE at the same shape (issue 15).

Both models: vocab 4096, hidden 256, 4 layers, 4 heads of 64 (no GQA), 64 routed experts of 128, top-2
with renormalised gate weights, no shared experts, no dense layers, QK-norm, RoPE theta 1e4, float32 (or
`--dtype bfloat16` on both sides). The zoo's weights are copied into the HF model, and before anything is
timed the two are checked to compute the same thing: logits equal to `--tolerance` on a batch, greedy
tokens identical. Both parameter counts are printed.

Measured, in one process with the variants interleaved (`_common.time_interleaved`, medians):
- decode tokens/s, greedy, `--new-tokens` (128) after a `--prompt-len` (32) token prompt, batch 1 and 8:
  the zoo's `generate` against HF `generate` with each of its expert implementations ("eager",
  "batched_mm", "grouped_mm"), the best of which is the reference (`decode_bs1_over_hf`,
  `decode_bs8_over_hf`); with `--compile` also the zoo's compiled static text step
  (`step="compiled"`, zoo/models/static_step.py; traced before timing), `decode_bs{1,8}_compiled_over_hf`;
- training forward + backward tokens/s at 8 x 256 against HF with "grouped_mm" (`train_over_hf`);
- the MoE layer alone, forward + backward over 4096 tokens, against HF's sparse MoE block with
  "grouped_mm" (`moe_over_hf`) and against a dense SwiGLU of the same active FLOPs, hidden 2 x 128
  (`moe_over_dense`).
The keys are the figures at torch's default thread count; the same at 1 thread carry a `_t1` suffix.
Progress goes to stderr; the last stdout line is one JSON object.

    .venv/bin/python benchmarks/peers.py [--repeats 5 --dtype bfloat16]

Needs `transformers` (the `bench` extra).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, log, machine_info, time_interleaved  # noqa: E402

from zoo.datamodules.sequence import SequenceBuilder, TextSegment  # noqa: E402
from zoo.models.backbone import UnifiedTransformer  # noqa: E402
from zoo.models.moe import MoEFeedForward, SwiGLU  # noqa: E402
from zoo.models.unified import UnifiedModel  # noqa: E402
from zoo.tokenizers.vocab import SPECIAL_TOKENS, UnifiedVocab  # noqa: E402

VOCAB, DIM, LAYERS, HEADS, HEAD_DIM, EXPERTS, EXPERT_HIDDEN, TOP_K = 4096, 256, 4, 4, 64, 64, 128, 2
EXPERT_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")


def zoo_model(seed: int, max_seq_len: int) -> UnifiedModel:
    torch.manual_seed(seed)
    backbone = UnifiedTransformer(
        dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=HEADS, head_dim=HEAD_DIM, n_dense_layers=0,
        n_experts=EXPERTS, n_shared_experts=0, expert_hidden=EXPERT_HIDDEN, top_k=TOP_K, balancing="none",
        aux_loss_coef=0.0, z_loss_coef=0.0, max_seq_len=max_seq_len,
    )  # fmt: skip
    vocab = UnifiedVocab(text_size=VOCAB - len(SPECIAL_TOKENS))  # the text head covers exactly VOCAB ids
    return UnifiedModel(backbone, vocab, mtp_depth=0).eval()


def hf_model(zoo: UnifiedModel, experts: str, max_seq_len: int):  # noqa: ANN201 (Qwen3MoeForCausalLM)
    """HF Qwen3-MoE of the zoo model's shape, holding the zoo model's weights."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=TOP_K * EXPERT_HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HEAD_DIM,
        moe_intermediate_size=EXPERT_HIDDEN, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        norm_topk_prob=True, rms_norm_eps=zoo.backbone.norm_eps, max_position_embeddings=max_seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        router_aux_loss_coef=0.0,
    )  # fmt: skip
    hf = Qwen3MoeForCausalLM._from_config(config, experts_implementation=experts, attn_implementation="sdpa")
    state = {
        "model.embed_tokens.weight": zoo.text_embed.weight,
        "model.norm.weight": zoo.backbone.norm.weight,
        "lm_head.weight": zoo.text_head.output.weight,
    }
    for i, block in enumerate(zoo.backbone.layers):
        at, attention, experts_ = f"model.layers.{i}.", block.attention, block.ffn.experts
        state.update({
            at + "input_layernorm.weight": block.attn_norm.weight,
            at + "post_attention_layernorm.weight": block.ffn_norm.weight,
            at + "self_attn.q_proj.weight": attention.wq.weight,
            at + "self_attn.k_proj.weight": attention.wk.weight,
            at + "self_attn.v_proj.weight": attention.wv.weight,
            at + "self_attn.o_proj.weight": attention.wo.weight,
            at + "self_attn.q_norm.weight": attention.q_norm.weight,
            at + "self_attn.k_norm.weight": attention.k_norm.weight,
            at + "mlp.gate.weight": block.ffn.router.gate.weight,
            # zoo experts are [E, D, H] (x @ w); HF's are [E, out, in] (F.linear), gate and up concatenated.
            at + "mlp.experts.gate_up_proj": torch.cat([experts_.w1, experts_.w3], dim=2).transpose(1, 2),
            at + "mlp.experts.down_proj": experts_.w2.transpose(1, 2),
        })  # fmt: skip
    missing, unexpected = hf.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=False)
    if unexpected or [k for k in missing if "rotary" not in k]:
        raise RuntimeError(f"weight copy into HF Qwen3-MoE: missing {missing}, unexpected {unexpected}")
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf.eval()


def check_same_model(zoo: UnifiedModel, hf, prompts: torch.Tensor, tolerance: float) -> dict[str, object]:  # noqa: ANN001
    """Logits equal to `tolerance` and greedy tokens identical, or raise: only then are timings comparable."""
    with torch.no_grad():
        batch = text_rows(prompts)
        ours = zoo.text_head.logits(zoo.forward_hidden(batch).hidden).float()
        theirs = hf(prompts).logits.float()
    gap = float((ours - theirs).abs().max())
    if gap > tolerance:
        raise RuntimeError(
            f"zoo and HF logits differ by {gap:.2e} > {tolerance:.0e}: the weight copy is wrong"
        )
    ours_greedy = zoo.generate(prompts.tolist(), 16, temperature=0.0, stop_ids=())
    theirs_greedy = hf.generate(prompts, max_new_tokens=16, min_new_tokens=16, do_sample=False)[
        :, prompts.shape[1] :
    ]
    if ours_greedy != theirs_greedy.tolist():
        raise RuntimeError("zoo and HF greedy tokens differ")
    return {"max_logit_gap": gap, "greedy_identical": True}


def text_rows(ids: torch.Tensor):  # noqa: ANN201 (GroupBatch)
    from zoo.models.decode import text_batch

    index = torch.arange(ids.shape[1]).expand_as(ids)
    return text_batch(ids, torch.zeros_like(ids), index)


def decode_variants(
    zoo: UnifiedModel, hfs: dict, prompts: torch.Tensor, new_tokens: int, compiled: bool = False
) -> dict:
    rows = prompts.tolist()

    def ours(step: str = "dynamic") -> object:
        return zoo.generate(rows, new_tokens, temperature=0.0, stop_ids=(), step=step)

    variants = {"zoo": ours}
    if compiled:
        start = time.perf_counter()
        ours("compiled")  # trace and compile at the timed shape, outside the timing
        log(f"  compiled step: first run (trace and compile) {time.perf_counter() - start:.1f} s")
        variants["zoo_compiled"] = lambda: ours("compiled")
    for name, hf in hfs.items():
        variants[f"hf_{name}"] = lambda hf=hf: hf.generate(
            prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )
    return variants


def train_variants(zoo: UnifiedModel, hf, batch: int, length: int, seed: int) -> dict:  # noqa: ANN001
    ids = torch.randint(
        len(SPECIAL_TOKENS), VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed)
    )
    packed = SequenceBuilder(zoo.vocab, length).collate([[TextSegment(row)] for row in ids.tolist()])

    def ours() -> None:
        zoo.zero_grad(set_to_none=True)
        zoo(packed).loss.backward()

    def theirs() -> None:
        hf.zero_grad(set_to_none=True)
        hf(ids, labels=ids).loss.backward()

    return {"zoo": ours, "hf_grouped_mm": theirs}


def moe_variants(dtype: torch.dtype, tokens: int, seed: int) -> dict:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(seed)
    ours = MoEFeedForward(DIM, EXPERTS, EXPERT_HIDDEN, TOP_K, balancing="none", aux_loss_coef=0.0,
                          z_loss_coef=0.0).to(dtype)  # fmt: skip
    config = Qwen3MoeConfig(hidden_size=DIM, moe_intermediate_size=EXPERT_HIDDEN, num_experts=EXPERTS,
                            num_experts_per_tok=TOP_K, norm_topk_prob=True)  # fmt: skip
    config._experts_implementation = "grouped_mm"
    theirs = Qwen3MoeSparseMoeBlock(config).to(dtype)
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.router.gate.weight)
        theirs.experts.gate_up_proj.copy_(torch.cat([ours.experts.w1, ours.experts.w3], 2).transpose(1, 2))
        theirs.experts.down_proj.copy_(ours.experts.w2.transpose(1, 2))
    dense = SwiGLU(DIM, TOP_K * EXPERT_HIDDEN).to(dtype)  # the active FLOPs of one token, dense
    x = torch.randn(tokens, DIM, dtype=dtype, generator=torch.Generator().manual_seed(seed))

    def run(module: torch.nn.Module, inputs: torch.Tensor, pick) -> None:  # noqa: ANN001
        module.zero_grad(set_to_none=True)
        pick(module(inputs)).float().square().mean().backward()

    return {
        "zoo": lambda: run(ours, x, lambda out: out.out),
        "hf_grouped_mm": lambda: run(theirs, x[None], lambda out: out),
        "dense": lambda: run(dense, x, lambda out: out),
    }


def measure(args: argparse.Namespace, threads: int) -> dict[str, float]:
    machine_info(threads)
    dtype = getattr(torch, args.dtype)
    max_len = max(args.prompt_len + args.new_tokens, args.train_length) + 8
    zoo = zoo_model(args.seed, max_len).to(dtype)
    hfs = {name: hf_model(zoo, name, max_len).to(dtype) for name in EXPERT_IMPLEMENTATIONS}
    prompt = torch.randint(
        len(SPECIAL_TOKENS), VOCAB, (8, args.prompt_len), generator=torch.Generator().manual_seed(1)
    )
    out: dict[str, float] = {}
    for batch in (1, 8):
        log(f"decode, batch {batch}, {threads} thread(s)")
        seconds, _, spread = time_interleaved(
            decode_variants(zoo, hfs, prompt[:batch], args.new_tokens, args.compile),
            args.warmup,
            args.repeats,
            f"bs{batch} ",
        )
        tokens = batch * args.new_tokens
        best = min(v for k, v in seconds.items() if k.startswith("hf_"))
        out[f"decode_bs{batch}_tokens_per_s"] = round(tokens / seconds["zoo"], 1)
        for name in EXPERT_IMPLEMENTATIONS:
            out[f"decode_bs{batch}_hf_{name}_tokens_per_s"] = round(tokens / seconds[f"hf_{name}"], 1)
        out[f"decode_bs{batch}_over_hf"] = round(best / seconds["zoo"], 3)
        if args.compile:
            out[f"decode_bs{batch}_compiled_tokens_per_s"] = round(tokens / seconds["zoo_compiled"], 1)
            out[f"decode_bs{batch}_compiled_over_hf"] = round(best / seconds["zoo_compiled"], 3)
        out[f"decode_bs{batch}_spread"] = spread
    log(f"training, {args.train_batch} x {args.train_length}, {threads} thread(s)")
    zoo.train()
    hf = hfs["grouped_mm"].train()
    seconds, _, spread = time_interleaved(
        train_variants(zoo, hf, args.train_batch, args.train_length, args.seed),
        args.warmup,
        args.repeats,
        "train ",
    )
    tokens = args.train_batch * args.train_length
    out["train_tokens_per_s"] = round(tokens / seconds["zoo"], 1)
    out["train_hf_tokens_per_s"] = round(tokens / seconds["hf_grouped_mm"], 1)
    out["train_over_hf"] = round(seconds["hf_grouped_mm"] / seconds["zoo"], 3)
    out["train_spread"] = spread
    log(f"MoE layer, {args.moe_tokens} tokens, {threads} thread(s)")
    seconds, _, spread = time_interleaved(
        moe_variants(dtype, args.moe_tokens, args.seed), args.warmup, args.repeats, "moe "
    )
    out["moe_over_hf"] = round(seconds["hf_grouped_mm"] / seconds["zoo"], 3)
    out["moe_over_dense"] = round(seconds["dense"] / seconds["zoo"], 3)
    out["moe_spread"] = spread
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--train-batch", type=int, default=8)
    parser.add_argument("--train-length", type=int, default=256)
    parser.add_argument("--moe-tokens", type=int, default=4096)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="both sides")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest zoo/HF logit gap accepted")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs of every variant first")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per variant (median taken)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="also time the compiled text decode step")
    args = parser.parse_args()

    wall = time.perf_counter()
    default_threads = torch.get_num_threads()
    zoo = zoo_model(args.seed, 512)
    hf = hf_model(zoo, "grouped_mm", 512)
    counts = {
        "zoo_parameters": zoo.num_parameters(),
        "hf_parameters": sum(p.numel() for p in hf.parameters()),
    }
    log(f"parameters: zoo {counts['zoo_parameters']:,}, HF Qwen3-MoE {counts['hf_parameters']:,}")
    prompt = torch.randint(
        len(SPECIAL_TOKENS), VOCAB, (2, args.prompt_len), generator=torch.Generator().manual_seed(2)
    )
    same = check_same_model(zoo, hf, prompt, args.tolerance if args.dtype == "float32" else 1e-1)
    log(f"same model: largest logit gap {same['max_logit_gap']:.2e}, greedy tokens identical")
    result: dict[str, object] = {"benchmark": "peers", **counts, **same}
    for threads in dict.fromkeys((default_threads, 1)):
        figures = measure(args, threads)
        if threads == default_threads:
            result.update(figures)
        if threads == 1:
            result.update({f"{k}_t1": v for k, v in figures.items()})
    torch.set_num_threads(default_threads)
    result["config"] = vars(args)
    result["machine"] = machine_info(default_threads)
    result["wall_s"] = round(time.perf_counter() - wall, 1)
    emit(result)


if __name__ == "__main__":
    main()
