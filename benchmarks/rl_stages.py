"""Does a later RL stage undo an earlier one? Held-out scores of every text stage after each stage (issue 18).

The tiny text model (chat vocabulary) gets a supervised warm start on the reference completions of all three
text stages (a stand-in for SFT: prompt + solution, in the chat layout), then RL stage after stage, each
starting from the weights the previous one left, as configs/rl/stages/ chain them:

    reasoning     "arith" chains ("12+7-3=" -> "12+7=19,19-3=16"), exact answer      (stage 1)
    instructions  format constraints over additions and captions, share satisfied    (stage 3)
    tools         "compute 37*58" with the calculator in the rollout, final answer    (stage 4)

Stage 2 (ShapesWorld images and speech) needs the demo's media model and its pretraining (about ten minutes
alone); it is left out here. After the warm start and after every stage, every stage's held-out queries are
answered greedily by the trained model (the tool calls answered by the environment, as in validation):
mean reward and accuracy (reward 1). RL runs through `RLTask` and a Lightning Trainer in-process, as
`zoo fit` runs it. Prints one JSON line: the score matrix, and each stage's change of every other stage's
scores (negative: it undid some of them).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rl_stages.py            # about 5-10 minutes on 2 cores
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rl_stages.py --quick    # checks the pipeline only
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, log, machine_info  # noqa: E402

from zoo.datamodules.sequence import SequenceBuilder, TextSegment  # noqa: E402
from zoo.registry import create_model  # noqa: E402
from zoo.rl.data import QueryDataModule, RLDataModule  # noqa: E402
from zoo.rl.envs.data import InstructionRLDataModule, ToolRLDataModule  # noqa: E402
from zoo.rl.losses import PolicyLossConfig  # noqa: E402
from zoo.rl.scoring import respond, safe_verify  # noqa: E402
from zoo.rl.task import RLTask, RolloutConfig  # noqa: E402
from zoo.rl.update import OptimConfig, UpdateConfig  # noqa: E402
from zoo.tokenizers.text import TextTokenizer  # noqa: E402
from zoo.tokenizers.vocab import UnifiedVocab  # noqa: E402

SHAPE = dict(
    dim=96, n_layers=3, n_heads=4, n_kv_heads=2, n_experts=8, expert_hidden=48, top_k=2, max_seq_len=128
)
VOCAB = UnifiedVocab(text_size=512, visual_size=16, audio_size=16, audio_levels=1, chat=True)
BUDGET = {"reasoning": 24, "instructions": 32, "tools": 40}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny budgets: checks the pipeline, proves nothing")
    p.add_argument("--warm-steps", type=int, default=None, help="supervised warm-start steps (default 300)")
    p.add_argument("--rl-steps", type=int, default=None, help="RL steps per stage (default 20)")
    p.add_argument("--batch-size", type=int, default=16, help="queries per RL step (G = 8 each)")
    p.add_argument("--lr", type=float, default=5e-5, help="RL learning rate")
    p.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts per stage (default 128)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args()


def stages(size: int, heldout: int, seed: int) -> dict[str, QueryDataModule]:
    common = dict(vocab=VOCAB, train_size=size, heldout_size=heldout, seed=seed, val_batch_size=heldout)
    return {
        "reasoning": RLDataModule(tasks=("arith",), difficulties=(1, 2), **common),
        "instructions": InstructionRLDataModule(counts=(1, 2), **common),
        "tools": ToolRLDataModule(difficulties=(1,), **common),
    }


def warm_start(model: torch.nn.Module, data: dict[str, QueryDataModule], steps: int) -> float:
    """Supervised steps on prompt + reference completion of every stage's training queries, interleaved."""
    eos = VOCAB.eos_id
    docs = [
        [TextSegment([*d.base_prompt_ids(q), *d.encode_text(q.solution), eos])]
        for d in data.values() for q in d.train_queries()
    ]  # fmt: skip
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(0)).tolist()
    builder = SequenceBuilder(VOCAB, SHAPE["max_seq_len"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss = torch.zeros(())
    for step in range(steps):
        picked = [docs[order[(step * 32 + i) % len(docs)]] for i in range(32)]
        loss = model(builder.collate(picked)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            log(f"warm start step {step}: loss {loss.item():.3f}")
    return float(loss)


@torch.no_grad()
def scores(model: torch.nn.Module, data: dict[str, QueryDataModule]) -> dict[str, dict[str, float]]:
    """Greedy held-out mean reward and accuracy of every stage (tool calls answered, as in validation)."""
    model.eval()
    out = {}
    for name, d in data.items():
        queries = d.heldout_queries()
        prompts = [d.base_prompt(q) for q in queries]
        said = respond(model, prompts, d.decode, BUDGET[name], 0.0, environment=d.environment())
        rewards = [safe_verify(q, s) for q, s in zip(queries, said, strict=True)]
        out[name] = {
            "reward": round(sum(rewards) / len(rewards), 4),
            "accuracy": round(sum(r >= 1.0 for r in rewards) / len(rewards), 4),
        }
    model.train()
    return out


def rl_stage(
    model: torch.nn.Module, d: QueryDataModule, name: str, args: argparse.Namespace, steps: int
) -> None:
    task = RLTask(
        model,
        loss=PolicyLossConfig(algorithm="grpo", icepop=False),
        rollout=RolloutConfig(max_new_tokens=BUDGET[name], seed=args.seed),
        update=UpdateConfig(batch_size=args.batch_size, group_size=8, micro_batch_size=128),
        optim=OptimConfig(lr=args.lr, warmup_steps=5),
    )
    trainer = L.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(task, datamodule=d)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    warm_steps = args.warm_steps or (40 if args.quick else 300)
    rl_steps = args.rl_steps or (2 if args.quick else 20)
    heldout = args.eval_prompts or (16 if args.quick else 128)
    begin = time.perf_counter()
    torch.manual_seed(args.seed)
    data = stages(64 if args.quick else 2048, heldout, args.seed)
    texts = [f"{q.prompt} {q.solution}" for d in data.values() for q in d.train_queries()]
    tokenizer = TextTokenizer.train(texts, vocab_size=400, min_frequency=2)
    for d in data.values():
        d.use_tokenizer(tokenizer)
    model = create_model("tiny", **SHAPE, **dataclasses.asdict(VOCAB))
    assert model.vocab == VOCAB
    model.decode_text_with(tokenizer.vocab_size)
    warm_loss = warm_start(model, data, warm_steps)
    matrix = {"warm_start": scores(model, data)}
    log(f"warm start: {matrix['warm_start']}")
    timings = {"warm_start_s": round(time.perf_counter() - begin, 1)}
    for name, d in data.items():
        start = time.perf_counter()
        rl_stage(model, d, name, args, rl_steps)
        matrix[name] = scores(model, data)
        timings[f"{name}_s"] = round(time.perf_counter() - start, 1)
        log(f"after {name}: {matrix[name]}")
    names, rows = list(data), list(matrix)
    effect = {
        after: {
            evaluated: round(matrix[after][evaluated]["reward"] - matrix[before][evaluated]["reward"], 4)
            for evaluated in names
        }
        for before, after in zip(rows, rows[1:], strict=False)
    }
    emit({
        "benchmark": "rl_stages",
        "quick": args.quick,
        "stages": names,
        "heldout_prompts": heldout,
        "warm_steps": warm_steps,
        "warm_loss": round(warm_loss, 4),
        "rl_steps_per_stage": rl_steps,
        "batch": f"{args.batch_size}x8",
        "lr": args.lr,
        "seed": args.seed,
        "scores": matrix,
        "reward_change_by_stage": effect,
        "timings": timings,
        "total_s": round(time.perf_counter() - begin, 1),
        **machine_info(args.threads),
    })  # fmt: skip


if __name__ == "__main__":
    main()
