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
    "export": "write a checkpoint (a unified model, optionally extracted, or a component) as a hub folder",
    "extract": "same as export",
    "push": "publish a checkpoint or an exported folder (a model or a component) to the Hugging Face Hub",
    "pull": "download a published model or component into a directory and check that it loads",
    "serve": "serve a model (checkpoint, export or hub id) over an OpenAI-compatible HTTP API",
    "analyze": "routing analysis of a checkpoint: expert heatmaps, top-expert IoU and entropy by modality",
    "ablate": "train variants of a config over several seeds and tabulate their validation metrics",
    "tokenize": "pre-tokenize manifests or tar shards into code shards (the frozen tokenizers run once)",
    "generate": "one answer of a trained model: text streamed, images and speech written to files",
    "chat": "a conversation with a trained model in the terminal (text, /image, /audio, /reset)",
    "eval": "lm-evaluation-harness tasks (local YAMLs or lm-eval's) on a checkpoint, export or hub id",
    "plan": "per-rank parameter, gradient and optimizer bytes and the mesh of a sharded config, without GPUs",
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
    parser.add_argument(
        "--metrics", nargs="*", default=[], metavar="KEY=VALUE",
        help="measured figures for the card and its model-index, e.g. val/psnr=24.1",
    )
    parser.add_argument("--eval_dataset", default=None, help="what the metrics were measured on (default: "
                        "the first of --datasets)")
    parser.add_argument("--key", default=None, help="a component task's hyper-parameter holding the "
                        "component, when it has several")
    parser.add_argument("--max_shard_size", default=None, help="weights past this size (bytes, or 5GB, "
                        "200MB) are written as shards with model.safetensors.index.json (default 5GB)")


def _add_components(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--component", nargs="*", default=[], metavar="NAME=REF",
        help=f"a unified model's component named by {what} instead of stored: visual_tokenizer=..., "
        "audio_codec=..., vision_encoder=...",
    )


def _pairs(values: list[str], flag: str) -> dict[str, str]:
    pairs = {}
    for value in values:
        key, equals, item = value.partition("=")
        if not equals or not key or not item:
            raise SystemExit(f"{flag}: expected KEY=VALUE, got {value!r}")
        pairs[key] = item
    return pairs


def _metrics(values: list[str]) -> dict[str, float]:
    metrics = {}
    for key, value in _pairs(values, "--metrics").items():
        try:
            metrics[key] = float(value)
        except ValueError:
            raise SystemExit(f"--metrics: {key}={value!r} is not a number") from None
    return metrics


def _card_arguments(args: argparse.Namespace) -> dict:
    from zoo.publishing.shards import MAX_SHARD_SIZE

    size = args.max_shard_size or MAX_SHARD_SIZE
    return {
        "datasets": args.datasets, "license": args.license, "metrics": _metrics(args.metrics),
        "eval_dataset": args.eval_dataset, "max_shard_size": int(size) if str(size).isdigit() else size,
    }


def export_main(argv: list[str], command: str = "export") -> None:
    """Checkpoint -> `save_pretrained` directory. A unified model's checkpoint: depth/width/topk fractions
    below 1 extract a sub-model, and the component folders its config loaded (`weights`) are named, not
    copied, unless `--whole`. A component task's checkpoint (tokenizer, codec, encoder, refiner): the
    component's own folder."""
    from zoo.hub import (
        components_named_by_weights,
        holds_unified_model,
        load_checkpoint_component,
        load_lightning_checkpoint,
        save_pretrained,
    )
    from zoo.models.elastic import ElasticConfig

    parser = _parser(command)
    parser.add_argument("--checkpoint", required=True, help="a Lightning checkpoint of a zoo task")
    parser.add_argument("--out", required=True, help="directory to write")
    for name in ("depth", "width", "topk"):
        parser.add_argument(f"--{name}", type=float, default=1.0, help=f"{name} fraction in (0, 1]")
    _add_hub_metadata(parser)
    _add_components(parser, "a folder or hub id")
    parser.add_argument("--whole", action="store_true", help="store every component's tensors in the "
                        "unified folder, even those whose folders the checkpoint names")
    args = parser.parse_args(argv)
    if not holds_unified_model(args.checkpoint):
        if (args.depth, args.width, args.topk) != (1.0, 1.0, 1.0) or args.component:
            raise SystemExit(f"{args.checkpoint}: --depth/--width/--topk/--component apply to unified models")
        component = load_checkpoint_component(args.checkpoint, args.key)
        out = component.save_pretrained(args.out, **_card_arguments(args))
        print(f"wrote {out} ({type(component).__name__}, {component.num_parameters():,} parameters)")
        return
    model, tokenizer = load_lightning_checkpoint(args.checkpoint)
    backbone = model.backbone
    elastic = ElasticConfig.from_fractions(
        backbone.n_layers, backbone.n_experts, backbone.top_k, args.depth, args.width, args.topk
    )
    if not elastic.is_full:
        print("extracting " + elastic.describe(backbone.n_layers, backbone.n_experts, backbone.top_k))
        model = model.extract(elastic)
    named = {} if args.whole else {k: str(v) for k, v in components_named_by_weights(args.checkpoint).items()}
    components = {**named, **_pairs(args.component, "--component")}
    out = save_pretrained(model, args.out, tokenizer, components=components, **_card_arguments(args))
    total, active = model.num_parameters(), model.num_parameters(active=True)
    print(f"wrote {out} ({total:,} parameters, {active:,} active)")
    for name, ref in components.items():
        print(f"  {name}: named, not stored ({ref})")


