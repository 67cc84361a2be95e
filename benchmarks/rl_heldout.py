"""Does RL raise the tiny model's held-out verifier accuracy on arithmetic? One script, the whole recipe.

1. Warm start: `zoo fit` of the quickstart model (configs/quickstart.yaml + configs/data/text_files.yaml)
   on prompt + reference-solution texts of the training split ("arith", difficulty 1 and 2:
   "12+7-3=" -> "12+7=19,19-3=16"), 200 steps, byte tokenizer.
2. RL: `zoo fit --config configs/rl/grpo_heldout.yaml` from that checkpoint (RLTask through Lightning,
   exactly as the command line runs it), one run per arm: GSPO and/or GRPO, and the control with the same
   steps but no reward signal (`permute_rewards`: each group's rewards shuffled among its responses).
3. Held-out evaluation of the warm start and of every arm's final policy on `--eval-prompts` distinct
   held-out prompts (never a training prompt; `zoo.rl.tasks_text` splits by prompt hash): greedy
   accuracy, and sampled accuracy as the mean over `--eval-samples` samples at temperature 1 per prompt.
   95% intervals: normal approximation over prompts; deltas are paired per prompt (same prompts before
   and after), which removes the prompts' own spread.

Prints one JSON line: heldout_accuracy_start / _end (greedy and sampled, per arm), the control's end,
deltas with intervals, the curve of each arm (val/accuracy every `val_check_interval` steps on the
RL datamodule's held-out queries) and timings. `--plot docs/img` draws docs/img/rl_accuracy.png.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rl_heldout.py --quick          # a few minutes
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rl_heldout.py --plot docs/img  # the documented run
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, log, machine_info, mean_ci  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RL_CONFIG = REPO / "configs" / "rl" / "grpo_heldout.yaml"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny budgets: checks the pipeline, proves nothing")
    p.add_argument("--out", default="/tmp/rl_heldout", help="working directory (checkpoints, logs)")
    p.add_argument("--warm-start", default=None, help="reuse this warm-start .ckpt instead of training one")
    p.add_argument("--sft-steps", type=int, default=None, help="warm-start steps (default 200; quick 30)")
    p.add_argument("--sft-texts", type=int, default=60000, help="warm-start documents (training split)")
    p.add_argument(
        "--task", default="arith", help="zoo.rl.tasks_text task of every stage (the config's: arith)"
    )
    p.add_argument("--difficulties", default="1,2", help="difficulties of every stage (the config's: 1,2)")
    p.add_argument("--rl-steps", type=int, default=None, help="RL steps per arm (default 200; quick 6)")
    p.add_argument(
        "--arms", default="grpo,control", help="comma list of grpo, gspo, control (the first one's algorithm)"
    )
    p.add_argument("--lr", type=float, default=None, help="RL learning rate (default: the config's)")
    p.add_argument("--batch-size", type=int, default=None, help="queries per RL step (default: config's)")
    p.add_argument("--kl-coef", type=float, default=None, help="k3 KL to the warm start (default: config's)")
    p.add_argument(
        "--frozen", default="", help="comma list of parameter-name prefixes kept fixed in RL (text_embed,...)"
    )
    p.add_argument("--eval-prompts", type=int, default=None, help="distinct held-out prompts (default 512)")
    p.add_argument("--eval-samples", type=int, default=4, help="samples per prompt at temperature 1")
    p.add_argument("--seed", type=int, default=0, help="seed of the RL runs (the warm start uses 0)")
    p.add_argument(
        "--baseline-temperatures",
        default="",
        help="comma list: the warm start also sampled at these temperatures (does RL beat a colder sampler?)",
    )
    p.add_argument("--plot", default=None, help="directory for rl_accuracy.png")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--replot",
        action="append",
        default=[],
        metavar="LABEL=RESULT.json",
        help="draw --plot from saved JSON lines of earlier runs (one arm each, labelled) and exit",
    )
    args = p.parse_args()
    quick = args.quick
    args.sft_steps = args.sft_steps or (30 if quick else 200)
    args.rl_steps = args.rl_steps or (6 if quick else 200)
    args.eval_prompts = args.eval_prompts or (64 if quick else 512)
    args.difficulties = tuple(int(d) for d in args.difficulties.split(","))
    if quick:
        args.sft_texts = min(args.sft_texts, 5000)
    return args


# ------------------------------------------------------------------------------------------ stage 1


def warm_start(args: argparse.Namespace, out: Path) -> Path:
    """`zoo fit` of the quickstart model on "a+b=c" texts; returns its last.ckpt."""
    from zoo.cli import main
    from zoo.rl.tasks_text import TextTasks, training_text

    out.mkdir(parents=True, exist_ok=True)
    texts = out / "train.jsonl"
    queries = TextTasks((args.task,), args.difficulties, seed=0).queries("train", args.sft_texts)
    texts.write_text("".join(json.dumps({"text": training_text(q)}) + "\n" for q in queries))
    overlay = {
        "trainer": {
            "max_steps": args.sft_steps,
            "val_check_interval": args.sft_steps,
            "limit_val_batches": 2,
            "log_every_n_steps": 10,
            "enable_progress_bar": False,
            "default_root_dir": str(out),
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(out), "name": "logs"},
            },
            "callbacks": [
                {"class_path": "zoo.tasks.callbacks.ExpertBiasUpdate", "init_args": {"gamma": 0.001}},
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {
                        "dirpath": str(out / "checkpoints"),
                        "save_last": True,
                        "enable_version_counter": False,
                    },
                },
            ],
        },
        # Elastic sub-model sampling off: the RL policy is the full model.
        "model": {"init_args": {"elastic": None, "warmup_steps": min(20, args.sft_steps // 2)}},
        "data": {"init_args": {"train_files": [str(texts)], "seq_len": 128, "batch_size": 256}},
    }
    path = out / "sft.yaml"
    path.write_text(json.dumps(overlay))  # JSON is YAML
    main(
        [
            "fit",
            "--config", str(REPO / "configs" / "quickstart.yaml"),
            "--config", str(REPO / "configs" / "data" / "text_files.yaml"),
            "--config", str(path),
        ]
    )  # fmt: skip
    return out / "checkpoints" / "last.ckpt"


# ------------------------------------------------------------------------------------------ stage 2


def rl_run(args: argparse.Namespace, warm: Path, arm: str, out: Path) -> tuple[object, object, float]:
    """One RL arm through the command-line path; returns (policy, datamodule, seconds)."""
    from zoo.cli import ZooCLI

    out.mkdir(parents=True, exist_ok=True)
    model_args: dict[str, object] = {"init_from": str(warm)}
    # The control permutes the rewards of the algorithm it controls for: the first of --arms.
    algorithm = arm if arm != "control" else next((a for a in args.arms.split(",") if a != "control"), "grpo")
    loss: dict[str, object] = {"algorithm": algorithm, "icepop": False}
    if args.kl_coef is not None:
        loss["kl_coef"] = args.kl_coef
    model_args["loss"] = loss
    if arm == "control":
        model_args["permute_rewards"] = True
    if args.lr is not None:
        model_args["lr"] = args.lr
    if args.batch_size is not None:
        model_args["batch_size"] = args.batch_size
    if args.frozen:
        model_args["frozen"] = [f.strip() for f in args.frozen.split(",") if f.strip()]
    overlay = {
        "seed_everything": args.seed,
        "trainer": {
            "max_steps": args.rl_steps,
            "val_check_interval": max(1, args.rl_steps // 6),
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
        "data": {"init_args": {"tasks": [args.task], "difficulties": list(args.difficulties)}},
    }
    path = out / "rl.yaml"
    path.write_text(json.dumps(overlay))
    begin = time.perf_counter()
    cli = ZooCLI(args=["fit", "--config", str(RL_CONFIG), "--config", str(path)])
    return cli.model.model.eval(), cli.datamodule, time.perf_counter() - begin


def curve(out: Path, start: dict[str, float] | None = None) -> dict[str, list[float]]:
    """Step, val/accuracy, val/accuracy_sampled and train/reward columns of an arm's CSV log; `start`
    (`validation_accuracy` of the warm start) is step 0."""
    rows = list(csv.DictReader((out / "logs" / "version_0" / "metrics.csv").open()))
    keys = ("step", "greedy", "sampled", "reward_step", "reward")
    result: dict[str, list[float]] = {k: [] for k in keys}
    if start is not None:
        result["step"].append(0)
        result["greedy"].append(start["greedy"])
        result["sampled"].append(start["sampled"])
    for row in rows:
        if row.get("val/accuracy"):
            result["step"].append(int(row["step"]) + 1)  # logged at global_step - 1: steps done
            result["greedy"].append(round(float(row["val/accuracy"]), 4))
            result["sampled"].append(round(float(row["val/accuracy_sampled"]), 4))
        if row.get("train/reward"):
            result["reward_step"].append(int(row["step"]))
            result["reward"].append(round(float(row["train/reward"]), 4))
    return result


# ------------------------------------------------------------------------------------------ stage 3


def heldout_prompts(n: int, task: str, difficulties: tuple[int, ...]) -> list:
    """n distinct held-out prompts (an easy level with fewer held-out prompts than its share gives all
    it has, the others the rest), in the datamodule's split."""
    from zoo.rl.tasks_text import TextTasks

    tasks, seen, out, index = TextTasks((task,), difficulties, seed=0), set(), [], 0
    while len(out) < n and index < 50 * n:
        q = tasks.query(index, "heldout")
        index += 1
        if q.prompt not in seen:
            seen.add(q.prompt)
            out.append(q)
    return out


