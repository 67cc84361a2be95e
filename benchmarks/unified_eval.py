"""Evaluation of a trained unified model on ShapesWorld, every task its tokenizers support, against baselines.

Loads a Lightning checkpoint of `UnifiedPretraining` (e.g. `runs/demo/multimodal/latest/checkpoints/last.ckpt`
after `make demo`) or an exported folder (an RL run's `policy/`), and scores caption-to-image /
image-to-caption (and speech, video when the model has
the codec / a 3D tokenizer) on `--scenes` scenes of the val split (training compositions) and the test
split (held-out colour-shape pairs) with `zoo.tasks.multimodal_eval.evaluate`. Baselines in the same
run: random codes decoded by the same tokenizer (generation) and the most frequent training caption
(understanding). Captions are greedy; media sampled at `--temperature` with top-k 8 and guidance
`--cfg-scale`, the best of `--best-of` images (`--audio-best-of` utterances) by the model's own reading when
above 1, the first candidate's scores beside (`one_sample_*`), as the demo's gallery does.

    .venv/bin/python benchmarks/unified_eval.py runs/demo/multimodal/latest/checkpoints/last.ckpt \
        [--scenes 64] [--temperature 0.5 --best-of 16 --audio-best-of 8]   # the gallery's sampling

Progress on stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, log, machine_info  # noqa: E402

from zoo.datamodules.sequence import MediaLayout  # noqa: E402
from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule  # noqa: E402
from zoo.hub import from_pretrained, load_lightning_checkpoint, load_tokenizer  # noqa: E402
from zoo.tasks.multimodal_eval import evaluate  # noqa: E402


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument(
        "checkpoint", help="a UnifiedPretraining checkpoint or an exported folder, with a tokenizer or codec"
    )
    parser.add_argument("--scenes", type=int, default=64, help="scenes per task and split")
    parser.add_argument("--max-objects", type=int, default=2, help="as the model was trained (the demo: 2)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--cfg-scale", type=float, default=2.0)
    parser.add_argument("--audio-cfg-scale", type=float, default=0.0, help="speech guidance (0: off)")
    parser.add_argument("--top-k", type=int, default=8, help="media sampling top-k (0: no filter)")
    parser.add_argument("--tasks", nargs="*", default=None, help="task names (default: every supported)")
    parser.add_argument("--splits", nargs="*", default=["val", "test"], choices=["val", "test"])
    parser.add_argument("--best-of", type=int, default=1, help="images drawn a caption, the best read kept")
    parser.add_argument("--audio-best-of", type=int, default=1, help="utterances spoken a caption, likewise")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    info = machine_info(args.threads)
    if (Path(args.checkpoint) / "config.json").is_file():  # exported (a distributed checkpoint has none)
        model, tokenizer = from_pretrained(args.checkpoint).eval(), load_tokenizer(args.checkpoint)
    else:
        model, tokenizer = load_lightning_checkpoint(args.checkpoint)
    layout = MediaLayout.of(model)
    data = ShapesMultimodalDataModule(
        vocab=model.vocab,
        layout=layout,
        max_objects=args.max_objects,
        text_to_image_weight=float(model.nfsp is not None),
        image_to_text_weight=float(model.nfsp is not None),
        text_to_audio_weight=float(model.ncp is not None),
        audio_to_text_weight=float(model.ncp is not None),
        image_context=model.vision_encoder is not None,  # image to caption reads pixels, as trained
    )
    data.tokenizer = tokenizer
    data.setup("validate")
    metrics: dict[str, float] = {}
    for split in args.splits:
        log(f"evaluating {args.scenes} {split} scenes per task")
        with torch.no_grad():
            result = evaluate(
                model, data, args.scenes, split, args.cfg_scale, args.temperature, args.top_k or None,
                seed=args.seed, tasks=args.tasks, audio_cfg_scale=args.audio_cfg_scale,
                best_of=args.best_of, audio_best_of=args.audio_best_of,
            )
        metrics.update({f"{split}/{k}": round(v, 4) for k, v in result.metrics.items()})
    emit({"benchmark": "unified_eval", **info, "checkpoint": args.checkpoint, "scenes": args.scenes,
          "temperature": args.temperature, "cfg_scale": args.cfg_scale,
          "audio_cfg_scale": args.audio_cfg_scale, "top_k": args.top_k, "best_of": args.best_of,
          "audio_best_of": args.audio_best_of, **metrics})


if __name__ == "__main__":
    main()
