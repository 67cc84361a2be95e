"""Benchmark of what a deferred build holds (zoo/meta_init.py; FSDP2's meta-device init, issue 17).

For one preset (default `small`), in a fresh process per arm, the host memory the C allocator has handed out
and not taken back (glibc's `mallinfo2`: heap in use plus separately mapped blocks; memory-mapped weight files
are not in it) after each step of building the model and loading a starting point into it with `init_from`
(an export of the same preset, written first with `save_pretrained`), then after materialising it:

    plain      `create_model` then `load_starting_weights`, as one process without FSDP does
    deferred   both inside `zoo.meta_init.deferred_init()`, as `zoo fit` does under parallel.fsdp; then
               `materialize` (one rank holding everything: the unsharded worst case)

The deferred arm should hold almost nothing until `materialize` (the peer the plain arm measures: about one
model's parameters); `allocated_deferred_over_plain_<preset>` is its allocation after `init_from` over the
plain arm's. Both arms' materialised weights are compared tensor for tensor (`same_weights`). Allocated
memory, not RSS, is what is reported: whether an allocated but untouched `torch.empty` is resident depends on
which pages the allocator hands out (resident RSS of the same build varied from 105 to 425 MB run to run).
Linux with glibc only. Progress goes to stderr; the last stdout line is one JSON object.

    .venv/bin/python benchmarks/meta_init.py [--preset small]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, log, machine_info  # noqa: E402

from zoo.hub import save_pretrained  # noqa: E402
from zoo.init_from import load_starting_weights  # noqa: E402
from zoo.meta_init import deferred_init, deferred_plan, materialize  # noqa: E402
from zoo.registry import create_model  # noqa: E402


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def allocated_mb() -> float:
    """Bytes glibc has handed out and not been given back: small-block heap in use plus mmapped blocks."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


def arm(args: argparse.Namespace) -> None:
    """One arm in this process: the allocation after each step, and a digest of the materialised weights."""
    torch.set_num_threads(1)
    start = allocated_mb()
    steps = {}
    torch.manual_seed(0)
    if args.arm == "plain":
        model = create_model(args.preset)
        steps["built"] = allocated_mb() - start
        load_starting_weights(model, args.source)
        steps["init_from"] = allocated_mb() - start
    else:
        with deferred_init():
            model = create_model(args.preset)
            steps["built"] = allocated_mb() - start
            load_starting_weights(model, args.source)
            steps["init_from"] = allocated_mb() - start
        materialize(model, deferred_plan(model))
    steps["materialised"] = allocated_mb() - start
    torch.save(model.state_dict(), args.weights_out)
    print(json.dumps({k: round(v, 1) for k, v in steps.items()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--arm", choices=["plain", "deferred"], help=argparse.SUPPRESS)  # a worker process
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--weights-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        return arm(args)
    result: dict[str, object] = {"machine": machine_info(1), "preset": args.preset}
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(1)  # a starting point no seeded build of the arms draws
        source = create_model(args.preset)
        result["param_mb"] = round(sum(p.nbytes for p in source.parameters()) / 2**20, 1)
        save_pretrained(source, Path(tmp) / "source")
        del source
        weights = {}
        for name in ("plain", "deferred"):
            log(f"{args.preset}/{name}")
            weights[name] = str(Path(tmp) / f"{name}.pt")
            command = [sys.executable, __file__, "--preset", args.preset, "--arm", name]
            command += ["--source", str(Path(tmp) / "source"), "--weights-out", weights[name]]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            steps = json.loads(done.stdout.strip().splitlines()[-1])
            result.update({f"{name}_{step}_allocated_mb": mb for step, mb in steps.items()})
        plain, deferred = (torch.load(weights[n], weights_only=True) for n in ("plain", "deferred"))
        result["same_weights"] = list(plain) == list(deferred) and all(
            torch.equal(plain[k], deferred[k]) for k in plain
        )
    ratio = result["deferred_init_from_allocated_mb"] / result["plain_init_from_allocated_mb"]
    result[f"allocated_deferred_over_plain_{args.preset}"] = round(ratio, 4)
    emit(result)


if __name__ == "__main__":
    main()
