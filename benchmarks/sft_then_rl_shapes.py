"""Does SFT before RL beat RL alone on ShapesWorld captioning? (issue 18, "How it is measured", task two.)

`sft_then_rl.py` answers it on arithmetic from a tiny warm start; here the warm start is `make demo`'s unified
model (`--warm-start`) and every stage runs through `zoo fit` in process (`ZooCLI`), with the configs a user
runs. Per seed, from the same warm start:

    continued     configs/demo/multimodal.yaml: pretraining on the captioning tasks only (`--tasks`),
                  `--sft-steps` steps (SFT's step control: as many steps, documents and rate, no chat)
    sft           configs/sft/shapes.yaml: ShapesInstructions' describe-this-image / -speech conversations
                  only, as many steps; `init_from` grows the role tokens, the loss is on the caption alone
    rl_warm       configs/rl/grpo_shapes.yaml from the warm start (prompts in the pretraining layout)
    rl_sft        the same RL from SFT (a chat vocabulary: prompts are SFT's user turn, `ShapesRLDataModule`)
    rl_continued  the same RL from the continued arm
    control_warm, control_sft   rl_warm and rl_sft with each group's rewards permuted (no signal)

Every arm is scored greedily on the same `--eval-queries` held-out queries (`heldout_split: val`: scenes never
trained; an equal share per task): the caption's attribute accuracy against the scene (the RL reward) and
exact (every attribute right). Intervals are 95%, normal over queries, deltas paired per query; "seeds" pools
each query's mean over the seeds (query spread, not seed spread). The seed moves SFT's and RL's data order,
initial state of fresh rows and sampling, not the warm start. Prints one JSON line.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sft_then_rl_shapes.py --quick      # checks the pipeline
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sft_then_rl_shapes.py --seeds 0  # a seed a process
    .venv/bin/python benchmarks/sft_then_rl_shapes.py --merge /tmp/sft_shapes/seed*.json   # pool their lines

Needs `make demo`'s stages 1-4 under runs/demo (the configs read the tokenizers and encoder from there).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, log, machine_info  # noqa: E402
from sft_then_rl import summarise  # noqa: E402

from zoo.datamodules.instructions import SHAPES_INSTRUCTIONS  # noqa: E402
from zoo.rl.data_shapes import CHAT_INSTRUCTIONS  # noqa: E402
from zoo.task_names import Task  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
DEMO = REPO / "runs" / "demo" / "multimodal" / "latest" / "checkpoints" / "last.ckpt"
# RL arms: (start, permuted rewards); the chat vocabulary follows from the start (SFT's has role tokens).
ARMS = {
    "rl_warm": ("warm_start", False),
    "rl_sft": ("sft", False),
    "rl_continued": ("continued", False),
    "control_warm": ("warm_start", True),
    "control_sft": ("sft", True),
}
# The captioning tasks and the ShapesInstructions conversations SFT trains each on (as RL's chat prompts ask).
INSTRUCTION_OF = {task: CHAT_INSTRUCTIONS[Task(task)] for task in ("image_to_text", "audio_to_text")}
EXPERT_BIAS = {"class_path": "zoo.tasks.callbacks.ExpertBiasUpdate", "init_args": {"gamma": 0.001}}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny budgets: checks the pipeline, proves nothing")
    p.add_argument("--warm-start", default=str(DEMO), help="make demo's UnifiedPretraining checkpoint")
    p.add_argument("--tasks", default="image_to_text", help="captioning tasks: image_to_text, audio_to_text")
    p.add_argument("--seeds", default="0,1,2", help="comma list of seeds")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list of RL arms ({', '.join(ARMS)})")
    p.add_argument("--sft-steps", type=int, default=None, help="SFT and continued steps (150; quick 2)")
    p.add_argument("--sft-lr", type=float, default=1e-3, help="peak rate of SFT and of the continued arm")
    p.add_argument("--rl-steps", type=int, default=None, help="RL steps per arm (default 60; quick 2)")
    p.add_argument("--rl-batch", type=int, default=None, help="queries per RL step, G = 8 (default 16)")
    p.add_argument("--rl-lr", type=float, default=5e-5, help="RL's peak rate (grpo_shapes.yaml's: 5e-5)")
    p.add_argument("--reuse", action="store_true", help="start RL from the continued / SFT exports in --out")
    p.add_argument("--eval-queries", type=int, default=None, help="held-out queries (default 256; quick 8)")
    p.add_argument("--out", default="/tmp/sft_shapes", help="working directory (policies, overlays)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--merge", nargs="+", default=None, help="pool one-seed runs' JSON lines; no training")
    args = p.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; expected among {', '.join(ARMS)}")
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not args.tasks or any(t not in INSTRUCTION_OF for t in args.tasks):
        raise SystemExit(f"--tasks: among {', '.join(INSTRUCTION_OF)}, got {args.tasks}")
    args.sft_steps = args.sft_steps or (2 if args.quick else 150)
    args.rl_steps = args.rl_steps or (2 if args.quick else 60)
    args.rl_batch = args.rl_batch or (2 if args.quick else 16)
    args.eval_queries = args.eval_queries or (8 if args.quick else 256)
    return args


def fit(config: str, overlay: dict, extra: list[str], out: Path):
    """`zoo fit --config config --config overlay extra...` in process; returns the fitted task."""
    from zoo.cli import ZooCLI

    out.mkdir(parents=True, exist_ok=True)
    path = out / "overlay.json"
    path.write_text(json.dumps(overlay))
    return ZooCLI(args=["fit", "--config", config, "--config", str(path), *extra]).model


def quiet_trainer(steps: int, out: Path, callbacks: list) -> dict:
    return {
        "max_steps": steps, "limit_val_batches": 0, "num_sanity_val_steps": 0, "enable_progress_bar": False,
        "enable_checkpointing": False, "enable_model_summary": False, "logger": False, "callbacks": callbacks,
        "default_root_dir": str(out),
    }  # fmt: skip


def continued(args: argparse.Namespace, seed: int, out: Path):
    """The warm start pretrained `sft_steps` more steps on its captioning documents only."""
    weights = {f"{t}_weight": 0.0 for t in ("caption", "text_to_image", "text_to_audio")}
    weights.update({f"{t}_weight": float(t in args.tasks) for t in INSTRUCTION_OF})
    overlay = {
        "seed_everything": seed,
        "trainer": quiet_trainer(args.sft_steps, out, [EXPERT_BIAS]),
        "model": {"init_args": {"init_from": args.warm_start, "lr": args.sft_lr, "warmup_steps": 20}},
        "data": {"init_args": {**weights, "seed": seed}},
    }
    return fit(str(CONFIGS / "demo" / "multimodal.yaml"), overlay, [], out).model


def sft(args: argparse.Namespace, seed: int, out: Path):
    """SFT from the warm start on ShapesInstructions' captioning conversations only."""
    source = {n: 0.0 for n in SHAPES_INSTRUCTIONS}
    source.update({INSTRUCTION_OF[t]: 1.0 for t in args.tasks})
    source.update(train_size=4096, max_objects=2, seed=seed)
    overlay = {
        "seed_everything": seed,
        "trainer": quiet_trainer(args.sft_steps, out, [EXPERT_BIAS]),
        "model": {"init_args": {"init_from": args.warm_start, "lr": args.sft_lr, "warmup_steps": 20}},
        "data": {"init_args": {"sources": [
            {"class_path": "zoo.datamodules.instructions.ShapesInstructions", "init_args": source}
        ]}},
    }  # fmt: skip
    return fit(str(CONFIGS / "sft" / "shapes.yaml"), overlay, [], out).model


