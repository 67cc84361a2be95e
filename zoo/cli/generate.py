"""`zoo generate SOURCE [PROMPT]`: one answer of a trained model from the terminal (litgpt's `generate`).

    zoo generate runs/quickstart/latest/checkpoints/last.ckpt "a small red"            # text, streamed
    zoo generate MODEL "a small red circle" --output image --out circle.png          # caption to image
    zoo generate MODEL --image scene.png                                             # image to caption
    zoo generate MODEL --audio speech.wav                                            # speech to transcript
    zoo generate MODEL "a small red circle" --output speech --out circle.wav         # caption to speech
    zoo generate MODEL "a small red circle" --output image --refiner runs/refiner/latest/diffusion_refiner

SOURCE is what `zoo.pipeline` opens: a Lightning checkpoint, an exported folder or a hub repo id. Text goes
to stdout as it is generated; media are written to `--out` (default `generated.png`, `.gif` or `.wav`) and
the path is printed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zoo.command_line import command_parser

DEFAULT_OUT = {"image": "generated.png", "video": "generated.gif", "speech": "generated.wav"}


def parser() -> argparse.ArgumentParser:
    p = command_parser(
        "zoo generate", "one answer of a trained model: text streamed, images and speech written to files"
    )
    p.add_argument("source", help="a Lightning checkpoint, a folder `zoo export` wrote, or a hub repo id")
    p.add_argument("prompt", nargs="?", default=None, help="the text to continue, caption to draw, or prompt")
    media = p.add_mutually_exclusive_group()
    media.add_argument("--image", default=None, help="an image file to caption")
    media.add_argument("--audio", default=None, help="an audio file to transcribe")
    media.add_argument("--video", default=None, help="a video file to caption")
    p.add_argument("--output", choices=("text", "image", "video", "speech"), default="text")
    p.add_argument("--out", default=None, help="where media go (default: generated.png / .gif / .wav)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-audio-frames", type=int, default=160)
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--cfg-scale", type=float, default=2.0, help="guidance weight of images and video")
    p.add_argument("--seed", type=int, default=None, help="makes sampling repeatable")
    p.add_argument(
        "--best-of", type=int, default=1,
        help="draw this many media and keep the one the model reads back as the caption most likely",
    )  # fmt: skip
    p.add_argument("--device", default="cpu")
    p.add_argument("--refiner", default=None, help="a diffusion refiner's folder or hub id: refines images")
    p.add_argument("--refiner-steps", type=int, default=None, help="its sampling steps (default: its own)")
    return p


def generate_main(argv: list[str]) -> None:
    import numpy as np

    from zoo.inference import Speech, pipeline
    from zoo.media import save_gif, save_png, save_wav
    from zoo.models.refinement import RefinerSettings

    args = parser().parse_args(argv)
    refiner = None if args.refiner is None else RefinerSettings(args.refiner, args.refiner_steps)
    pipe = pipeline(args.source, device=args.device, refiner=refiner)
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if args.output == "text":
        pieces = pipe.stream(
            args.prompt, image=args.image, audio=args.audio, video=args.video,
            max_new_tokens=args.max_new_tokens, **sampling,
        )  # fmt: skip
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return
    answer = pipe(
        args.prompt, image=args.image, audio=args.audio, video=args.video, output=args.output,
        max_audio_frames=args.max_audio_frames, cfg_scale=args.cfg_scale, best_of=args.best_of, **sampling,
    )  # fmt: skip
    out = Path(args.out or DEFAULT_OUT[args.output])
    if isinstance(answer, Speech):
        if len(answer.wave) == 0:
            raise SystemExit(
                "zoo generate: the model ended the speech before its first frame; nothing written (try "
                "another --seed, or a better-trained model)"
            )
        path = save_wav(answer.wave, out, answer.sample_rate)
    elif isinstance(answer, list):  # the frames of a video
        path = save_gif(np.stack([np.asarray(frame) for frame in answer]), out)
    else:
        path = save_png(np.asarray(answer), out)
    print(f"wrote {path}")
