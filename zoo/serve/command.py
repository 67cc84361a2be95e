"""`zoo serve SOURCE`: the OpenAI-compatible server over a checkpoint, an exported folder or a hub id.

    zoo serve runs/demo/export --port 8000 --api-key secret
    curl http://127.0.0.1:8000/v1/chat/completions -H "Authorization: Bearer secret" \\
        -H "Content-Type: application/json" \\
        -d '{"model": "export", "messages": [{"role": "user", "content": "a small red circle"}]}'

One uvicorn worker (each worker would load its own model); 127.0.0.1 unless `--host` says otherwise.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def serve_main(argv: list[str], parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source", help="a Lightning checkpoint, a folder `zoo export` wrote, or a hub repo id"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--model-name",
        default=None,
        help="the name clients ask for (default: the folder's name or the hub id)",
    )
    parser.add_argument(
        "--api-key", default=os.environ.get("ZOO_API_KEY"), help="require Bearer KEY (or ZOO_API_KEY)"
    )
    parser.add_argument("--max-batch", type=int, default=8, help="most requests decoded together")
    parser.add_argument(
        "--max-queue", type=int, default=64, help="most requests waiting beyond those (429 past it)"
    )
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens one answer may ask for")
    parser.add_argument(
        "--request-timeout", type=float, default=60.0, help="seconds per request (504 past it)"
    )
    parser.add_argument("--max-images", type=int, default=4, help="most images one generation request draws")
    parser.add_argument(
        "--max-best-of", type=int, default=16,
        help="most candidates an image or speech request may draw to keep the best of (its best_of)",
    )  # fmt: skip
    parser.add_argument(
        "--max-audio-frames", type=int, default=160, help="most codec frames of a speech answer"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    args = parser.parse_args(argv)
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as error:
        raise SystemExit(
            f"zoo serve needs the serve extra ({error.name} is missing): pip install -e '.[serve]'"
        ) from None

    from zoo.inference import pipeline
    from zoo.serve.app import ServeLimits, create_app

    pipe = pipeline(args.source, device=args.device)
    name = args.model_name or model_name(args.source)
    limits = ServeLimits(
        max_tokens=args.max_tokens, request_timeout=args.request_timeout, max_images=args.max_images,
        max_best_of=args.max_best_of,
        max_audio_frames=args.max_audio_frames,
    )  # fmt: skip
    app = create_app(
        pipe, name, max_batch=args.max_batch, max_queue=args.max_queue, limits=limits, api_key=args.api_key
    )
    auth = "an API key required" if args.api_key else "no API key"
    print(
        f"zoo serve: model {name!r} from {args.source} on {args.device}; OpenAI API at "
        f"http://{args.host}:{args.port}/v1 ({auth}; max batch {args.max_batch}, queue {args.max_queue})",
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, workers=1, log_level=args.log_level)


def model_name(source: str) -> str:
    """The name clients ask for: a local folder's name, a checkpoint's run name, else the hub id as it is
    (vLLM's rule: `you/zoo-tiny`)."""
    path = Path(source.rstrip("/"))
    if not path.exists():
        return source
    if path.is_file():  # runs/<run>/latest/checkpoints/last.ckpt: the run's name
        return next((p.name for p in path.parents if p.name not in ("checkpoints", "latest")), path.stem)
    return path.name
