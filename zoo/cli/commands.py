"""The `zoo` commands that are not Lightning's: tokenizer training, presets, export, push and pull,
pre-tokenization, serving, evaluation.

Their parsers come from `zoo.command_line.command_parser`, so each takes `--config FILE.yaml` and
`--print_config` as `zoo fit` does (`zoo models` has no options; `zoo ablate` and `zoo analyze` already use
`--config` for a training config, see their `--help`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from zoo.command_line import command_parser

EXTRA_COMMANDS = {
    "train-tokenizer": "train a byte-level BPE tokenizer on text files",
    "models": "list the model presets with their parameter counts",
    "export": "write a (optionally elastic-extracted) checkpoint as a standalone hub directory",
    "extract": "same as export",
    "push": "publish a checkpoint's model and tokenizer to the Hugging Face Hub",
    "pull": "download a published model into a directory and check that it loads",
    "serve": "serve a model (checkpoint, export or hub id) over an OpenAI-compatible HTTP API",
    "analyze": "routing analysis of a checkpoint: expert heatmaps, top-expert IoU and entropy by modality",
    "ablate": "train variants of a config over several seeds and tabulate their validation metrics",
    "tokenize": "pre-tokenize manifests or tar shards into code shards (the frozen tokenizers run once)",
    "generate": "one answer of a trained model: text streamed, images and speech written to files",
    "chat": "a conversation with a trained model in the terminal (text, /image, /audio, /reset)",
    "eval": "lm-evaluation-harness tasks (local YAMLs or lm-eval's) on a checkpoint, export or hub id",
}


def models_main(argv: list[str]) -> None:
    """Print every preset with its total and active parameter counts (built on the meta device)."""
    from zoo.registry import create_model, get_preset, list_models

    if argv:
        raise SystemExit(f"zoo models takes no arguments, got {argv}")
    print(f"{'name':<14} {'total':>10} {'active':>10} {'active %':>9}  description")
    for name in list_models():
        model = create_model(name, device="meta")
        total, active = model.num_parameters(), model.num_parameters(active=True)
        print(
            f"{name:<14} {total:>10.3g} {active:>10.3g} {100 * active / total:>8.2f}%  "
            + get_preset(name).description
        )


def _parser(command: str) -> argparse.ArgumentParser:
    return command_parser(f"zoo {command}", EXTRA_COMMANDS[command])


def _add_hub_metadata(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--datasets", nargs="*", default=[], help="training data names for the model card")
    parser.add_argument("--license", default=None, help="SPDX license id for the model card")


def export_main(argv: list[str], command: str = "export") -> None:
    """Checkpoint -> `save_pretrained` directory; depth/width/topk fractions below 1 extract a sub-model."""
    from zoo.hub import load_lightning_checkpoint, save_pretrained
    from zoo.models.elastic import ElasticConfig

    parser = _parser(command)
    parser.add_argument("--checkpoint", required=True, help="a Lightning checkpoint of UnifiedPretraining")
    parser.add_argument("--out", required=True, help="directory to write")
    for name in ("depth", "width", "topk"):
        parser.add_argument(f"--{name}", type=float, default=1.0, help=f"{name} fraction in (0, 1]")
    _add_hub_metadata(parser)
    args = parser.parse_args(argv)
    model, tokenizer = load_lightning_checkpoint(args.checkpoint)
    backbone = model.backbone
    elastic = ElasticConfig.from_fractions(
        backbone.n_layers, backbone.n_experts, backbone.top_k, args.depth, args.width, args.topk
    )
    if not elastic.is_full:
        print("extracting " + elastic.describe(backbone.n_layers, backbone.n_experts, backbone.top_k))
        model = model.extract(elastic)
    out = save_pretrained(model, args.out, tokenizer, datasets=args.datasets, license=args.license)
    total, active = model.num_parameters(), model.num_parameters(active=True)
    print(f"wrote {out} ({total:,} parameters, {active:,} active)")


def push_main(argv: list[str]) -> None:
    from zoo.hub import load_lightning_checkpoint, push_to_hub

    parser = _parser("push")
    parser.add_argument("--checkpoint", required=True, help="a Lightning checkpoint of UnifiedPretraining")
    parser.add_argument("--repo_id", required=True, help="user/name on the hub")
    parser.add_argument("--token", default=None, help="hub token (default: the saved login / HF_TOKEN)")
    parser.add_argument("--private", action="store_true", help="create the repo private")
    _add_hub_metadata(parser)
    args = parser.parse_args(argv)
    model, tokenizer = load_lightning_checkpoint(args.checkpoint)
    url = push_to_hub(
        model,
        args.repo_id,
        tokenizer,
        token=args.token,
        private=args.private,
        datasets=args.datasets,
        license=args.license,
    )
    print(f"pushed {args.repo_id}: {url}")


def pull_main(argv: list[str]) -> None:
    from huggingface_hub import snapshot_download

    from zoo.hub import CARD_NAME, CONFIG_NAME, TOKENIZER_NAME, WEIGHTS_NAME, from_pretrained

    parser = _parser("pull")
    parser.add_argument("--repo_id", required=True, help="user/name on the hub")
    parser.add_argument("--out", required=True, help="directory to write")
    parser.add_argument("--revision", default=None, help="branch, tag or commit")
    parser.add_argument("--token", default=None, help="hub token for private repos")
    parser.add_argument("--endpoint", default=None, help="another hub than HF_ENDPOINT (a mirror)")
    args = parser.parse_args(argv)
    out = snapshot_download(
        args.repo_id,
        revision=args.revision,
        token=args.token,
        local_dir=args.out,
        endpoint=args.endpoint,
        allow_patterns=[CONFIG_NAME, WEIGHTS_NAME, TOKENIZER_NAME, CARD_NAME],
    )
    model = from_pretrained(out)  # refuses a config outside the allow-list or weights that do not fit
    print(f"pulled {args.repo_id} into {out} ({model.num_parameters():,} parameters)")


def _train_tokenizer(argv: list[str]) -> None:
    from zoo.tokenizers.text import train_tokenizer_main

    train_tokenizer_main(argv)


def _serve(argv: list[str]) -> None:
    from zoo.serve.command import serve_main

    serve_main(argv, _parser("serve"))


def _analyze(argv: list[str]) -> None:
    from zoo.analysis.command import analyze_main

    analyze_main(argv)


def _ablate(argv: list[str]) -> None:
    from zoo.cli.ablation import main as ablate_main

    ablate_main(argv)


def _tokenize(argv: list[str]) -> None:
    from zoo.pretokenize.command import tokenize_main

    tokenize_main(argv)


def _chat(argv: list[str]) -> None:
    from zoo.cli.chat import chat_main

    chat_main(argv)


def _generate(argv: list[str]) -> None:
    from zoo.cli.generate import generate_main

    generate_main(argv)


def _eval(argv: list[str]) -> None:
    from zoo.evaluation.command import eval_main

    eval_main(argv, _parser("eval"))


def extra_command(name: str) -> Callable[[list[str]], None] | None:
    """The function behind `zoo NAME ...`, or None when NAME is a Lightning subcommand (fit, predict, ...)."""
    return {
        "train-tokenizer": _train_tokenizer,
        "models": models_main,
        "export": lambda argv: export_main(argv, "export"),
        "extract": lambda argv: export_main(argv, "extract"),
        "push": push_main,
        "pull": pull_main,
        "serve": _serve,
        "analyze": _analyze,
        "ablate": _ablate,
        "tokenize": _tokenize,
        "generate": _generate,
        "chat": _chat,
        "eval": _eval,
    }.get(name)
