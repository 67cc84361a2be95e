"""The elastic table of ERNIE 5.0 at tiny scale (issue 7 item 2): one unified model trained with elastic
sampling and the same model trained without it, then a grid of sub-models of each.

Both runs come from one YAML (default: `configs/pretrain/shapes_image.yaml`, text + caption-to-image +
image-to-caption on ShapesWorld) built by the zoo's own LightningCLI, so they are the runs a user gets
from `zoo fit`; the only difference is `--model.init_args.elastic` (the config's `ElasticSampler`, or
null). Same seed, so both start from the same weights and see the same data. For every sub-model of
the grid (depth, width = routed experts kept, top-k), extracted as a standalone model:

    params_total / params_active   what it costs to store and to run per token
    val_loss                       the training objective (every head, no router terms) on the same
                                   validation batches
    caption_to_image, image_to_caption
                                   ShapesWorld verifier attribute accuracy (zoo.tasks.multimodal_eval:
                                   generated images read back from pixels; greedy captions parsed)
    decode_tps                     greedy caption tokens/s at batch 1 with the KV cache

Repeated over `--seeds`; the JSON line holds per-seed values and the mean and standard deviation of each
cell. Progress on stderr; the last stdout line is the JSON object.

    .venv/bin/python benchmarks/elastic_table.py \
        --tokenizer-weights runs/visual_2d/latest/visual_tokenizer.safetensors \
        [--steps 500 --seeds 0 1 2 --scenes 32 --markdown table.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, emit, log, machine_info  # noqa: E402

from zoo.batch import GroupBatch  # noqa: E402
from zoo.cli import ZooCLI  # noqa: E402
from zoo.models.elastic import ElasticConfig  # noqa: E402
from zoo.models.unified import UnifiedModel  # noqa: E402
from zoo.tasks.multimodal_eval import evaluate  # noqa: E402

# name -> fractions of (depth, width, top-k); the tiny backbone has 4 layers, 16 experts, top-4.
GRID: dict[str, dict[str, float]] = {
    "full": {},
    "topk50": {"topk": 0.5},
    "topk25": {"topk": 0.25},
    "width50": {"width": 0.5},
    "depth75": {"depth": 0.75},
    "depth75_width50_topk50": {"depth": 0.75, "width": 0.5, "topk": 0.5},
}
TASKS = {"caption_to_image": "text_to_image", "image_to_caption": "image_to_text"}


def train(
    config: str, seed: int, steps: int, elastic: bool, tokenizer_weights: str | None, root: str
) -> ZooCLI:
    """`zoo fit --config CONFIG` for `steps` steps, without checkpoints, logger or gallery."""
    args = [
        "--config", config,
        f"--seed_everything={seed}",
        f"--trainer.max_steps={steps}",
        f"--trainer.default_root_dir={root}",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.callbacks=[{class_path: zoo.tasks.callbacks.ExpertBiasUpdate}]",
    ]  # fmt: skip
    if tokenizer_weights:
        args.append(f"--model.init_args.model.init_args.visual_tokenizer.init_args.weights={tokenizer_weights}")
    if not elastic:
        args.append("--model.init_args.elastic=null")
    argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when it sees this script's own flags
    try:
        cli = ZooCLI(args=args, run=False)
    finally:
        sys.argv = argv
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    cli.model.model.eval()
    return cli


@torch.no_grad()
def validation_loss(model: UnifiedModel, batches: list[GroupBatch]) -> float:
    """Mean over batches of the heads' losses (text NTP + MTP, NFSP): the objective without router terms."""
    return statistics.fmean(float(sum(h.loss for h in model(b).heads.values())) for b in batches)


def decode_tps(model: UnifiedModel, prompt: list[int], tokens: int, repeats: int) -> float:
    model.generate([prompt], 2, temperature=0, stop_ids=())  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.generate([prompt], tokens, temperature=0, stop_ids=())
        times.append(time.perf_counter() - start)
    return tokens / statistics.median(times)