def rl(args: argparse.Namespace, seed: int, start: Path, chat: bool, control: bool, out: Path):
    """GRPO (configs/rl/grpo_shapes.yaml) from the exported `start`, `rl_steps` steps."""
    update: dict[str, object] = {"permute_rewards": control, "batch_size": args.rl_batch}
    if args.quick:
        update["group_size"] = 4
    overlay = {
        "seed_everything": seed,
        "trainer": quiet_trainer(args.rl_steps, out, []),
        "model": {"init_args": {"init_from": str(start), "update": update, "optim": {"lr": args.rl_lr}}},
        "data": {"init_args": {"tasks": args.tasks, "seed": seed}},
    }
    vocab = [f"--{part}.vocab.chat=true" for part in ("model.init_args.model.init_args", "data.init_args")]
    return fit(str(CONFIGS / "rl" / "grpo_shapes.yaml"), overlay, vocab if chat else [], out).model


@torch.no_grad()
def greedy_rewards(model, data, queries: list) -> list[float]:
    """Per held-out query: the greedy caption's reward (attribute accuracy), prompted in `data`'s layout."""
    from zoo.rl.scoring import respond, safe_verify

    model.eval()
    rewards: list[float] = []
    for start in range(0, len(queries), 64):
        chunk = queries[start : start + 64]
        outputs = respond(model, [data.base_prompt(q) for q in chunk], data.decode, 48, temperature=0.0)
        rewards += [safe_verify(q, o) for q, o in zip(chunk, outputs, strict=True)]
    return rewards


