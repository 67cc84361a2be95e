"""Benchmark of `zoo serve` (issue 16, "How it is measured"): a server on localhost under 1, 8 and 32
concurrent `openai` clients.

The server runs `zoo serve` in a subprocess over a tiny random text model exported to a temporary folder
(or `--source`: a checkpoint, an export, a hub id), so that its resident memory can be read from /proc.
Per concurrency level: requests/s, p50 and p99 latency, generated tokens/s (from the answers' usage).
Then: server RSS before and after `--rss-requests` more requests (`rss_growth_mb`, target <= 50), and a burst
of more concurrent requests than the server's batch and queue hold, every one of which must be answered,
200 or 429, none hanging (`burst_all_answered`). Targets: `tokens_per_s_8_over_1` >= 4, `errors` == 0.

Untrained weights sample `<eos>` at random, so answers vary in length: tokens/s counts what was generated.
Progress goes to stderr; the last stdout line is one JSON object.

    .venv/bin/python benchmarks/serve.py [--requests 64 --max-tokens 64 --rss-requests 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, git_revision, log  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "bench"
PROMPTS = [
    "a small red circle at the top left",
    "a large blue square",
    "two green triangles",
    "a white cross",
]


def tiny_export(folder: Path, dim: int, layers: int) -> Path:
    """A random text-only unified model and a BPE tokenizer trained on a few captions, saved as an export."""
    import torch

    from zoo.hub import save_pretrained
    from zoo.models.backbone import UnifiedTransformer
    from zoo.models.unified import UnifiedModel
    from zoo.tokenizers.text import TextTokenizer
    from zoo.tokenizers.vocab import UnifiedVocab

    torch.manual_seed(0)
    vocab = UnifiedVocab(text_size=320, visual_size=64, audio_size=32, audio_levels=2)
    backbone = UnifiedTransformer(
        dim=dim,
        n_layers=layers,
        n_heads=4,
        n_kv_heads=2,
        n_experts=4,
        expert_hidden=dim,
        top_k=2,
        max_seq_len=512,
    )
    model = UnifiedModel(backbone, vocab, mtp_depth=0)
    tokenizer = TextTokenizer.train(PROMPTS * 8, vocab_size=vocab.text_size)
    return save_pretrained(model, folder / MODEL, tokenizer)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def start_server(source: str, port: int, args: argparse.Namespace) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    command = [
        sys.executable, "-m", "zoo.cli", "serve", source, "--port", str(port), "--model-name", MODEL,
        "--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue), "--max-tokens",
        str(args.max_tokens), "--log-level", "warning",
    ]  # fmt: skip
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log(process.stdout.readline().strip())
    return process


async def wait_healthy(client, process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}: {process.stdout.read()}")
        try:
            await client.models.list()
            return
        except Exception:  # not up yet
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def one_request(client, i: int, max_tokens: int) -> tuple[float, int, str]:
    """(latency s, tokens generated, outcome: "ok", "429" or the error)."""
    import openai

    start = time.perf_counter()
    try:
        answer = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            max_tokens=max_tokens, temperature=1.0,
        )  # fmt: skip
    except openai.RateLimitError:
        return time.perf_counter() - start, 0, "429"
    except Exception as error:  # counted in `errors`, never raised: the run goes on
        return time.perf_counter() - start, 0, f"{type(error).__name__}: {error}"
    return time.perf_counter() - start, answer.usage.completion_tokens, "ok"


async def level(client, concurrency: int, requests: int, max_tokens: int) -> tuple[dict, list[str]]:
    """`requests` requests by `concurrency` clients, each sending its next as soon as one is answered."""
    queue = list(range(requests))
    results: list[tuple[float, int, str]] = []

    async def worker() -> None:
        while queue:
            results.append(await one_request(client, queue.pop(), max_tokens))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    latencies = sorted(r[0] for r in results)
    tokens = sum(r[1] for r in results)
    row = {
        "concurrency": concurrency,
        "requests": requests,
        "requests_per_s": round(requests / wall, 2),
        "p50_latency_s": round(statistics.median(latencies), 4),
        "p99_latency_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 4),
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
    }
    log(f"  {concurrency:>2} clients: {row}")
    return row, [r[2] for r in results if r[2] != "ok"]


async def burst(client, size: int, max_tokens: int, seconds: float) -> tuple[bool, dict[str, int]]:
    """`size` requests at once: every one must come back (200 or 429) within `seconds`."""
    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(one_request(client, i, max_tokens) for i in range(size))), seconds
        )
    except TimeoutError:
        return False, {"hung": size}
    counts: dict[str, int] = {}
    for _, _, outcome in results:
        key = outcome if outcome in ("ok", "429") else "error"
        counts[key] = counts.get(key, 0) + 1
    return counts.get("error", 0) == 0 and counts.get("429", 0) > 0, counts


async def bench(args: argparse.Namespace, source: str) -> dict:
    import openai

    port = free_port()
    process = start_server(source, port, args)
    try:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120
        )
        await wait_healthy(client, process)
        await level(client, 1, 4, args.max_tokens)  # warm-up
        rows, errors = [], []
        for concurrency in (1, 8, 32):
            row, failed = await level(client, concurrency, max(args.requests, concurrency), args.max_tokens)
            rows.append(row)
            errors += failed
        before = rss_mb(process.pid)
        _, failed = await level(client, 8, args.rss_requests, args.max_tokens)
        errors += failed
        after = rss_mb(process.pid)
        log(f"  RSS {before:.1f} -> {after:.1f} MB over {args.rss_requests} requests")
        size = args.max_batch + args.max_queue + args.burst_extra
        answered, counts = await burst(client, size, args.max_tokens, args.burst_timeout)
        log(f"  burst of {size}: {counts}")
        by = {row["concurrency"]: row for row in rows}
        return {
            "levels": rows,
            "tokens_per_s_8_over_1": round(by[8]["tokens_per_s"] / max(by[1]["tokens_per_s"], 1e-9), 2),
            "errors": len(errors),
            "error_examples": sorted(set(errors))[:3],
            "rss_before_mb": round(before, 1),
            "rss_growth_mb": round(after - before, 1),
            "rss_requests": args.rss_requests,
            "burst_size": size,
            "burst_outcomes": counts,
            "burst_all_answered": answered,
        }
    finally:
        process.terminate()
        process.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--source", default=None, help="a checkpoint, export or hub id (default: a tiny random model)"
    )
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    parser.add_argument(
        "--rss-requests", type=int, default=1000, help="requests between the two RSS readings"
    )
    parser.add_argument("--max-batch", type=int, default=32, help="the server's --max-batch")
    parser.add_argument("--max-queue", type=int, default=32, help="the server's --max-queue")
    parser.add_argument("--burst-extra", type=int, default=32, help="burst requests beyond batch + queue")
    parser.add_argument("--burst-timeout", type=float, default=300.0, help="seconds the burst may take")
    parser.add_argument("--threads", type=int, default=1, help="the server's OMP_NUM_THREADS")
    parser.add_argument("--dim", type=int, default=64, help="width of the tiny random model")
    parser.add_argument("--layers", type=int, default=2, help="layers of the tiny random model")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        source = args.source or str(tiny_export(Path(folder), args.dim, args.layers))
        result = asyncio.run(bench(args, source))
    result = {
        "benchmark": "serve", "source": args.source or f"tiny random (dim {args.dim}, {args.layers} layers)",
        "max_tokens": args.max_tokens, "max_batch": args.max_batch, "max_queue": args.max_queue,
        "threads": args.threads, "cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
        "git": git_revision(), **result,
    }  # fmt: skip
    emit(result)


if __name__ == "__main__":
    main()