@torch.no_grad()
def evaluate(
    model, data, queries: list, samples: int, max_new_tokens: int, temperature: float = 1.0
) -> dict[str, list[float]]:
    """Per prompt: greedy correct (0/1) and the mean correctness of `samples` samples at `temperature`."""
    from zoo.rl.scoring import safe_verify

    greedy, sampled = [], [[] for _ in queries]
    for start in range(0, len(queries), 128):
        batch = queries[start : start + 128]
        prompts = [data.base_prompt_ids(q) for q in batch]
        outs = model.generate(prompts, max_new_tokens, temperature=0.0)
        greedy += [safe_verify(q, data.decode(o)) >= 1.0 for q, o in zip(batch, outs, strict=True)]
        for k in range(samples):
            generator = torch.Generator().manual_seed(1000 * k + start)
            outs = model.generate(prompts, max_new_tokens, temperature, generator=generator)
            for i, (q, o) in enumerate(zip(batch, outs, strict=True)):
                sampled[start + i].append(safe_verify(q, data.decode(o)) >= 1.0)
    return {"greedy": [float(g) for g in greedy], "sampled": [sum(s) / len(s) for s in sampled]}


@torch.no_grad()
def validation_accuracy(model, task: str, difficulties: tuple[int, ...], tokenizer, budget: int) -> dict:
    """`val/accuracy` and `val/accuracy_sampled` as `RLTask.validation_step` measures them (the config's
    256 held-out queries in batches of 128, sampling seeded by the batch index): step 0 of the curves."""
    from zoo.rl.data import RLDataModule
    from zoo.rl.scoring import safe_verify

    data = RLDataModule(tasks=(task,), difficulties=difficulties, vocab=model.vocab, heldout_size=256)
    data.use_tokenizer(tokenizer)
    queries, hits = data.heldout_queries(), {"greedy": 0.0, "sampled": 0.0}
    for batch_idx, start in enumerate(range(0, len(queries), 128)):
        batch = queries[start : start + 128]
        prompts = [data.base_prompt_ids(q) for q in batch]
        generator = torch.Generator().manual_seed(batch_idx)
        for kind, outs in (
            ("greedy", model.generate(prompts, budget, temperature=0.0)),
            ("sampled", model.generate(prompts, budget, 1.0, generator=generator)),
        ):
            hits[kind] += sum(
                safe_verify(q, data.decode(o)) >= 1.0 for q, o in zip(batch, outs, strict=True)
            )
    return {k: round(v / len(queries), 4) for k, v in hits.items()}


