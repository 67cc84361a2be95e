"""Benchmark of the dual-path vision encoder (zoo/models/vision.py): the ablation of issue 3 item 4.

Pretrains four encoders on ShapesWorld with `zoo fit` from their configs, the same steps and seed:
dual path with the attention merger (configs/vision/encoder_dual.yaml, the baseline), CNN only, ViT only,
and dual path with the plain 2x2 MLP merger. Reports held-out val figures after training (attribute
accuracy per attribute over occupied cells, occupancy, ShapesWorld's verifier score of the objects read
from the head, in-batch caption retrieval) as ratios to the dual encoder, plus encoder forward images/s
timed interleaved in this process. The runs go side by side (`--parallel`, default), so that the noise of a
shared machine hits all alike; their wall time is not compared. Progress on stderr; the last stdout line is
one JSON object.

    .venv/bin/python benchmarks/vision_encoder.py [--steps 300 --out /tmp/vision_encoder_bench --plot P]
    .venv/bin/python benchmarks/vision_encoder.py --summarize-only --out DIR   # runs already in DIR
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, emit, log, machine_info, time_interleaved  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("dual", "cnn_only", "vit_only", "mlp_merger")
FIGURES = (
    "val/colour_acc", "val/shape_acc", "val/size_acc", "val/occupied_acc",
    "val/scene_attribute_accuracy", "val/scene_exact", "val/retrieval_i2t", "val/retrieval_t2i",
)  # fmt: skip


def fit_command(variant: str, steps: int, val_every: int) -> list[str]:
    zoo = str(Path(sys.executable).with_name("zoo"))
    return [
        zoo, "fit", "--config", str(REPO / "configs" / "vision" / f"encoder_{variant}.yaml"),
        f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={val_every}",
        "--trainer.enable_progress_bar=false", "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.init_args.save_dir=csv_{variant}",
    ]  # fmt: skip


def run_all(out: Path, steps: int, val_every: int, parallel: bool) -> None:
    """`zoo fit` per variant in `out` (relative run folders of the configs land there)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    for v in VARIANTS:
        command = fit_command(v, steps, val_every)
        log(f"[{v}] {' '.join(command)}")
        with open(out / f"log_{v}.txt", "w") as handle:
            proc = subprocess.Popen(command, cwd=out, env=env, stdout=handle, stderr=subprocess.STDOUT)
        if not parallel:
            proc.wait()
        procs.append((v, proc))
    for v, proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"[{v}] zoo fit failed (exit {proc.returncode}); see {out / f'log_{v}.txt'}")


def final_figures(out: Path, variant: str) -> dict[str, float]:
    """The last validation row of the variant's CSV log, plus the step it was taken at."""
    files = sorted((out / f"csv_{variant}").rglob("metrics.csv"))
    if not files:
        raise SystemExit(f"no metrics.csv under {out / f'csv_{variant}'}: did `zoo fit` run there?")
    rows = [r for r in csv.DictReader(files[-1].open()) if r.get("val/colour_acc")]
    if not rows:
        raise SystemExit(f"{files[-1]} holds no validation row")
    last = rows[-1]
    return {"step": int(last["step"]), **{k.removeprefix("val/"): round(float(last[k]), 4) for k in FIGURES}}


def encoder_throughput(threads: int, repeats: int) -> dict[str, float]:
    """Encoder forward images/s per variant (batch 32, no grad), interleaved."""
    from zoo.cli import ZooCLI

    encoders = {}
    for v in VARIANTS:
        config = REPO / "configs" / "vision" / f"encoder_{v}.yaml"
        cli = ZooCLI(args=["--config", str(config), "--trainer.logger=false"], run=False)
        encoders[v] = cli.model.encoder.eval()
    torch.set_num_threads(threads)
    pixels = torch.rand(32, 3, 32, 32) * 2 - 1

    def forward(encoder: torch.nn.Module):  # noqa: ANN202
        def run() -> None:
            with torch.no_grad():
                encoder(pixels)

        return run

    seconds, _, spread = time_interleaved(
        {v: forward(e) for v, e in encoders.items()}, 2, repeats, "forward "
    )
    params = {v: sum(p.numel() for p in e.parameters()) for v, e in encoders.items()}
    return {
        **{f"{v}_images_per_s": round(32 / s, 1) for v, s in seconds.items()},
        **{f"{v}_params": n for v, n in params.items()},
        "forward_spread": spread,
    }


