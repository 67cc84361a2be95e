"""What the data pipeline delivers and what it costs (issue 14, "How it is measured").

Measurements, each a function returning JSON keys (run all, or some with `--only`):
- `stream_rss`: a corpus of WebDataset tar shards `--factor` times larger than `--budget-mb` is streamed
  through the streaming core (`zoo.datamodules.streaming`: partition, shuffle buffer, `map`, batches) in a
  fresh subprocess; `stream_rss_growth` is its peak RSS at the end over its peak RSS after the first tenth
  of the batches (target <= 1.2: memory stays flat however large the corpus). The shuffle buffer holds a
  quarter of the budget; `map` reads every byte of a sample (a stand-in for decoding). The stream runs in
  the main process (`num_workers=0`), where RSS covers all of it.

- `throughput` (`_throughput.py`): documents/s and tokens/s delivered by (a) raw media decoded and
  tokenized on the fly and (b) code shards, at 0 and `--workers` workers, beside the training consumption
  (tokens/s of a train step) of the `tiny` and `small` presets measured in the same run
  (`shards_over_small_consumption`, target >= 3), and `zoo tokenize` images/s and audio seconds/s, on a
  ShapesWorld corpus the benchmark writes as tar shards.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/data_pipeline.py --budget-mb 128
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/data_pipeline.py --only throughput --throughput-samples 512

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, git_revision, log  # noqa: E402
from _throughput import add_arguments, measure_throughput  # noqa: E402

SAMPLE_BYTES = 256 * 1024


def write_corpus(folder: Path, total_bytes: int, shards: int) -> int:
    """Tar shards of incompressible samples (`bin`: SAMPLE_BYTES random bytes, `txt`: a caption)."""
    import webdataset as wds

    samples = max(shards, total_bytes // SAMPLE_BYTES)
    with wds.ShardWriter(str(folder / "shard-%05d.tar"), maxcount=-(-samples // shards), verbose=0) as sink:
        for i in range(samples):
            sink.write({"__key__": f"s{i:07d}", "bin": os.urandom(SAMPLE_BYTES), "txt": f"sample {i}"})
    return samples


def checksum(sample: dict) -> int:
    """The benchmark's `map`: touches every byte, as a decoder would."""
    return zlib.crc32(sample["bin"])


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def stream_child(folder: str, buffer: int, batch_size: int) -> None:
    """In the subprocess: stream the corpus once, printing peak RSS after a tenth and at the end."""
    from zoo.datamodules.shards import TarSamples, count_shards
    from zoo.datamodules.streaming import StreamDataset, StreamLoader

    urls = sorted(str(p) for p in Path(folder).glob("*.tar"))
    dataset = StreamDataset(count_shards(urls, TarSamples()), TarSamples(), checksum, shuffle_buffer=buffer)
    loader = StreamLoader(dataset, list, batch_size)
    tenth, first_tenth, samples = max(1, len(loader) // 10), 0.0, 0
    for i, batch in enumerate(loader, start=1):
        samples += len(batch)
        if i == tenth:
            first_tenth = peak_rss_mb()
    print(json.dumps({"first_tenth_mb": first_tenth, "end_mb": peak_rss_mb(), "samples": samples}))


def measure_stream_rss(args: argparse.Namespace) -> dict[str, object]:
    budget = args.budget_mb * 2**20
    buffer = max(1, budget // 4 // SAMPLE_BYTES)
    with tempfile.TemporaryDirectory(dir=args.tmp) as folder:
        log(f"writing a {args.factor * args.budget_mb} MB corpus to {folder}")
        samples = write_corpus(Path(folder), args.factor * budget, args.shards)
        log(f"streaming {samples} samples with a shuffle buffer of {buffer} in a subprocess")
        command = [sys.executable, __file__, "--child-stream", folder, "--buffer", str(buffer)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
    child = json.loads(done.stdout.strip().splitlines()[-1])
    if child["samples"] != samples // args.batch_size * args.batch_size:
        raise RuntimeError(f"streamed {child['samples']} of {samples} samples")
    return {
        "stream_rss_growth": round(child["end_mb"] / child["first_tenth_mb"], 3),
        "stream_rss_first_tenth_mb": round(child["first_tenth_mb"], 1),
        "stream_rss_end_mb": round(child["end_mb"], 1),
        "stream_corpus_mb": round(samples * SAMPLE_BYTES / 2**20, 1),
        "stream_budget_mb": args.budget_mb,
        "stream_samples": child["samples"],
    }


MEASUREMENTS: dict[str, Callable[[argparse.Namespace], dict[str, object]]] = {
    "stream_rss": measure_stream_rss,
    "throughput": measure_throughput,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(MEASUREMENTS), help="run only these")
    parser.add_argument("--budget-mb", type=int, default=128, help="the memory budget the corpus exceeds")
    parser.add_argument("--factor", type=int, default=10, help="corpus size over the budget")
    parser.add_argument("--shards", type=int, default=16, help="tar shards the corpus is written as")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--tmp", default=None, help="where to write the corpus (default: the system's)")
    add_arguments(parser)
    parser.add_argument("--child-stream", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--buffer", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_stream:
        stream_child(args.child_stream, args.buffer, args.batch_size)
        return
    result: dict[str, object] = {"benchmark": "data_pipeline", "git": git_revision()}
    for name in args.only or MEASUREMENTS:
        log(f"measuring {name}")
        result.update(MEASUREMENTS[name](args))
    emit(result)


if __name__ == "__main__":
    main()