def measure(cli: ZooCLI, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    model: UnifiedModel = cli.model.model
    data = cli.datamodule
    data.setup("validate")
    batches = list(islice(iter(data.val_dataloader()), args.val_batches))
    backbone = model.backbone
    prompt = data.prompt_ids("")
    rows: dict[str, dict[str, float]] = {}
    for name, fractions in GRID.items():
        shape = (backbone.n_layers, backbone.n_experts, backbone.top_k)
        config = ElasticConfig.from_fractions(*shape, **fractions)
        sub = model.extract(config).eval()
        scores = evaluate(sub, data, n=args.scenes, tasks=list(TASKS.values()), seed=args.seed)
        rows[name] = {
            "params_total": sub.num_parameters(),
            "params_active": sub.num_parameters(active=True),
            "val_loss": validation_loss(sub, batches),
            **{k: scores.metrics[f"{task}/attribute_accuracy"] for k, task in TASKS.items()},
            "decode_tps": decode_tps(sub, prompt, args.decode_tokens, args.repeats),
        }
        log(f"    {name:<24} {config.describe(*shape)}: "
            + ", ".join(f"{k} {v:.4g}" for k, v in rows[name].items()))
    return rows


def summarise(runs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Mean and standard deviation over seeds of every cell."""
    out: dict[str, dict[str, float]] = {}
    for name in runs[0]:
        for key in runs[0][name]:
            values = [run[name][key] for run in runs]
            out.setdefault(name, {})[key] = round(statistics.fmean(values), 4)
            out[name][f"{key}_std"] = round(statistics.stdev(values), 4) if len(values) > 1 else 0.0
    return out


def markdown(summary: dict[str, dict[str, dict[str, float]]], seeds: int) -> str:
    lines = [
        "| sub-model | total params | active params | val loss, elastic | val loss, no elastic | "
        "caption to image, elastic | no elastic | image to caption, elastic | no elastic "
        "| decode tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    el, base = summary["elastic"], summary["no_elastic"]

    def cell(row: dict[str, float], key: str, digits: int = 3) -> str:
        spread = f" ± {row[key + '_std']:.{digits}f}" if seeds > 1 else ""
        return f"{row[key]:.{digits}f}{spread}"

    for name in el:
        lines.append(
            f"| {name} | {el[name]['params_total']:,.0f} | {el[name]['params_active']:,.0f} | "
            f"{cell(el[name], 'val_loss')} | {cell(base[name], 'val_loss')} | "
            f"{cell(el[name], 'caption_to_image')} | {cell(base[name], 'caption_to_image')} | "
            f"{cell(el[name], 'image_to_caption')} | {cell(base[name], 'image_to_caption')} | "
            f"{el[name]['decode_tps']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="configs/pretrain/shapes_image.yaml")
    parser.add_argument("--tokenizer-weights", default=None, help="the visual tokenizer the config expects")
    parser.add_argument("--steps", type=int, default=500, help="optimiser steps of each training run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--scenes", type=int, default=32, help="ShapesWorld scenes per verifier task")
    parser.add_argument("--val-batches", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    add_common_args(parser, repeats=5)
    args = parser.parse_args()

    info = machine_info(args.threads)
    log(f"machine: {info}")
    wall = time.perf_counter()
    per_seed: dict[str, list[dict[str, dict[str, float]]]] = {"elastic": [], "no_elastic": []}
    with tempfile.TemporaryDirectory(prefix="zoo-elastic-table-") as root:
        for seed in args.seeds:
            for mode in per_seed:
                log(f"seed {seed}: training {args.steps} steps, {mode.replace('_', ' ')}")
                cli = train(args.config, seed, args.steps, mode == "elastic", args.tokenizer_weights, root)
                per_seed[mode].append(measure(cli, args))
                del cli
    summary = {mode: summarise(runs) for mode, runs in per_seed.items()}

    def smallest_gap(mode: str) -> float:
        """How much the cheapest sub-model of the grid loses against the full model."""
        rows = summary[mode]
        return round(rows["depth75_width50_topk50"]["val_loss"] - rows["full"]["val_loss"], 4)

    result = {
        "benchmark": "elastic_table",
        "config": args.config,
        "steps": args.steps,
        "seeds": args.seeds,
        "scenes": args.scenes,
        "summary": summary,
        "per_seed": per_seed,
        "smallest_val_loss_gap_elastic": smallest_gap("elastic"),
        "smallest_val_loss_gap_no_elastic": smallest_gap("no_elastic"),
        "wall_s": round(time.perf_counter() - wall, 1),
        "machine": info,
    }
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(markdown(summary, len(args.seeds)))
    emit(result)


if __name__ == "__main__":
    main()