def push_main(argv: list[str]) -> None:
    """A checkpoint (unified or component) or a saved folder to a Hub repo; the Hub's README is kept unless
    `--overwrite_card`."""
    from zoo.hub import holds_unified_model, load_checkpoint_component, load_lightning_checkpoint, push_to_hub

    parser = _parser("push")
    # One of the two, checked after parsing: argparse's required group would not see a value from --config.
    parser.add_argument("--checkpoint", help="a Lightning checkpoint of a zoo task (or give --folder)")
    parser.add_argument("--folder", help="a folder `zoo export` or save_pretrained wrote, uploaded as is")
    parser.add_argument("--repo_id", required=True, help="user/name on the hub")
    parser.add_argument("--token", default=None, help="hub token (default: the saved login / HF_TOKEN)")
    parser.add_argument("--private", action="store_true", help="create the repo private")
    parser.add_argument("--endpoint", default=None, help="another hub than HF_ENDPOINT (a mirror)")
    parser.add_argument("--overwrite_card", action="store_true", help="replace the README already on the Hub")
    _add_hub_metadata(parser)
    _add_components(parser, "hub id")
    args = parser.parse_args(argv)
    if (args.checkpoint is None) == (args.folder is None):
        parser.error("give one of --checkpoint (a Lightning checkpoint) or --folder (an exported folder)")
    hub = {"token": args.token, "private": args.private, "endpoint": args.endpoint,
           "overwrite_card": args.overwrite_card}
    if args.folder:
        card_flags = [f"--{k}" for k in ("datasets", "license", "metrics", "eval_dataset", "key", "component",
                                         "max_shard_size") if getattr(args, k)]
        if card_flags:  # the folder's card and config were written at export: say so rather than drop them
            raise SystemExit(f"zoo push --folder uploads the folder as it is; {card_flags} apply to "
                             "--checkpoint (or re-export the folder with them)")
        url = _push_folder(args.folder, args.repo_id, hub)
    elif holds_unified_model(args.checkpoint):
        model, tokenizer = load_lightning_checkpoint(args.checkpoint)
        components = _pairs(args.component, "--component")
        card = _card_arguments(args)
        url = push_to_hub(model, args.repo_id, tokenizer, components=components, **hub, **card)
    else:
        component = load_checkpoint_component(args.checkpoint, args.key)
        url = component.push_to_hub(args.repo_id, **hub, **_card_arguments(args))
    print(f"pushed {args.repo_id}: {url}")


def _push_folder(folder: str, repo_id: str, hub: dict) -> str:
    """Upload a saved folder after checking that it loads; a unified folder must name its components by
    hub id, since the pushed copy cannot reach folders beside it."""
    from zoo.hub import from_pretrained
    from zoo.hub.components import looks_like_path
    from zoo.publishing.component import load_component
    from zoo.publishing.layout import UNIFIED_FORMAT, read_config
    from zoo.publishing.transfer import push_folder

    config = read_config(folder)
    if config["format"] == UNIFIED_FORMAT:
        references = config.get("components") or {}
        local = {n: r for n, r in references.items() if looks_like_path(r) or "/" not in r}
        if local:
            raise SystemExit(f"{folder}: its components {local} are local folders; push them and re-export "
                             "with --component NAME=HUB_ID")
        from_pretrained(folder, token=hub["token"], endpoint=hub["endpoint"])
    else:
        load_component(folder)
    return push_folder(folder, repo_id, **hub)


def pull_main(argv: list[str]) -> None:
    """Download a published model or component into a folder and check that it loads (a unified model's
    components pulled too, into the Hub cache)."""
    from huggingface_hub import snapshot_download

    from zoo.hub import from_pretrained
    from zoo.publishing.component import load_component
    from zoo.publishing.layout import FOLDER_FILES, UNIFIED_FORMAT, read_config

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
        allow_patterns=list(FOLDER_FILES),
    )
    config = read_config(out)
    # Either refuses a config outside the allow-list or weights that do not fit.
    if config["format"] == UNIFIED_FORMAT:
        model = from_pretrained(out, token=args.token, endpoint=args.endpoint)
        print(f"pulled {args.repo_id} into {out} ({model.num_parameters():,} parameters)")
        for name, ref in (config.get("components") or {}).items():
            print(f"  {name}: pulled {ref}")
    else:
        component = load_component(out)
        kind = type(component).__name__
        print(f"pulled {args.repo_id} into {out} ({kind}, {component.num_parameters():,} parameters)")


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
        "plan": _plan,
    }.get(name)


def _plan(argv: list[str]) -> None:
    from zoo.cli.plan import plan_main

    plan_main(argv)
