"""Does RL on ShapesWorld raise the demo model's held-out rewards, per modality? Runs and scores the arms.

1. RL: `zoo fit --config configs/rl/grpo_shapes.yaml` from the demo checkpoint (RLTask through the
   command line), one run per arm: GRPO, and the control with the same steps but no reward signal
   (`permute_rewards`: each group's rewards shuffled among its responses). `--tasks` picks the
   environments (image / speech to caption, caption to image); each arm's policy is saved as a hub
   directory, and `--reuse` scores saved policies without training again.
2. Held-out scoring of the warm start and of every arm's policy on the same `--eval-queries` held-out
   queries (`ShapesRLDataModule`'s heldout split, an equal share per task): the reward (attribute
   accuracy of the caption, or of the objects read back from the drawn image) greedy, and sampled as the
   mean of `--samples` draws at temperature 1. Deltas are paired per query, with 95% intervals (normal
   approximation over queries).

Prints one JSON line: per task the warm start's and each arm's greedy / sampled reward with the paired
deltas, each arm's validation curves, timings. `--plot docs/img` draws docs/img/rl_shapes.png (`--figure`).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rl_shapes.py --quick           # a few minutes
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rl_shapes.py --plot docs/img   # the documented runs
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rl_shapes.py --tasks text_to_image --plot docs/img \
        --figure rl_shapes_image.png
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rl_shapes.py --config configs/rl/grpo_video.yaml \
        --tasks text_to_video --warm-start runs/demo/video/latest/checkpoints/last.ckpt   # video responses
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, log, machine_info, mean_ci  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RL_CONFIG = REPO / "configs" / "rl" / "grpo_shapes.yaml"
DEMO = REPO / "runs" / "demo" / "multimodal" / "latest" / "checkpoints" / "last.ckpt"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny budgets: checks the pipeline, proves nothing")
    p.add_argument("--warm-start", default=str(DEMO), help="a UnifiedPretraining checkpoint (make demo's)")
    p.add_argument("--tasks", default="image_to_text,audio_to_text", help="ShapesRLDataModule tasks")
    p.add_argument("--config", default=str(RL_CONFIG), help="the RL config (grpo_video.yaml: video tasks)")
    p.add_argument("--arms", default="grpo,control", help="comma list of grpo and control")
    p.add_argument("--rl-steps", type=int, default=None, help="RL steps per arm (default 150; quick 4)")
    p.add_argument("--eval-queries", type=int, default=None, help="held-out queries (default 256; quick 8)")
    p.add_argument("--samples", type=int, default=4, help="sampled responses per held-out query")
    p.add_argument("--out", default="/tmp/rl_shapes", help="working directory (logs, policies)")
    p.add_argument("--reuse", action="store_true", help="score the policies already in --out; no training")
    p.add_argument("--seed", type=int, default=0, help="the RL runs' seed_everything")
    p.add_argument("--batch-size", type=int, default=None, help="queries per RL step (default: the config's)")
    p.add_argument("--reward", choices=("verifier", "reading"), default="verifier",
                   help="what rewards rollouts: the verifier, or (caption to media) the warm start's reading")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--plot", default=None, help="directory for the figure")
    p.add_argument("--figure", default="rl_shapes.png", help="the figure's file name")
    args = p.parse_args()
    args.rl_steps = args.rl_steps or (4 if args.quick else 150)
    args.eval_queries = args.eval_queries or (8 if args.quick else 256)
    return args


def rl_run(args: argparse.Namespace, arm: str, out: Path) -> tuple[object, float]:
    """One arm through the command-line path; returns (policy, seconds)."""
    from zoo.cli import ZooCLI

    out.mkdir(parents=True, exist_ok=True)
    update: dict[str, object] = {"permute_rewards": arm == "control"}
    if args.quick:
        update.update(batch_size=2, group_size=4)
    if args.batch_size:
        update["batch_size"] = args.batch_size
    model_args: dict[str, object] = {
        "init_from": args.warm_start, "update": update, "scoring": {"reward": args.reward},
    }  # fmt: skip
    queries = args.eval_queries
    overlay = {
        "seed_everything": args.seed,
        "trainer": {
            "max_steps": args.rl_steps,
            "val_check_interval": max(1, args.rl_steps // 6),
            "limit_val_batches": math.ceil(queries / 64),
            "enable_progress_bar": False,
            "default_root_dir": str(out),
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(out), "name": "logs", "version": 0},
            },
            "callbacks": [],
            "enable_checkpointing": False,
        },
        "model": {"init_args": model_args},
        "data": {
            "init_args": {"tasks": args.tasks.split(","), "heldout_size": queries, "val_batch_size": 64}
        },
    }
    path = out / "rl.yaml"
    path.write_text(json.dumps(overlay))
    begin = time.perf_counter()
    cli = ZooCLI(args=["fit", "--config", args.config, "--config", str(path)])
    return cli.model.model.eval(), time.perf_counter() - begin


def curves(out: Path, tasks: list[str]) -> dict[str, list[float]]:
    """Per verifier task: step, val reward greedy / sampled of an arm's CSV log."""
    rows = list(csv.DictReader((out / "logs" / "version_0" / "metrics.csv").open()))
    result: dict[str, list[float]] = {"step": []}
    for row in rows:
        if not row.get("val/reward"):
            continue
        result["step"].append(int(row["step"]) + 1)  # logged at global_step - 1: steps done
        for task in tasks:
            prefix = f"val/{task}" if len(tasks) > 1 else "val"
            for kind, suffix in (("greedy", ""), ("sampled", "_sampled")):
                value = round(float(row[f"{prefix}/reward{suffix}"]), 4)
                result.setdefault(f"{task}/{kind}", []).append(value)
    return result