def one_seed(args: argparse.Namespace, seed: int, warm, tokenizer) -> tuple[dict, dict]:
    """Per arm: per-query greedy rewards on the held-out queries; and seconds per stage."""
    from dataclasses import replace

    from zoo.datamodules.sequence import MediaLayout
    from zoo.hub import from_pretrained, save_pretrained
    from zoo.rl.data_shapes import ShapesRLDataModule

    out = Path(args.out) / f"seed{seed}"
    layouts = {}
    for chat in (False, True):
        data = ShapesRLDataModule(
            tasks=tuple(args.tasks), vocab=replace(warm.vocab, chat=chat), layout=MediaLayout.of(warm),
            image_context=True, heldout_size=args.eval_queries,
        )  # fmt: skip
        data.use_tokenizer(tokenizer)
        layouts[chat] = data
    queries = layouts[False].heldout_queries()
    assert [q.id for q in queries] == [q.id for q in layouts[True].heldout_queries()]

    def score(name: str, model) -> None:
        rewards[name] = greedy_rewards(model, layouts[model.vocab.chat], queries)
        log(f"seed {seed} {name}: reward {sum(rewards[name]) / len(queries):.3f}")

    rewards: dict[str, list[float]] = {}
    timings: dict[str, float] = {}
    score("warm_start", warm)
    starts = {"warm_start": Path(args.warm_start)}
    for name, train in (("continued", continued), ("sft", sft)):
        starts[name] = out / name / "export"
        if args.reuse:
            score(name, from_pretrained(starts[name]))
            continue
        begin = time.perf_counter()
        model = train(args, seed, out / name)
        timings[name] = round(time.perf_counter() - begin, 1)
        score(name, model)
        save_pretrained(model, starts[name], tokenizer=tokenizer)
    for arm in args.arms:
        start, control = ARMS[arm]
        begin = time.perf_counter()
        policy = rl(args, seed, starts[start], start == "sft", control, out / arm)
        timings[arm] = round(time.perf_counter() - begin, 1)
        score(arm, policy)
    return rewards, timings


def report(per_seed: dict[str, dict[str, list[float]]]) -> dict[str, object]:
    """Reward and exact (reward 1.0) per arm and comparison, per seed and pooled over the seeds."""
    out: dict[str, object] = {}
    for metric, of in (("reward", lambda r: r), ("exact", lambda r: float(r >= 1.0))):
        scores = {s: {arm: [of(r) for r in v] for arm, v in arms.items()} for s, arms in per_seed.items()}
        arms = list(next(iter(scores.values())))
        n = len(next(iter(scores.values()))[arms[0]])
        pooled = {a: [sum(s[a][i] for s in scores.values()) / len(scores) for i in range(n)] for a in arms}
        out[f"{metric}_over_seeds"] = summarise(pooled)
        out[f"{metric}_per_seed"] = {s: summarise(v) for s, v in scores.items()}
    return out


def main() -> None:
    args = parse_args()
    if args.merge:
        lines = [json.loads(Path(p).read_text().strip().splitlines()[-1]) for p in args.merge]
        per_seed = {s: v for line in lines for s, v in line["rewards"].items()}
        emit({"benchmark": "sft_then_rl_shapes", "merged": args.merge, **report(per_seed)})
        return
    torch.set_num_threads(args.threads)
    if not Path(args.warm_start).exists():
        raise SystemExit(f"no warm start at {args.warm_start}: run `make demo` first (or pass --warm-start)")
    from zoo.hub import load_lightning_checkpoint

    begin = time.perf_counter()
    warm, tokenizer = load_lightning_checkpoint(args.warm_start)
    runs = {str(seed): one_seed(args, seed, warm, tokenizer) for seed in args.seeds}
    per_seed = {seed: rewards for seed, (rewards, _) in runs.items()}
    emit({
        "benchmark": "sft_then_rl_shapes",
        "quick": args.quick,
        "warm_start": args.warm_start,
        "tasks": args.tasks,
        "heldout_queries": args.eval_queries,
        "seeds": args.seeds,
        "sft_steps": args.sft_steps,
        "rl_steps": args.rl_steps,
        "rl": f"grpo {args.rl_batch}x8, lr {args.rl_lr}, configs/rl/grpo_shapes.yaml",
        "arms": args.arms,
        **report(per_seed),
        "rewards": per_seed,  # per query, so that one-seed runs can be pooled (--merge)
        "timings": {seed: seconds for seed, (_, seconds) in runs.items()},
        "total_s": round(time.perf_counter() - begin, 1),
        **machine_info(args.threads),
    })  # fmt: skip


if __name__ == "__main__":
    main()
