"""Does a later post-training stage undo an earlier one, the multimodal stage included? (issue 18)

`rl_stages.py` answers it for the three text stages on a tiny text model. Here the chain is the one
`scripts/post_train.sh` runs, from `make demo`'s unified model (`--warm-start`), every stage through
`zoo fit` in process (`ZooCLI`) with its shipped config:

    sft             configs/sft/tiny.yaml: ShapesWorld instructions in every modality and arithmetic
    1_reasoning     configs/rl/stages/1_reasoning.yaml      arithmetic chains, exact answer
    2_multimodal    configs/rl/stages/2_multimodal.yaml     image and speech captions, attribute accuracy
    3_instructions  configs/rl/stages/3_instructions.yaml   format constraints, share satisfied
    4_tools         configs/rl/stages/4_tools.yaml          a calculator inside the rollout, final answer

Each stage starts from the previous one's export (`init_from`), as the configs chain them; only the steps,
the RL batch and the seed are set here (`--sft-steps`, `--rl-steps`, `--rl-batch`). After SFT and after every
RL stage, the model answers every stage's held-out queries greedily (the datamodule of that stage's config,
the tool calls answered by its environment, its `val_max_new_tokens`); the multimodal stage is scored per
task. Prints one JSON line: mean reward and exact (reward 1) per row and evaluated set, and each stage's
paired change of every set against the row before it, with its 95% half-width over queries (negative beyond
it: that stage undid some of an earlier one).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/post_train_chain.py --quick   # checks the pipeline
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/post_train_chain.py           # about 30 minutes on a core

Needs `make demo`'s stages 1-4 under runs/demo (the configs read the tokenizers and encoder from there).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, log, machine_info, mean_ci  # noqa: E402
from sft_then_rl_shapes import DEMO, EXPERT_BIAS, fit, quiet_trainer  # noqa: E402

from zoo.rl.data import QueryDataModule  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SFT = CONFIGS / "sft" / "tiny.yaml"
STAGES = {name: CONFIGS / "rl" / "stages" / f"{name}.yaml"
          for name in ("1_reasoning", "2_multimodal", "3_instructions", "4_tools")}  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny budgets: checks the pipeline, proves nothing")
    p.add_argument("--warm-start", default=str(DEMO), help="make demo's UnifiedPretraining checkpoint")
    p.add_argument("--sft-steps", type=int, default=None, help="SFT steps (tiny.yaml's 1200; quick 2)")
    p.add_argument("--rl-steps", type=int, default=None, help="GRPO steps per stage (default 30; quick 1)")
    p.add_argument("--rl-batch", type=int, default=None, help="queries per RL step, G = 8 (default 16)")
    p.add_argument("--eval-queries", type=int, default=None, help="held-out queries a stage (256; quick 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="/tmp/post_train_chain", help="working directory (exports, overlays)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    args.sft_steps = args.sft_steps or (2 if args.quick else 1200)
    args.rl_steps = args.rl_steps or (1 if args.quick else 30)
    args.rl_batch = args.rl_batch or (2 if args.quick else 16)
    args.eval_queries = args.eval_queries or (4 if args.quick else 256)
    return args


def stage_data(config: Path, heldout: int, tokenizer) -> tuple[QueryDataModule, int]:
    """The stage's datamodule as its config builds it (`heldout` queries), and its answer budget."""
    from jsonargparse import ArgumentParser

    from zoo.trust import enforce_import_allowlist

    enforce_import_allowlist()
    tree = yaml.safe_load(config.read_text())
    node = tree["data"]
    node["init_args"]["heldout_size"] = heldout
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(QueryDataModule, "data")
    data = parser.instantiate_classes(parser.parse_object({"data": node})).data
    data.use_tokenizer(tokenizer)
    return data, int(tree["model"]["init_args"]["scoring"]["val_max_new_tokens"])


