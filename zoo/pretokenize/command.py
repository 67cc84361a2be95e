"""`zoo tokenize`: run the frozen visual tokenizer and audio codec once over a corpus, into code shards.

    zoo tokenize data/pairs.jsonl 'shards/train-{0000..0099}.tar' --out codes/ \\
        --model runs/shapes_image/latest/checkpoints/last.ckpt --num_workers 4 --batch_size 64
    zoo tokenize data/pairs.jsonl --out codes/ \\
        --visual_tokenizer configs/tokenizers/visual_2d.yaml \\
        --visual_weights runs/visual_2d/latest/visual_tokenizer.safetensors

A command like the other extra commands (options also from `--config FILE.yaml`; `--print_config`): its
arguments are paths, counts and policies, and the tokenizers come from files through the hub's allow-list
(`zoo.pretokenize.frozen`), not from class paths on the command line.
Rerunning the same command resumes: finished shards are skipped.
"""

from __future__ import annotations

import argparse

from zoo.command_line import command_parser
from zoo.datamodules.frozen_tokenizers import FrozenTokenizers
from zoo.datamodules.media_samples import MediaSpec
from zoo.media import DEFAULT_MAX_PIXELS
from zoo.pretokenize.frozen import load_component, model_tokenizers
from zoo.pretokenize.run import TokenizeResult, tokenize_corpus
from zoo.tokenizers.audio import AudioCodec
from zoo.tokenizers.visual import VisualTokenizer

DESCRIPTION = "pre-tokenize manifests or tar shards into WebDataset code shards (codes and raw text)"


def clip_start(text: str) -> str | float:
    """`--video_start`: "start", "centre" or seconds after the first frame."""
    if text in ("start", "centre"):
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'start', 'centre' or seconds, got {text!r}") from None


def parser() -> argparse.ArgumentParser:
    p = command_parser("zoo tokenize", DESCRIPTION)
    p.add_argument("inputs", nargs="+", help="jsonl manifests and/or WebDataset tar shards (brace patterns)")
    p.add_argument("--out", required=True, help="folder of the code shards (rerun into it to resume)")
    source = p.add_argument_group("tokenizers: a model, or config files plus weights")
    source.add_argument("--model", help="an exported model folder or a UnifiedPretraining checkpoint")
    source.add_argument("--visual_tokenizer", help="YAML/JSON holding a VisualTokenizer spec (any config)")
    source.add_argument("--visual_weights", help="its .safetensors (default: the config's weights path)")
    source.add_argument("--audio_codec", help="YAML/JSON holding an AudioCodec spec (any config)")
    source.add_argument("--audio_weights", help="its .safetensors (default: the config's weights path)")
    run = p.add_argument_group("running")
    run.add_argument("--batch_size", type=int, default=32, help="samples per tokenizer call")
    run.add_argument("--num_workers", type=int, default=2, help="DataLoader workers decoding media")
    run.add_argument("--lines_per_shard", type=int, default=10_000, help="manifest lines per output shard")
    run.add_argument("--index", help="index JSON with the sample counts of remote tar shards")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    media = p.add_argument_group("decoding (zoo.media; as PairedDataModule's `media` decodes raw media)")
    media.add_argument("--fit", default="center_crop", choices=("center_crop", "pad", "stretch"))
    media.add_argument("--max_pixels", type=int, default=DEFAULT_MAX_PIXELS, help="decompression-bomb cap")
    media.add_argument("--video_frames", type=int, help="clip length (default: 1 + the temporal stride)")
    media.add_argument("--video_fps", type=float, help="clip frame rate (default: the video's own)")
    media.add_argument("--video_start", type=clip_start, default="start", help="'start', 'centre' or seconds")
    media.add_argument("--short", default="refuse", choices=("refuse", "repeat_last"), help="short videos")
    return p


def load_tokenizers(args: argparse.Namespace) -> FrozenTokenizers:
    given = args.visual_tokenizer or args.audio_codec
    if args.model and given:
        raise ValueError("give either --model or --visual_tokenizer/--audio_codec, not both")
    if args.model:
        return FrozenTokenizers(*model_tokenizers(args.model))
    if not given:
        raise ValueError(
            "no tokenizer: give --model, or --visual_tokenizer and/or --audio_codec config files"
        )
    visual = (
        load_component(args.visual_tokenizer, VisualTokenizer, args.visual_weights)
        if args.visual_tokenizer
        else None
    )
    audio = load_component(args.audio_codec, AudioCodec, args.audio_weights) if args.audio_codec else None
    return FrozenTokenizers(visual, audio)


def media_spec(args: argparse.Namespace) -> MediaSpec:
    """The decoding the arguments ask for; sizes come from the tokenizers (`FrozenTokenizers.resolve`)."""
    return MediaSpec(
        fit=args.fit,
        max_pixels=args.max_pixels,
        video_frames=args.video_frames,
        fps=args.video_fps,
        clip_start=args.video_start,
        short_video=args.short,
    )


def tokenize_main(argv: list[str]) -> TokenizeResult:
    """Parse `argv`, tokenize, print a summary; exit non-zero (after writing) when inputs were unreadable."""
    args = parser().parse_args(argv)
    tokenizers = load_tokenizers(args)
    result = tokenize_corpus(
        args.inputs,
        args.out,
        tokenizers,
        media_spec(args),
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        lines_per_shard=args.lines_per_shard,
        index=args.index,
        progress=not args.quiet,
    )
    print(result.describe())
    if result.shards_failed:
        raise SystemExit(
            f"zoo tokenize: {len(result.shards_failed)} inputs could not be read (listed in "
            f"{result.out / 'failures.jsonl'}); rerun to retry them: {', '.join(result.shards_failed[:5])}"
        )
    return result
