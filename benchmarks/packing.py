"""Padding and step time of the demo's batches packed in order against first-fit decreasing.

`make demo`'s unified stage packs 16 documents a batch (captions of ~17 positions, caption to image ~106,
speech ~70-90, image to caption ~20) into rows of 256. In order, a row closes when the next document does not
fit, so a batch computes the padding of every row it closes early. First-fit decreasing
(`SequenceBuilder.packing`) lays the same documents in fewer rows. Both packings of each batch are timed in
the same run, interleaved: one training step's forward and backward of the config's model (the frozen
tokenizers, codec and encoder built from the config, weights left out: timing does not depend on them), and
the losses of the two packings are compared (`max_loss_gap`: float noise, since documents never attend
across rows or each other).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/packing.py

Prints one JSON line: rows and padding share per batch under each packing over `--batches` training
batches, and the median step seconds of each over `--timed` of them, with `ffd_step_speedup`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, emit, log, machine_info, shapes_demo_config, time_interleaved  # noqa: E402

from zoo.datamodules.sequence import PACKINGS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/demo/multimodal.yaml")
    parser.add_argument("--batches", type=int, default=200, help="training batches whose padding is counted")
    parser.add_argument("--timed", type=int, default=6, help="of them, batches whose step is timed")
    add_common_args(parser, repeats=3)
    args = parser.parse_args()
    info = machine_info(args.threads)
    torch.manual_seed(args.seed)
    from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule
    from zoo.publishing.building import build_from_config, without_construction_only

    data_args, model_config = shapes_demo_config(args.config)
    data = ShapesMultimodalDataModule(**data_args)
    model = build_from_config(without_construction_only(model_config), where="model")
    data.setup("fit")
    dataset, builder = data.datasets["train"], data.builder
    size = data.batch_size
    batches = [[dataset[(i, 0)] for i in range(b * size, (b + 1) * size)] for b in range(args.batches)]

    stats: dict[str, dict[str, float]] = {}
    for packing in PACKINGS:
        builder.packing = packing
        rows = [len(builder.pack(docs)) for docs in batches]
        tokens = [sum(builder.length(d) for d in docs) for docs in batches]
        padding = [1 - t / (r * builder.seq_len) for t, r in zip(tokens, rows, strict=True)]
        stats[packing] = {"rows_per_batch": statistics.mean(rows), "padding_share": statistics.mean(padding)}
        log(f"{packing}: {stats[packing]}")

    model.train()

    def step(packing: str, docs: list) -> float:
        builder.packing = packing
        batch = builder.collate(docs)
        model.zero_grad(set_to_none=True)
        loss = model(batch).loss
        loss.backward()
        return loss.item()

    timed = batches[: args.timed]
    variants = {p: (lambda p=p: [step(p, docs) for docs in timed]) for p in PACKINGS}
    medians, losses, spread = time_interleaved(variants, args.warmup, args.repeats)
    loss_gap = max(abs(a - b) for a, b in zip(*losses.values(), strict=True))
    emit(
        {
            "benchmark": "packing",
            "config": args.config,
            "batch_documents": size,
            "seq_len": builder.seq_len,
            **{f"{p}_{k}": round(v, 4) for p, s in stats.items() for k, v in s.items()},
            **{f"{p}_step_s": round(medians[p] / len(timed), 4) for p in PACKINGS},
            "ffd_step_speedup": round(medians["in_order"] / medians["first_fit_decreasing"], 3),
            "max_loss_gap": loss_gap,
            "timing_spread": spread,
            **info,
        }
    )


if __name__ == "__main__":
    main()
