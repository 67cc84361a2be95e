"""Ablations as a command (issue 7 item 3): one base config, variants swapped in YAML, several seeds, the
final validation metrics of every run with their mean and spread.

    zoo ablate --config configs/pretrain/shapes_image.yaml \
        --variant agnostic= --variant isolated=configs/experiments/routing_isolated.yaml \
        --seeds 0 1 2 --set trainer.max_steps=300 --out runs/ablations/routing

A variant is `name=overlay.yaml[,overlay2.yaml]` (nothing after `=`: the base as it is); overlays compose
on the base exactly as `zoo fit --config base --config overlay` does. `--set key=value` applies to every
run (`trainer.max_steps=300`). Each run trains with `seed_everything` = its seed and is then validated
once more, so every variant is scored on the same validation data by its own task's `validation_step`.

`--train-metrics train/entropy ...` adds, per logged training metric, the mean of its first and of its
last `--window` logged values (`train/entropy[first10]`, `train/entropy[last10]`): how a curve moved, for
metrics that validation does not compute (RL entropy, masked fractions). `OUT/curves.png` draws those
curves: per variant the mean over seeds (moving mean of `--window` steps) with the seeds' range as a band.

Runs write under `OUT/<variant>/seed<k>/` (CSV logs of the curves); checkpoint and gallery callbacks of
the base config are left out, so that runs never overwrite each other's or the base config's outputs.
`OUT/results.json` holds every run's metrics and the summary; `OUT/results.md` the table (mean ± sample
standard deviation over seeds). Runs already in `results.json` are not repeated (an interrupted ablation
resumes where it stopped).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from jsonargparse import Namespace

# Callbacks that write outside the run directory or only make pictures: not part of what is compared.
LEFT_OUT_CALLBACKS = (
    "ModelCheckpoint", "ZooCheckpoint", "MultimodalGallery", "GenerationWriter", "SampleGenerations"
)


@dataclass(frozen=True)
class Variant:
    name: str
    overlays: tuple[str, ...]

    @staticmethod
    def parse(text: str) -> Variant:
        """`name=a.yaml,b.yaml` or `name=`; overlay files must exist."""
        name, sep, files = text.partition("=")
        if not sep or not name.strip():
            raise SystemExit(f"--variant {text!r}: expected NAME=OVERLAY.yaml[,OVERLAY2.yaml] or NAME=")
        overlays = tuple(f.strip() for f in files.split(",") if f.strip())
        for overlay in overlays:
            if not Path(overlay).is_file():
                raise SystemExit(f"--variant {name}: overlay {overlay} does not exist")
        return Variant(name.strip(), overlays)


def _cli_class():  # imported lazily: `zoo --help` stays fast
    from zoo.cli.lightning_cli import ZooCLI

    class AblationCLI(ZooCLI):
        """ZooCLI that keeps every run inside its own directory (see LEFT_OUT_CALLBACKS) and logs CSV."""

        run_dir: str = ""

        def before_instantiate_classes(self) -> None:
            trainer = self.config["trainer"]
            callbacks = trainer.get("callbacks") or []
            trainer["callbacks"] = [
                c for c in callbacks if c["class_path"].rsplit(".", 1)[-1] not in LEFT_OUT_CALLBACKS
            ]
            trainer["enable_checkpointing"] = False
            trainer["default_root_dir"] = self.run_dir
            trainer["logger"] = Namespace(
                class_path="lightning.pytorch.loggers.CSVLogger",
                init_args=Namespace(save_dir=self.run_dir, name="logs", version=""),
            )

    return AblationCLI


def run_once(
    base: str,
    variant: Variant,
    seed: int,
    settings: list[str],
    run_dir: Path,
    train_metrics: tuple[str, ...] = (),
    window: int = 10,
) -> dict[str, float]:
    """Train one variant at one seed, validate it, return its validation metrics (and the first/last
    window means of `train_metrics` from its CSV log)."""
    args = ["--config", base]
    for overlay in variant.overlays:
        args += ["--config", overlay]
    args += [f"--seed_everything={seed}", *(f"--{s}" for s in settings)]
    cli_class = _cli_class()
    cli_class.run_dir = str(run_dir)
    cli = cli_class(args=args, run=False)  # ZooCLI runs with sys.argv = args: no LightningCLI `args` warning
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    metrics = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    result = {k: float(v) for k, v in (metrics[0] if metrics else {}).items()}
    return result | curve_ends(run_dir / "logs" / "metrics.csv", train_metrics, window)


def curve_ends(path: Path, keys: tuple[str, ...], window: int) -> dict[str, float]:
    """`key[firstN]` and `key[lastN]`: means of the first and last N logged values of each key."""
    if not keys:
        return {}
    with path.open() as f:
        rows = list(csv.DictReader(f))
    out = {}
    for key in keys:
        values = [float(row[key]) for row in rows if row.get(key) not in (None, "")]
        if not values:
            known = sorted({k for row in rows for k, v in row.items() if v not in (None, "")})
            raise SystemExit(f"--train-metrics {key}: never logged in {path} (logged: {known})")
        out[f"{key}[first{window}]"] = statistics.fmean(values[:window])
        out[f"{key}[last{window}]"] = statistics.fmean(values[-window:])
    return out


def summarise(runs: dict[str, dict[str, dict[str, float]]]) -> dict[str, dict[str, dict[str, float]]]:
    """variant -> metric -> {mean, std, n} over the seeds that ran."""
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for name, by_seed in runs.items():
        keys = sorted({k for metrics in by_seed.values() for k in metrics})
        for key in keys:
            values = [m[key] for m in by_seed.values() if key in m]
            summary.setdefault(name, {})[key] = {
                "mean": statistics.fmean(values),
                "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                "n": len(values),
            }
    return summary


def table(summary: dict[str, dict[str, dict[str, float]]], metrics: list[str] | None) -> str:
    keys = metrics or sorted({k for by_metric in summary.values() for k in by_metric})
    lines = ["| variant | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name, by_metric in summary.items():
        cells = []
        for key in keys:
            s = by_metric.get(key)
            cells.append("-" if s is None else f"{s['mean']:.4f} ± {s['std']:.4f} (n={s['n']})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_curves(out: Path, variants: list[str], seeds: list[int], keys: tuple[str, ...], window: int) -> Path:
    """OUT/curves.png: each training metric against the step, per variant the mean over seeds with their
    range as a band (each seed's curve smoothed by a moving mean of `window` logged values)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), squeeze=False)
    for colour, name in enumerate(variants):
        for ax, key in zip(axes[0], keys, strict=True):
            curves = []
            for seed in seeds:
                path = out / name / f"seed{seed}" / "logs" / "metrics.csv"
                if not path.is_file():
                    continue
                with path.open() as f:
                    points = [(int(r["step"]), float(r[key])) for r in csv.DictReader(f) if r.get(key)]
                if points:
                    steps, values = zip(*points, strict=True)
                    smooth = np.convolve(values, np.ones(window) / window, mode="valid")
                    curves.append((np.asarray(steps[window - 1 :]), smooth))
            if not curves:
                continue
            n = min(len(c[1]) for c in curves)
            stack = np.stack([c[1][:n] for c in curves])
            steps = curves[0][0][:n]
            ax.plot(steps, stack.mean(0), color=f"C{colour}", label=f"{name} ({len(curves)} seeds)")
            ax.fill_between(steps, stack.min(0), stack.max(0), color=f"C{colour}", alpha=0.2, lw=0)
            ax.set_title(key, fontsize=9)
            ax.set_xlabel("step")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path = out / "curves.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="zoo ablate",
        description=__doc__.split("\n\n")[0],
        epilog="Unlike the other extra commands, `zoo ablate` takes no file of its own options and has no "
        "--print_config: its --config is the base training config of every run (as `zoo fit --config`), and "
        "`zoo fit --config BASE --config OVERLAY --print_config` prints what one variant trains.",
    )
    parser.add_argument("--config", required=True, help="the base config (a full model + data config)")
    parser.add_argument("--variant", action="append", required=True, help="NAME=OVERLAY.yaml[,...] or NAME=")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE for every run")
    parser.add_argument("--metrics", nargs="*", default=None, help="metrics shown in the table (default all)")
    parser.add_argument("--out", required=True, help="directory for runs and results")
    parser.add_argument(
        "--train-metrics", nargs="*", default=[], help="logged training metrics: first/last window means"
    )
    parser.add_argument("--window", type=int, default=10, help="logged values per window (--train-metrics)")
    args = parser.parse_args(argv)
    if not Path(args.config).is_file():
        raise SystemExit(f"--config {args.config} does not exist")
    variants = [Variant.parse(v) for v in args.variant]
    if len({v.name for v in variants}) != len(variants):
        raise SystemExit("--variant names must be distinct")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    saved = json.loads(results_path.read_text()) if results_path.exists() else {}
    runs: dict[str, dict[str, dict[str, float]]] = saved.get("runs", {})
    total = len(variants) * len(args.seeds)
    done = 0
    for seed in args.seeds:  # seed-major: a stopped ablation has every variant at the seeds it finished
        for variant in variants:
            done += 1
            if str(seed) in runs.get(variant.name, {}):
                print(f"[{done}/{total}] {variant.name} seed {seed}: already in {results_path}", flush=True)
                continue
            print(f"[{done}/{total}] {variant.name} seed {seed} ...", flush=True)
            start = time.perf_counter()
            run_dir = out / variant.name / f"seed{seed}"
            metrics = run_once(
                args.config, variant, seed, args.set, run_dir, tuple(args.train_metrics), args.window
            )
            runs.setdefault(variant.name, {})[str(seed)] = metrics
            summary = summarise(runs)
            results_path.write_text(json.dumps(
                {"config": args.config, "variants": {v.name: list(v.overlays) for v in variants},
                 "settings": args.set, "runs": runs, "summary": summary}, indent=2,
            ) + "\n")
            print(f"[{done}/{total}] {variant.name} seed {seed}: {time.perf_counter() - start:.0f} s, "
                  + ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())), flush=True)
    text = table(summarise(runs), args.metrics)
    if args.train_metrics:
        names = [v.name for v in variants]
        print(f"wrote {plot_curves(out, names, args.seeds, tuple(args.train_metrics), args.window)}")
    (out / "results.md").write_text(text)
    print(text)