def summary(scores: dict[str, list[float]], base: dict[str, list[float]] | None) -> dict[str, object]:
    out: dict[str, object] = {}
    for kind in ("greedy", "sampled"):
        out[kind], out[f"{kind}_ci95"] = mean_ci(scores[kind])
        if base is not None:
            diff = [a - b for a, b in zip(scores[kind], base[kind], strict=True)]
            out[f"{kind}_delta"], out[f"{kind}_delta_ci95"] = mean_ci(diff)
    return out


def plot(curves: dict[str, dict], directory: Path, n_prompts: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    colours = {"gspo": "tab:blue", "grpo": "tab:green", "control": "tab:gray"}
    for i, (arm, c) in enumerate(curves.items()):
        colour = colours.get(arm, "tab:gray" if "control" in arm else f"C{i}")
        axes[0].plot(c["step"], c["sampled"], "-o", color=colour, label=f"{arm}: sampled (T=1)", ms=3)
        axes[0].plot(c["step"], c["greedy"], "--", color=colour, label=f"{arm}: greedy", alpha=0.7)
        r, s = c["reward"], c["reward_step"]
        w = max(1, len(r) // 15)
        smooth = [sum(r[max(0, i - w + 1) : i + 1]) / min(i + 1, w) for i in range(len(r))]
        axes[1].plot(s, smooth, color=colour, label=arm)
    axes[0].set_title(f"val/accuracy on 256 held-out queries (start/end on {n_prompts}: table)", fontsize=9)
    axes[0].set_xlabel("RL step")
    axes[0].legend(fontsize=6, loc="lower right")
    axes[1].set_title(f"training reward (moving mean of {w} steps)", fontsize=9)
    axes[1].set_xlabel("RL step")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    directory.mkdir(parents=True, exist_ok=True)
    fig.savefig(directory / "rl_accuracy.png", dpi=80)
    log(f"wrote {directory / 'rl_accuracy.png'}")


def replot(args: argparse.Namespace) -> None:
    """--replot: the figure from the JSON lines of separate runs (each run's arms, prefixed by its label)."""
    if not args.plot:
        raise SystemExit("--replot needs --plot DIR")
    curves, n_prompts = {}, None
    for item in args.replot:
        label, sep, path = item.partition("=")
        if not sep or not Path(path).is_file():
            raise SystemExit(f"--replot {item!r}: expected LABEL=RESULT.json of an earlier run")
        line = [ln for ln in Path(path).read_text().splitlines() if ln.startswith("{")][-1]
        result = json.loads(line)
        n_prompts = result["eval_prompts"]
        for arm, c in result["curves"].items():
            curves[label if len(result["curves"]) == 1 else f"{label} {arm}"] = c
    plot(curves, Path(args.plot), n_prompts)


def main() -> None:
    args = parse_args()
    if args.replot:
        replot(args)
        return
    info = machine_info(args.threads)
    out = Path(args.out)
    timings: dict[str, float] = {}
    begin = time.perf_counter()
    warm = Path(args.warm_start) if args.warm_start else warm_start(args, out / "warm")
    timings["warm_start_s"] = round(time.perf_counter() - begin, 1)

    from zoo.hub import load_lightning_checkpoint, save_pretrained
    from zoo.rl.data import RLDataModule

    model, tokenizer = load_lightning_checkpoint(warm)
    import yaml

    budget = yaml.safe_load(RL_CONFIG.read_text())["model"]["init_args"]["val_max_new_tokens"]
    data = RLDataModule(tasks=(args.task,), difficulties=args.difficulties, vocab=model.vocab)
    data.use_tokenizer(tokenizer)
    queries = heldout_prompts(args.eval_prompts, args.task, args.difficulties)
    by_level = {d: [i for i, q in enumerate(queries) if q.difficulty == d] for d in args.difficulties}
    base = evaluate(model.eval(), data, queries, args.eval_samples, budget)
    val_start = validation_accuracy(model, args.task, args.difficulties, tokenizer, budget)
    result: dict[str, object] = {
        "benchmark": "rl_heldout",
        "quick": args.quick,
        "task": args.task,
        "difficulties": list(args.difficulties),
        "eval_prompts": len(queries),
        "eval_prompts_per_difficulty": {str(d): len(ix) for d, ix in by_level.items()},
        "eval_samples": args.eval_samples,
        "sft_steps": args.sft_steps if not args.warm_start else None,
        "rl_steps": args.rl_steps,
        "rl_config": str(RL_CONFIG.relative_to(REPO)),
        "lr": args.lr,
        "kl_coef": args.kl_coef,
        "frozen": args.frozen or None,
        "seed": args.seed,
        "start": summary(base, None),
        "start_per_difficulty": {
            str(d): summary({k: [v[i] for i in ix] for k, v in base.items()}, None)
            for d, ix in by_level.items()
        },
    }
    log(f"warm start: {result['start']}")
    colder = [float(t) for t in args.baseline_temperatures.split(",") if t.strip()]
    if colder:
        result["start_at_temperature"] = {
            str(t): summary(evaluate(model, data, queries, args.eval_samples, budget, t), None)["sampled"]
            for t in colder
        }
        log(f"warm start, colder samplers: {result['start_at_temperature']}")
    curves, ends = {}, {}
    for arm in [a.strip() for a in args.arms.split(",") if a.strip()]:
        if arm not in ("gspo", "grpo", "control"):
            raise SystemExit(f"--arms: unknown arm {arm!r}; expected gspo, grpo or control")
        policy, _, seconds = rl_run(args, warm, arm, out / f"rl_{arm}_s{args.seed}")
        timings[f"{arm}_s"] = round(seconds, 1)
        scores = evaluate(policy, data, queries, args.eval_samples, budget)
        ends[arm] = summary(scores, base)
        # The trained policy as a hub directory (config, safetensors, tokenizer): for later analysis.
        save_pretrained(
            policy, out / f"rl_{arm}_s{args.seed}" / "policy", tokenizer,
            metrics={"heldout_sampled_accuracy": ends[arm]["sampled"]},
            description=f"{arm} policy of benchmarks/rl_heldout.py ({args.rl_steps} steps)",
        )  # fmt: skip
        ends[arm]["per_difficulty"] = {
            str(d): summary({k: [v[i] for i in ix] for k, v in scores.items()},
                            {k: [v[i] for i in ix] for k, v in base.items()})
            for d, ix in by_level.items()
        }  # fmt: skip
        curves[arm] = curve(out / f"rl_{arm}_s{args.seed}", val_start)
        log(f"{arm}: {ends[arm]}")
    result["end"] = ends
    main_arm = next((a for a in ("gspo", "grpo") if a in ends), None)
    result["heldout_accuracy_start"] = {k: result["start"][k] for k in ("greedy", "sampled")}
    if main_arm:
        result["heldout_accuracy_end"] = {k: ends[main_arm][k] for k in ("greedy", "sampled")}
        result["heldout_arm"] = main_arm
    if "control" in ends:
        result["heldout_accuracy_control_end"] = {k: ends["control"][k] for k in ("greedy", "sampled")}
    result["curves"] = curves
    result["timings"] = timings
    result["machine"] = info
    if args.plot:
        plot(curves, Path(args.plot), len(queries))
    emit(result)


if __name__ == "__main__":
    main()
