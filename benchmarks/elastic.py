"""Benchmark of elastic training (zoo/models/elastic.py; ERNIE 5.0, "elastic depth, width and sparsity").

Trains the `tiny` preset on ShapesWorld captions with the real stack (UnifiedPretraining with an
ElasticSampler, ShapesDataModule, a Lightning Trainer with the expert-bias callback), then evaluates
named sub-models of the one set of weights:

    full      every layer, all experts, the default top-k
    topk25    top-k at 25% of the default (tiny: top-1 of 4)
    width50   the first half of the routed experts
    depth75   75% of the layers (the last one always kept)

For each: the validation NTP loss (token-weighted over the same val batches; MTP and router terms left
out so they do not blur the comparison), greedy batch-1 decode tokens/s with the KV cache both running
the full model with `elastic=config` ("masked") and the physically smaller `model.extract(config)`
("extracted"), and its total and active parameters. The same number of steps without elastic
sampling, from the same initial weights and data order, is the baseline (`--no-baseline` skips it):
its sub-model losses show what elastic training buys. Decode variants run interleaved after a
warm-up; the median of the repeats is reported. Progress goes to stderr; the last stdout line is
one JSON object.

    .venv/bin/python benchmarks/elastic.py [--steps 300 --no-baseline --save-checkpoint runs/elastic.ckpt]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, emit, log, machine_info, time_interleaved  # noqa: E402

from zoo.batch import GroupBatch  # noqa: E402
from zoo.datamodules.shapes_data import ShapesDataModule  # noqa: E402
from zoo.models.elastic import ElasticConfig, ElasticSampler  # noqa: E402
from zoo.models.unified import UnifiedModel  # noqa: E402
from zoo.registry import create_model  # noqa: E402
from zoo.tasks.callbacks import ExpertBiasUpdate  # noqa: E402
from zoo.tasks.pretrain import UnifiedPretraining  # noqa: E402

TOPK25_DECODE_TARGET = 1.15  # the paper: top-k at 25% decodes over 15% faster
SUB_MODELS = {"topk25": dict(topk=0.25), "width50": dict(width=0.5), "depth75": dict(depth=0.75)}


def train(
    args: argparse.Namespace, elastic: bool, root: str
) -> tuple[UnifiedPretraining, ShapesDataModule, L.Trainer]:
    """Same seed, so the elastic run and the baseline start from the same weights and see the same data."""
    L.seed_everything(args.seed, verbose=False)
    torch.manual_seed(args.seed)
    model = create_model(args.preset)
    module = UnifiedPretraining(
        model=model,
        elastic=ElasticSampler(seed=args.seed) if elastic else None,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
    )
    data = ShapesDataModule(
        vocab=model.vocab, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed
    )
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ExpertBiasUpdate()],
        gradient_clip_val=1.0,
        limit_val_batches=0,  # evaluated below, per sub-model
        num_sanity_val_steps=0,
        default_root_dir=root,
    )
    trainer.fit(module, datamodule=data)
    module.model.eval()
    return module, data, trainer


@torch.no_grad()
def val_loss(model: UnifiedModel, batches: list[GroupBatch], config: ElasticConfig | None) -> float:
    """Token-weighted mean next-token loss over `batches`."""
    total = tokens = 0.0
    for batch in batches:
        metrics = model(batch, elastic=config).heads["text"].metrics
        n = float(metrics["text/tokens"])
        total += float(metrics["text/ntp_loss"]) * n
        tokens += n
    return total / tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=300, help="optimiser steps of each training run")
    parser.add_argument("--batch-size", type=int, default=32, help="captions per batch")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=40)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--decode-batch", type=int, default=1, help="rows decoded at once")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run without elastic sampling")
    parser.add_argument("--save-checkpoint", default=None, help="write the elastic run's .ckpt here")
    add_common_args(parser, repeats=7)
    args = parser.parse_args()

    wall = time.perf_counter()
    info = machine_info(args.threads)
    log(f"machine: {info}")
    result: dict[str, object] = {"benchmark": "elastic", "model": args.preset, "steps": args.steps}
    root = tempfile.mkdtemp(prefix="zoo-bench-elastic-")

    log(f"training {args.preset} with elastic sampling for {args.steps} steps")
    start = time.perf_counter()
    module, data, trainer = train(args, elastic=True, root=root)
    result["train_s"] = round(time.perf_counter() - start, 1)
    result["train_loss_last"] = round(float(trainer.callback_metrics["loss"]), 4)
    if args.save_checkpoint:
        trainer.save_checkpoint(args.save_checkpoint)
        log(f"checkpoint written to {args.save_checkpoint}")
    model = module.model
    backbone = model.backbone
    n_layers, n_experts, top_k = backbone.n_layers, backbone.n_experts, backbone.top_k
    configs = {
        name: ElasticConfig.from_fractions(n_layers, n_experts, top_k, **f) for name, f in SUB_MODELS.items()
    }
    for name, config in configs.items():
        log(f"  {name}: {config.describe(n_layers, n_experts, top_k)}")
    val = list(islice(iter(data.val_dataloader()), args.val_batches))
    result["val_batches"] = len(val)
    extracted = {name: model.extract(config).eval() for name, config in configs.items()}

    # -- validation loss of every sub-model (and the extracted copies must agree with the masked runs) --
    result["val_loss_full"] = round(val_loss(model, val, None), 4)
    worst = 0.0
    for name, config in configs.items():
        masked = val_loss(model, val, config)
        worst = max(worst, abs(masked - val_loss(extracted[name], val, None)))
        result[f"val_loss_{name}"] = round(masked, 4)
    result["extract_val_loss_max_abs_diff"] = float(f"{worst:.2e}")

    # -- decode speed: full model, masked sub-models, extracted sub-models ------------------------------
    prompt = [data.prompt_ids("")] * args.decode_batch
    n = args.decode_tokens

    def decoder(m: UnifiedModel, config: ElasticConfig | None):
        return lambda: m.generate(prompt, n, temperature=0, stop_ids=(), elastic=config)

    variants = {"full": decoder(model, None)}
    for name, config in configs.items():
        variants[f"{name}_masked"] = decoder(model, config)
        variants[f"{name}_extracted"] = decoder(extracted[name], None)
    log(f"decoding {n} tokens, batch {args.decode_batch}, {len(variants)} variants, {args.repeats} rounds")
    seconds, outputs, spread = time_interleaved(variants, args.warmup, args.repeats)
    result["decode_tokens"] = n
    result["decode_timing_spread"] = spread
    result["decode_batch"] = args.decode_batch
    n_out = n * args.decode_batch
    result["decode_tps_full"] = round(n_out / seconds["full"], 1)
    outputs_match = True
    for name in configs:
        result[f"decode_tps_{name}_masked"] = round(n_out / seconds[f"{name}_masked"], 1)
        result[f"decode_tps_{name}_extracted"] = round(n_out / seconds[f"{name}_extracted"], 1)
        result[f"{name}_decode_speedup"] = round(seconds["full"] / seconds[f"{name}_extracted"], 3)
        result[f"{name}_masked_decode_speedup"] = round(seconds["full"] / seconds[f"{name}_masked"], 3)
        outputs_match &= outputs[f"{name}_masked"] == outputs[f"{name}_extracted"]
    result["extract_decode_outputs_match"] = outputs_match
    result["topk25_decode_target"] = TOPK25_DECODE_TARGET
    result["topk25_decode_meets_target"] = result["topk25_decode_speedup"] >= TOPK25_DECODE_TARGET

    # -- parameters ------------------------------------------------------------------------------------
    result["params_total_full"] = model.num_parameters()
    result["params_active_full"] = model.num_parameters(active=True)
    for name, sub in extracted.items():
        result[f"params_total_{name}"] = sub.num_parameters()
        result[f"params_active_{name}"] = sub.num_parameters(active=True)

    # -- the same training without elastic sampling ----------------------------------------------------
    if not args.no_baseline:
        del extracted
        log(f"baseline: training {args.preset} without elastic sampling for {args.steps} steps")
        start = time.perf_counter()
        base, _, base_trainer = train(args, elastic=False, root=root)
        result["train_s_no_elastic"] = round(time.perf_counter() - start, 1)
        result["train_loss_last_no_elastic"] = round(float(base_trainer.callback_metrics["loss"]), 4)
        result["val_loss_full_no_elastic"] = round(val_loss(base.model, val, None), 4)
        for name, config in configs.items():
            result[f"val_loss_{name}_no_elastic"] = round(val_loss(base.model, val, config), 4)

    shutil.rmtree(root, ignore_errors=True)
    result.update(info)
    result["repeats"] = args.repeats
    result["wall_s"] = round(time.perf_counter() - wall, 1)
    emit(result)


if __name__ == "__main__":
    main()
