"""Seconds per training step of the demo's unified stage, media tokenized by the model or in the loader.

`make demo`'s stage 4 renders ShapesWorld scenes and speech on the training process, and the model encodes
them there with its frozen visual tokenizer and audio codec every step. This times one training step
(forward, backward, AdamW) of the config's model on the config's batches, the first batch of each run left
untimed, four ways, interleaved in rounds:

    model_encodes           no loader worker, the model tokenizes (the demo's set-up), at `--threads`
    model_encodes_2_threads the same with two torch threads (what `make demo` gets on two cores)
    worker_renders          one loader worker renders and collates, the model tokenizes
    worker_tokenizes        one loader worker renders, tokenizes (`tokenize_in_loader`) and collates

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/loader_tokenizing.py   # after make demo's stages 1-3

Needs the trained tokenizer and codec the config names (an untrained codec's codebooks are refused).
Prints one JSON line: median seconds per step of each, `worker_tokenizes_speedup` over the demo's own
set-up (two threads, no worker) and `worker_tokenizes_over_one_thread` over the first arm.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, emit, log, machine_info, shapes_demo_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/demo/multimodal.yaml")
    parser.add_argument("--steps", type=int, default=24, help="timed training steps per run")
    add_common_args(parser, repeats=3)
    args = parser.parse_args()
    info = machine_info(args.threads)
    torch.manual_seed(args.seed)
    from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule
    from zoo.publishing.building import build_from_config

    data_args, model_config = shapes_demo_config(args.config)
    model = build_from_config(model_config, where="model")
    model.train()
    plain, tokenizing = ShapesMultimodalDataModule(**data_args), ShapesMultimodalDataModule(**data_args)
    plain.setup("fit")
    tokenizing.tokenizer = plain.tokenizer
    tokenizing.tokenize_with(model.visual_tokenizer, model.audio_codec)
    tokenizing.setup("fit")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    size, n = plain.batch_size, len(plain.datasets["train"])

    def run(data: ShapesMultimodalDataModule, workers: int, threads: int, first: int) -> float:
        """Seconds per training step over `--steps` batches of documents `first`, `first + 1`, ..."""
        keys = [(i % n, 0) for i in range(first, first + (args.steps + 1) * size)]
        loader = DataLoader(
            data.loader_dataset("train"), batch_size=size, sampler=keys, collate_fn=data.builder.collate,
            num_workers=workers,
        )  # fmt: skip
        torch.set_num_threads(threads)
        batches = iter(loader)
        next(batches)  # a worker's start-up and the first batch are no step's cost
        began = time.perf_counter()
        for batch in batches:
            optimizer.zero_grad(set_to_none=True)
            model(batch).loss.backward()
            optimizer.step()
        elapsed = time.perf_counter() - began
        torch.set_num_threads(args.threads)
        return elapsed / args.steps

    arms = {
        "model_encodes": (plain, 0, args.threads),
        "model_encodes_2_threads": (plain, 0, 2),
        "worker_renders": (plain, 1, args.threads),
        "worker_tokenizes": (tokenizing, 1, args.threads),
    }
    names = list(arms)
    times: dict[str, list[float]] = {name: [] for name in names}
    log(f"{args.steps} timed steps a run, {len(arms)} arms, {args.warmup} + {args.repeats} rounds")
    for r in range(args.warmup + args.repeats):
        first = r * (args.steps + 1) * size  # every arm of a round trains on the same documents
        for name in names[r % len(names) :] + names[: r % len(names)]:  # the order rotates per round
            seconds = run(*arms[name], first)
            if r >= args.warmup:
                times[name].append(seconds)
        log(f"  round {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items() if v))
    medians = {name: statistics.median(t) for name, t in times.items()}
    spread = statistics.median((max(t) - min(t)) / medians[name] for name, t in times.items())
    emit(
        {
            "benchmark": "loader_tokenizing",
            "config": args.config,
            "steps_per_run": args.steps,
            **{f"{name}_step_s": round(s, 4) for name, s in medians.items()},
            "worker_tokenizes_speedup": round(
                medians["model_encodes_2_threads"] / medians["worker_tokenizes"], 3
            ),
            "worker_tokenizes_over_one_thread": round(
                medians["model_encodes"] / medians["worker_tokenizes"], 3
            ),
            "timing_spread": round(spread, 3),
            **info,
        }
    )


if __name__ == "__main__":
    main()