@torch.no_grad()
def greedy_rewards(model, stages: dict[str, tuple[QueryDataModule, int]]) -> dict[str, list[float]]:
    """Per evaluated set (a stage; the multimodal stage per task), each held-out query's greedy reward."""
    from zoo.rl.scoring import respond, safe_verify

    model.eval()
    out: dict[str, list[float]] = {}
    for name, (data, budget) in stages.items():
        queries = data.heldout_queries()
        rewards: list[float] = []
        for start in range(0, len(queries), 64):
            chunk = queries[start : start + 64]
            said = respond(model, [data.base_prompt(q) for q in chunk], data.decode, budget, 0.0,
                           environment=data.environment())  # fmt: skip
            rewards += [safe_verify(q, s) for q, s in zip(chunk, said, strict=True)]
        tasks = sorted({q.task for q in queries})
        for task in tasks:
            key = name if len(tasks) == 1 else f"{name}/{task}"
            out[key] = [r for q, r in zip(queries, rewards, strict=True) if q.task == task]
    return out


def train_stage(args: argparse.Namespace, name: str, start: Path, out: Path):
    """One stage of the chain from the export `start`: SFT, or the RL stage `name`; returns its model."""
    trainer = quiet_trainer(args.sft_steps if name == "sft" else args.rl_steps, out, [EXPERT_BIAS])
    init: dict[str, object] = {"init_from": str(start)}
    if name != "sft":
        init["update"] = {"batch_size": args.rl_batch, **({"group_size": 4} if args.quick else {})}
        trainer["callbacks"] = []  # RLTask updates the expert bias itself
    overlay = {"seed_everything": args.seed, "trainer": trainer, "model": {"init_args": init}}
    if name != "sft":
        overlay["data"] = {"init_args": {"seed": args.seed}}
    return fit(str(SFT if name == "sft" else STAGES[name]), overlay, [], out).model


def report(rows: dict[str, dict[str, list[float]]]) -> dict[str, object]:
    """Mean reward and exact per row and set; each row's paired change of every set against the row before."""
    names = list(rows)
    table = {row: {s: {"reward": list(mean_ci(v)), "exact": list(mean_ci([float(r >= 1.0) for r in v]))}
                   for s, v in sets.items()} for row, sets in rows.items()}  # fmt: skip
    change = {
        after: {s: list(mean_ci([a - b for a, b in zip(rows[after][s], rows[before][s], strict=True)]))
                for s in rows[after]}
        for before, after in zip(names, names[1:], strict=False)
    }  # fmt: skip
    return {"scores": table, "reward_change_by_stage": change}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if not Path(args.warm_start).exists():
        raise SystemExit(f"no warm start at {args.warm_start}: run `make demo` first (or pass --warm-start)")
    from zoo.hub import load_lightning_checkpoint, save_pretrained

    info = machine_info(args.threads)  # now: the commit whose code runs, not the one at the end
    begin = time.perf_counter()
    _, tokenizer = load_lightning_checkpoint(args.warm_start)
    stages = {name: stage_data(path, args.eval_queries, tokenizer) for name, path in STAGES.items()}
    rows: dict[str, dict[str, list[float]]] = {}
    timings: dict[str, float] = {}
    start = Path(args.warm_start)
    for name in ("sft", *STAGES):
        out = Path(args.out) / f"seed{args.seed}" / name
        began = time.perf_counter()
        model = train_stage(args, name, start, out)
        timings[f"{name}_s"] = round(time.perf_counter() - began, 1)
        rows[name] = greedy_rewards(model, stages)
        log(f"after {name}: " + ", ".join(f"{s} {sum(v) / len(v):.3f}" for s, v in rows[name].items()))
        start = out / "export"
        save_pretrained(model, start, tokenizer=tokenizer)
    emit({
        "benchmark": "post_train_chain",
        "quick": args.quick,
        "warm_start": args.warm_start,
        "seed": args.seed,
        "sft_steps": args.sft_steps,
        "rl_steps_per_stage": args.rl_steps,
        "rl_batch": f"{args.rl_batch}x8",
        "heldout_queries_per_stage": args.eval_queries,
        **report(rows),
        "rewards": rows,
        "timings": timings,
        "total_s": round(time.perf_counter() - begin, 1),
        **info,
    })  # fmt: skip


if __name__ == "__main__":
    main()
