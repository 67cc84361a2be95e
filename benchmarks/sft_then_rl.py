"""Does SFT before RL make RL's greedy accuracy rise beyond RL alone? (issue 18, "How it is measured".)

Per seed, on arithmetic chains ("arith", difficulty 1 and 2: "12+7-3=" -> "12+7=19,19-3=16"), one tiny model
(the shape of benchmarks/rl_stages.py) and these arms, every one scored greedily on the same held-out prompts:

    warm_start        pretraining: loss on every token of `<bos> prompt solution <eos>`, no role tokens
    continued         the warm start, pretrained for as many more steps as SFT takes (SFT's step control)
    sft               the warm start grown by the role tokens (`zoo.init_from.adapt_state`), then SFT: the
                      chat layout of `chat_document(answers_predicted=True)`, loss on the answer only
    rl_warm           GRPO from the warm start (plain prompts `<bos> 12+7-3=`, as it was trained)
    rl_sft            GRPO from SFT, the same steps and settings (chat prompts, as SFT trained it)
    control_warm      rl_warm with each group's rewards permuted (`permute_rewards`: no signal)
    control_sft       rl_sft with each group's rewards permuted
    rl_continued      (`--arms`) GRPO from the continued arm: as many steps before RL as SFT, none of them SFT

RL is `RLTask` under a Lightning Trainer in-process (as `zoo fit` runs it) with `RLDataModule`. The warm start
and SFT are plain loops over the library's documents and `UnifiedModel`'s loss (the loss
`SupervisedFineTuning`'s step computes on these documents) so that three seeds fit in about half an hour.
The warm start of a seed is trained once and every arm of that seed starts from it.

Intervals (95%): per seed, normal approximation over prompts, deltas paired per prompt (`_common.mean_ci`);
over seeds, the same on each prompt's mean over the seeds (prompt spread, not seed spread: the per-seed
figures show that). Prints one JSON line.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sft_then_rl.py            # 3 seeds, about 21 min, 1 thread
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sft_then_rl.py --arms rl_sft,rl_continued   # SFT or steps?
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sft_then_rl.py --quick    # checks the pipeline only

Measured (docs/rl.md, "SFT then RL against RL alone"): RL from SFT beats RL from the warm start in every seed,
and RL from the continued arm beats RL from SFT: SFT's advantage is its steps.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, log, machine_info, mean_ci  # noqa: E402
from rl_heldout import heldout_prompts  # noqa: E402

from zoo.datamodules.chat import Turn, chat_document  # noqa: E402
from zoo.datamodules.paired_documents import DocumentMaker  # noqa: E402
from zoo.datamodules.sequence import MediaLayout, SequenceBuilder, TextSegment  # noqa: E402
from zoo.init_from import adapt_state  # noqa: E402
from zoo.models.unified import UnifiedModel  # noqa: E402
from zoo.registry import create_model  # noqa: E402
from zoo.rl.data import RLDataModule  # noqa: E402
from zoo.rl.losses import PolicyLossConfig  # noqa: E402
from zoo.rl.records import Query  # noqa: E402
from zoo.rl.scoring import safe_verify  # noqa: E402
from zoo.rl.task import RLTask, RolloutConfig  # noqa: E402
from zoo.rl.tasks_text import TextTasks  # noqa: E402
from zoo.rl.update import OptimConfig, UpdateConfig  # noqa: E402
from zoo.tokenizers.text import TextTokenizer  # noqa: E402
from zoo.tokenizers.vocab import UnifiedVocab  # noqa: E402

SHAPE = dict(
    dim=96, n_layers=3, n_heads=4, n_kv_heads=2, n_experts=8, expert_hidden=48, top_k=2, max_seq_len=128
)
PLAIN = UnifiedVocab(text_size=512, visual_size=16, audio_size=16, audio_levels=1)
CHAT = dataclasses.replace(PLAIN, chat=True)
TASK, DIFFICULTIES, BUDGET = "arith", (1, 2), 24
# RL arms: (start, permuted rewards). `rl_continued` is RL from the continued arm: as many steps before RL
# as SFT takes, so that a gain of SFT then RL over it is SFT's, not its steps'.
ARMS = {
    "rl_warm": ("warm_start", False),
    "rl_sft": ("sft", False),
    "control_warm": ("warm_start", True),
    "control_sft": ("sft", True),
    "rl_continued": ("continued", False),
}


def parse_arm(spec: str, temperature: float) -> tuple[str, str, float]:
    """`ARM` or `ARM@T` -> (the arm's result name, the arm, its rollout temperature)."""
    arm, _, at = spec.partition("@")
    if arm not in ARMS:
        raise SystemExit(f"--arms: unknown arm {arm!r}; expected one of {', '.join(ARMS)} (optionally @T)")
    return (f"{arm}_T{at}" if at else arm), arm, float(at) if at else temperature


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny budgets: checks the pipeline, proves nothing")
    p.add_argument("--seeds", default="0,1,2", help="comma list of seeds (model init, data order, sampling)")
    p.add_argument("--warm-steps", type=int, default=None, help="pretraining steps (default 400; quick 20)")
    p.add_argument("--sft-steps", type=int, default=None, help="SFT and continued steps (150; quick 5)")
    p.add_argument("--rl-steps", type=int, default=None, help="RL steps per arm (default 30; quick 2)")
    p.add_argument("--batch", type=int, default=32, help="documents per warm-start / SFT step")
    p.add_argument("--warm-lr", type=float, default=3e-3, help="AdamW rate of the warm start")
    p.add_argument("--sft-lr", type=float, default=1e-3, help="AdamW rate of SFT and of the continued arm")
    p.add_argument("--rl-batch", type=int, default=16, help="queries per RL step (G = 8 each)")
    p.add_argument("--rl-lr", type=float, default=5e-5, help="RL learning rate")
    p.add_argument("--temperature", type=float, default=1.0, help="RL rollout temperature")
    p.add_argument(
        "--arms", default="rl_warm,rl_sft,control_warm,control_sft",
        help=f"comma list of RL arms ({', '.join(ARMS)}); ARM@T samples that arm's rollouts at temperature T",
    )  # fmt: skip
    p.add_argument("--eval-prompts", type=int, default=None, help="distinct held-out prompts (default 512)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.arms = [parse_arm(a.strip(), args.temperature) for a in args.arms.split(",") if a.strip()]
    args.warm_steps = args.warm_steps or (20 if args.quick else 400)
    args.sft_steps = args.sft_steps or (5 if args.quick else 150)
    args.rl_steps = args.rl_steps or (2 if args.quick else 30)
    args.eval_prompts = args.eval_prompts or (32 if args.quick else 512)
    return args


def rl_data(vocab: UnifiedVocab, tokenizer: TextTokenizer, seed: int, size: int) -> RLDataModule:
    """RL's arithmetic queries (the same training and held-out split for every seed; `seed` orders them)."""
    data = RLDataModule(
        tasks=(TASK,), difficulties=DIFFICULTIES, vocab=vocab, train_size=size, heldout_size=16, seed=seed
    )
    data.use_tokenizer(tokenizer)
    return data


def supervised(
    model: UnifiedModel, docs: list, steps: int, batch: int, lr: float, seed: int, what: str
) -> float:
    """`steps` AdamW steps on the model's own loss over `docs` (a seeded order); returns the last loss."""
    builder = SequenceBuilder(model.vocab, SHAPE["max_seq_len"])
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    model.train()
    loss, begin = torch.zeros(()), time.perf_counter()
    for step in range(steps):
        picked = [docs[order[(step * batch + i) % len(docs)]] for i in range(batch)]
        loss = model(builder.collate(picked)).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            log(f"{what} step {step}: loss {loss.item():.3f} ({time.perf_counter() - begin:.0f} s)")
    return float(loss)


def pretraining_docs(data: RLDataModule) -> list:
    """`<bos> prompt solution <eos>`, every token a target (what the RL prompt of a plain model continues)."""
    return [
        [TextSegment([*data.base_prompt_ids(q), *data.encode_text(q.solution), PLAIN.eos_id])]
        for q in data.train_queries()
    ]


def sft_docs(queries: list[Query], tokenizer: TextTokenizer) -> list:
    """The chat layout SFT trains: user turn the prompt, assistant turn the solution, loss on the answer."""
    maker = DocumentMaker(CHAT, tokenizer, MediaLayout(), SHAPE["max_seq_len"])
    return [
        chat_document(maker, [Turn("user", (q.prompt,)), Turn("assistant", (q.solution,))], True)
        for q in queries
    ]


def with_role_tokens(model: UnifiedModel) -> UnifiedModel:
    """A chat model holding `model`'s weights, the role rows grown as `init_from` grows them."""
    grown = create_model("tiny", **SHAPE, **dataclasses.asdict(CHAT))
    state, _ = adapt_state(model.state_dict(), PLAIN, CHAT, "the warm start")
    grown.load_state_dict(state, strict=True)
    return grown


def rl(
    model: UnifiedModel,
    data: RLDataModule,
    args: argparse.Namespace,
    seed: int,
    control: bool,
    temperature: float,
) -> None:
    """GRPO on `data` for `args.rl_steps` steps, in place (rl_stages.py's settings)."""
    task = RLTask(
        model,
        loss=PolicyLossConfig(algorithm="grpo", icepop=False),
        rollout=RolloutConfig(max_new_tokens=BUDGET, temperature=temperature, seed=seed),
        update=UpdateConfig(
            batch_size=args.rl_batch, group_size=8, micro_batch_size=128, permute_rewards=control
        ),
        optim=OptimConfig(lr=args.rl_lr, warmup_steps=5),
    )
    trainer = L.Trainer(
        accelerator="cpu", max_steps=args.rl_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(task, datamodule=data)


@torch.no_grad()
def greedy_correct(model: UnifiedModel, data: RLDataModule, queries: list[Query]) -> list[float]:
    """Per held-out prompt: 1.0 when the greedy answer is right (prompted in `data`'s layout)."""
    model.eval()
    correct: list[float] = []
    for start in range(0, len(queries), 128):
        batch = queries[start : start + 128]
        outs = model.generate([data.base_prompt_ids(q) for q in batch], BUDGET, temperature=0.0)
        correct += [float(safe_verify(q, data.decode(o)) >= 1.0) for q, o in zip(batch, outs, strict=True)]
    model.train()
    return correct


def one_seed(args: argparse.Namespace, seed: int, tokenizer: TextTokenizer, queries: list[Query]) -> dict:
    """Every arm of one seed: per-prompt greedy correctness, keyed by arm."""
    size = 512 if args.quick else 4096
    plain, chat = rl_data(PLAIN, tokenizer, seed, size), rl_data(CHAT, tokenizer, seed, size)
    torch.manual_seed(seed)
    warm = create_model("tiny", **SHAPE, **dataclasses.asdict(PLAIN))
    warm.decode_text_with(tokenizer.vocab_size)
    supervised(warm, pretraining_docs(plain), args.warm_steps, args.batch, args.warm_lr, seed, "warm start")
    scores = {"warm_start": greedy_correct(warm, plain, queries)}
    log(f"seed {seed} warm start: {sum(scores['warm_start']) / len(queries):.3f}")

    continued = copy.deepcopy(warm)
    docs = pretraining_docs(plain)
    supervised(continued, docs, args.sft_steps, args.batch, args.sft_lr, seed + 1, "continued")
    scores["continued"] = greedy_correct(continued, plain, queries)
    tuned = with_role_tokens(warm)
    tuned.decode_text_with(tokenizer.vocab_size)
    docs = sft_docs(chat.train_queries(), tokenizer)
    supervised(tuned, docs, args.sft_steps, args.batch, args.sft_lr, seed + 1, "SFT")
    scores["sft"] = greedy_correct(tuned, chat, queries)
    log(f"seed {seed} SFT: {sum(scores['sft']) / len(queries):.3f}")

    starts = {"warm_start": (warm, plain), "continued": (continued, plain), "sft": (tuned, chat)}
    for name, arm, temperature in args.arms:
        (start, data), control = starts[ARMS[arm][0]], ARMS[arm][1]
        policy = copy.deepcopy(start)
        rl(policy, rl_data(data.vocab, tokenizer, seed, size), args, seed, control, temperature)
        scores[name] = greedy_correct(policy, data, queries)
        log(f"seed {seed} {name}: {sum(scores[name]) / len(queries):.3f}")
    return scores


# The comparisons the issue asks for: (name, arm, baseline), each a paired delta per prompt.
DELTAS = (
    ("sft_vs_warm_start", "sft", "warm_start"),
    ("sft_vs_continued", "sft", "continued"),
    ("rl_warm_vs_warm_start", "rl_warm", "warm_start"),
    ("rl_sft_vs_sft", "rl_sft", "sft"),
    ("rl_sft_vs_rl_warm", "rl_sft", "rl_warm"),  # the headline: SFT then RL against RL alone
    ("rl_continued_vs_continued", "rl_continued", "continued"),
    ("rl_sft_vs_rl_continued", "rl_sft", "rl_continued"),  # the same steps before RL, SFT's or pretraining's
    ("control_warm_vs_warm_start", "control_warm", "warm_start"),
    ("control_sft_vs_sft", "control_sft", "sft"),
)


def summarise(scores: dict[str, list[float]]) -> dict[str, object]:
    """Each arm's greedy accuracy and each comparison's paired delta, with their 95% half-widths."""
    out: dict[str, object] = {}
    for arm, values in scores.items():
        out[arm] = list(mean_ci(values))
    for name, arm, base in DELTAS:
        if arm in scores and base in scores:
            out[name] = list(mean_ci([a - b for a, b in zip(scores[arm], scores[base], strict=True)]))
    for name in scores:  # arms at another temperature against their start and their T = 1 arm
        arm, _, at = name.partition("_T")
        if at and arm in ARMS:
            for base in (ARMS[arm][0], arm):
                if base in scores:
                    diff = [a - b for a, b in zip(scores[name], scores[base], strict=True)]
                    out[f"{name}_vs_{base}"] = list(mean_ci(diff))
    return out


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    begin = time.perf_counter()
    queries = heldout_prompts(args.eval_prompts, TASK, DIFFICULTIES)
    texts = [f"{q.prompt} {q.solution}" for q in TextTasks((TASK,), DIFFICULTIES).queries("train", 4096)]
    tokenizer = TextTokenizer.train(texts, vocab_size=320, min_frequency=2)
    per_seed, timings = {}, {}
    for seed in args.seeds:
        start = time.perf_counter()
        per_seed[seed] = one_seed(args, seed, tokenizer, queries)
        timings[f"seed{seed}_s"] = round(time.perf_counter() - start, 1)
        log(f"seed {seed}: {summarise(per_seed[seed])}")
    arms = list(per_seed[args.seeds[0]])
    pooled = {arm: [sum(s[arm][i] for s in per_seed.values()) / len(per_seed) for i in range(len(queries))]
              for arm in arms}  # fmt: skip
    emit({
        "benchmark": "sft_then_rl",
        "quick": args.quick,
        "task": TASK,
        "difficulties": list(DIFFICULTIES),
        "heldout_prompts": len(queries),
        "seeds": args.seeds,
        "warm_steps": args.warm_steps,
        "sft_steps": args.sft_steps,
        "rl_steps": args.rl_steps,
        "rl": f"grpo {args.rl_batch}x8, lr {args.rl_lr}, T {args.temperature}",
        "arms": [name for name, _, _ in args.arms],
        "greedy_over_seeds": summarise(pooled),
        "greedy_per_seed": {str(s): summarise(v) for s, v in per_seed.items()},
        "timings": timings,
        "total_s": round(time.perf_counter() - begin, 1),
        **machine_info(args.threads),
    })  # fmt: skip


if __name__ == "__main__":
    main()