def plot(results: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [
        "colour_acc",
        "shape_acc",
        "size_acc",
        "occupied_acc",
        "scene_attribute_accuracy",
        "retrieval_i2t",
    ]
    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=100)
    width = 0.8 / len(results)
    for i, (variant, figures) in enumerate(results.items()):
        xs = [j + i * width for j in range(len(names))]
        ax.bar(xs, [figures[n] for n in names], width, label=variant)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))])
    ax.set_xticklabels([n.replace("_accuracy", "").replace("_acc", "") for n in names], fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("val accuracy")
    steps = next(iter(results.values()))["step"]
    ax.set_title(f"ShapesWorld val after {steps} steps (same seed)", fontsize=9)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    log(f"plot written to {path}")


def samples(out: Path, path: Path, count: int = 8) -> None:
    """Val images with the objects the dual encoder's head reads from them (green: exactly right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from zoo.datamodules.media_data import ShapesMediaDataModule
    from zoo.tasks.vision_encoder import VisionEncoderPretraining, predict_objects
    from zoo.world.scenes import score_objects

    ckpt = out / "runs" / "vision_encoder" / "dual" / "checkpoints" / "last.ckpt"
    task = VisionEncoderPretraining.load_from_checkpoint(ckpt, map_location="cpu").eval()
    step = torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]
    data = ShapesMediaDataModule(kind="image")
    pixels = torch.stack([data.render(i, "val")["pixels"] for i in range(count)])
    with torch.no_grad():
        predicted = predict_objects(task(pixels)[1])

    def short(objects) -> str:  # noqa: ANN001
        return "\n".join(f"{o.size[0]} {o.colour} {o.shape} ({o.row},{o.col})" for o in objects) or "nothing"

    fig, axes = plt.subplots(1, count, figsize=(1.6 * count, 2.6), dpi=100)
    for i, ax in enumerate(axes):
        scene = data.scene(i, "val")
        exact = score_objects(predicted[i], scene.objects).exact
        ax.imshow(((pixels[i].permute(1, 2, 0) + 1) / 2).clamp(0, 1).numpy(), interpolation="nearest")
        ax.set_xticks([]), ax.set_yticks([])
        ax.set_title(short(predicted[i]), fontsize=6, color="green" if exact else "red")
        ax.set_xlabel("true:\n" + short(scene.objects), fontsize=6)
    title = f"dual encoder, {ckpt.name} at step {step}: the head's objects above (green: exact), truth below"
    fig.suptitle(title, fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    log(f"samples written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(parser, repeats=5)
    parser.add_argument("--steps", type=int, default=300, help="training steps of every variant")
    parser.add_argument("--val_every", type=int, default=100, help="validation interval in steps")
    parser.add_argument("--out", type=Path, default=Path("/tmp/vision_encoder_bench"), help="run folder")
    parser.add_argument("--sequential", action="store_true", help="one run after the other")
    parser.add_argument("--summarize-only", action="store_true", help="read the runs already in --out")
    parser.add_argument("--plot", type=Path, default=None, help="write a bar chart PNG here")
    parser.add_argument("--samples", type=Path, default=None, help="write val samples of the dual run here")
    args = parser.parse_args()
    machine = machine_info(args.threads)
    if not args.summarize_only:
        run_all(args.out, args.steps, args.val_every, parallel=not args.sequential)
    results = {v: final_figures(args.out, v) for v in VARIANTS}
    steps = {r["step"] for r in results.values()}
    if len(steps) != 1:
        raise SystemExit(f"the variants' last validations are at different steps {steps}; rerun them alike")
    base = results["dual"]
    ratios = {
        f"{v}_vs_dual_{k}": round(r[k] / base[k], 3) if base[k] else None
        for v, r in results.items()
        if v != "dual"
        for k in ("colour_acc", "shape_acc", "size_acc", "scene_attribute_accuracy")
    }
    if args.plot is not None:
        plot(results, args.plot)
    if args.samples is not None:
        samples(args.out, args.samples)
    speed = encoder_throughput(args.threads, args.repeats)
    emit({"benchmark": "vision_encoder", "machine": machine, "val": results, **ratios, **speed})


if __name__ == "__main__":
    main()