def score(model, data, queries: list, samples: int) -> dict[str, list[float]]:
    """Per query: the greedy reward and the mean reward of `samples` draws at temperature 1."""
    from zoo.rl.scoring import respond, safe_verify

    greedy, sampled = [], []
    for start in range(0, len(queries), 64):
        chunk = queries[start : start + 64]
        prompts = [data.base_prompt(q) for q in chunk]
        clips = {"video_frames": data.video_frames}  # clips of the data's length (caption_to_video)
        outputs = respond(model, prompts, data.decode, 48, temperature=0.0, **clips)
        greedy += [safe_verify(q, o) for q, o in zip(chunk, outputs, strict=True)]
        draws = []
        for k in range(samples):
            generator = torch.Generator().manual_seed(1000 * start + k)
            outputs = respond(model, prompts, data.decode, 48, 1.0, generator=generator, **clips)
            draws.append([safe_verify(q, o) for q, o in zip(chunk, outputs, strict=True)])
        sampled += [sum(d[i] for d in draws) / samples for i in range(len(chunk))]
    return {"greedy": greedy, "sampled": sampled}


def summary(scores: dict[str, list[float]], base: dict[str, list[float]] | None, picked: list[int]) -> dict:
    out: dict[str, object] = {}
    for kind in ("greedy", "sampled"):
        values = [scores[kind][i] for i in picked]
        out[kind], out[f"{kind}_ci95"] = mean_ci(values)
        if base is not None:
            diff = [values[j] - base[kind][i] for j, i in enumerate(picked)]
            out[f"{kind}_delta"], out[f"{kind}_delta_ci95"] = mean_ci(diff)
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = results["tasks"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.4), squeeze=False)
    colours = {"grpo": "tab:green", "control": "tab:gray"}
    for ax, task in zip(axes[0], tasks, strict=True):
        start = results["scores"][task]["warm_start"]
        for arm, c in results["curves"].items():
            steps = [0, *c["step"]]
            colour = colours.get(arm, "tab:blue")
            ax.plot(steps, [start["sampled"], *c[f"{task}/sampled"]], "-o", ms=3, color=colour,
                    label=f"{arm}: sampled (T=1)")  # fmt: skip
            ax.plot(steps, [start["greedy"], *c[f"{task}/greedy"]], "--", color=colour, alpha=0.7,
                    label=f"{arm}: greedy")  # fmt: skip
        ax.set_title(f"{task}: held-out reward", fontsize=9)
        ax.set_xlabel("RL step")
        ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    log(f"wrote {path}")


def main() -> None:
    args = parse_args()
    info = machine_info(args.threads)
    from zoo.datamodules.sequence import MediaLayout
    from zoo.hub import from_pretrained, load_lightning_checkpoint, save_pretrained
    from zoo.rl.data_shapes import ShapesRLDataModule

    if not Path(args.warm_start).exists():
        raise SystemExit(f"no warm start at {args.warm_start}: run `make demo` first (or pass --warm-start)")
    warm, tokenizer = load_lightning_checkpoint(args.warm_start)
    warm.eval()
    task_names = args.tasks.split(",")
    data = ShapesRLDataModule(
        tasks=tuple(task_names), vocab=warm.vocab, layout=MediaLayout.of(warm), heldout_size=args.eval_queries
    )
    data.use_tokenizer(tokenizer)
    queries = data.heldout_queries()
    verifier_tasks = sorted({q.task for q in queries})
    per_task = {t: [i for i, q in enumerate(queries) if q.task == t] for t in verifier_tasks}
    out = Path(args.out)
    timings: dict[str, float] = {}
    begin = time.perf_counter()
    base = score(warm, data, queries, args.samples)
    timings["score_warm_start_s"] = round(time.perf_counter() - begin, 1)
    results: dict[str, object] = {"tasks": verifier_tasks, "scores": {}, "curves": {}}
    scores = {"warm_start": base}
    for arm in args.arms.split(","):
        policy_dir = out / arm / "policy"
        if args.reuse:
            policy = from_pretrained(policy_dir).eval()
        else:
            log(f"RL arm {arm}: {args.rl_steps} steps")
            policy, seconds = rl_run(args, arm, out / arm)
            timings[f"rl_{arm}_s"] = round(seconds, 1)
            save_pretrained(policy, policy_dir, tokenizer=tokenizer)
        begin = time.perf_counter()
        scores[arm] = score(policy, data, queries, args.samples)
        timings[f"score_{arm}_s"] = round(time.perf_counter() - begin, 1)
        results["curves"][arm] = curves(out / arm, verifier_tasks)
    for task, picked in per_task.items():
        results["scores"][task] = {
            name: summary(s, None if name == "warm_start" else base, picked) for name, s in scores.items()
        }
    results.update(
        eval_queries=len(queries), samples=args.samples, rl_steps=args.rl_steps, timings=timings, machine=info
    )
    if args.plot:
        plot(results, Path(args.plot) / args.figure)
    emit(results)


if __name__ == "__main__":
    main()
