"""What the diffusion refiner does to generated images: the image verifier and PSNR / SSIM, before and after.

ERNIE 5.0 decodes generated codes with its visual tokenizer and sharpens the decode with a diffusion refiner
(docs/refiner.md, "Refining generated images"). This benchmark generates caption-to-image samples for
`--scenes` scenes of a split with a `UnifiedPretraining` checkpoint, decodes them, refines the same decodes
with the refiner (`zoo.models.refinement`), and scores both in the same run
(`zoo.tasks.multimodal_eval.evaluate` with a refinement, `zoo.tasks.refined_eval`):

- verifier: `verify_image` of the decode (as the plain evaluation scores it) and of the refined image;
- PSNR / SSIM (torchmetrics, `zoo/tasks/metrics.py`) against the render of each caption's own scene at the
  refined size, the decode bicubic-upsampled to that size.

    .venv/bin/python benchmarks/refined_generation.py runs/demo/multimodal/latest/checkpoints/last.ckpt \\
        --refiner runs/refiner_tokenizer_native/latest/diffusion_refiner --scenes 64 [--steps 10]

`--refiner` is a folder `DiffusionRefiner.save_pretrained` wrote (the refiner's fit writes
`diffusion_refiner/` in its `default_root_dir`), a Hub repo id, or a `RefinerTraining` checkpoint (`.ckpt`).
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
from zoo.hub import load_lightning_checkpoint  # noqa: E402
from zoo.hub.checkpoints import load_checkpoint_component  # noqa: E402
from zoo.models.refinement import ImageRefinement, RefinerSettings  # noqa: E402
from zoo.models.refiner import DiffusionRefiner  # noqa: E402
from zoo.models.unified import UnifiedModel  # noqa: E402
from zoo.tasks.multimodal_eval import evaluate  # noqa: E402
from zoo.tokenizers.text import TextTokenizer  # noqa: E402

TASK = "text_to_image"
FIGURES = ("exact", "attribute_accuracy", "psnr", "ssim")


def load_refinement(source: str, steps: int | None, seed: int) -> ImageRefinement:
    """The refiner of a `RefinerTraining` checkpoint (`.ckpt`), else of a folder or Hub id."""
    if source.endswith(".ckpt"):
        refiner = load_checkpoint_component(source, "refiner")
        if not isinstance(refiner, DiffusionRefiner):
            raise ValueError(f"{source}: its 'refiner' is a {type(refiner).__name__}, not a DiffusionRefiner")
        return ImageRefinement(refiner, steps, seed)
    return RefinerSettings(source, steps, seed).load()


def measure(
    model: UnifiedModel,
    tokenizer: TextTokenizer,
    refinement: ImageRefinement,
    scenes: int,
    split: str = "val",
    max_objects: int = 2,
    cfg_scale: float = 2.0,
    temperature: float = 1.0,
    top_k: int | None = 8,
    seed: int = 0,
) -> dict[str, float]:
    """Caption-to-image figures of the same generated codes, unrefined (`decoded_*`) and refined
    (`refined_*`), plus the random-codes baseline of the plain evaluation."""
    if model.nfsp is None:
        raise ValueError("the checkpoint's model has no visual tokenizer: it generates no images to refine")
    data = ShapesMultimodalDataModule(
        vocab=model.vocab, layout=MediaLayout.of(model), max_objects=max_objects, text_to_image_weight=1.0,
        caption_weight=0.0, image_to_text_weight=0.0,
    )  # fmt: skip
    data.tokenizer = tokenizer
    data.setup("validate")
    result = evaluate(
        model, data, scenes, split, cfg_scale, temperature, top_k, seed=seed, tasks=[TASK],
        refinement=refinement,
    )  # fmt: skip
    m = result.metrics
    figures = {f"decoded_{k}": m[f"{TASK}/{k}"] for k in FIGURES}
    figures |= {f"refined_{k}": m[f"{TASK}/refined_{k}"] for k in FIGURES}
    figures |= {f"baseline_{k}": m[f"{TASK}/baseline_{k}"] for k in ("exact", "attribute_accuracy")}
    figures["psnr_gain_db"] = figures["refined_psnr"] - figures["decoded_psnr"]
    return figures


def main(argv: list[str] | None = None) -> dict[str, object]:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("checkpoint", help="a UnifiedPretraining checkpoint with a visual tokenizer")
    parser.add_argument("--refiner", required=True, help="a refiner folder, Hub id or RefinerTraining .ckpt")
    parser.add_argument("--scenes", type=int, default=64, help="val scenes to generate")
    parser.add_argument("--split", default="val", choices=("val", "test"))
    parser.add_argument("--steps", type=int, default=None, help="refiner sampling steps (default: its own)")
    parser.add_argument("--max-objects", type=int, default=2, help="as the model was trained (the demo: 2)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--cfg-scale", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    info = machine_info(args.threads)
    model, tokenizer = load_lightning_checkpoint(args.checkpoint)
    if tokenizer is None:
        raise SystemExit(f"{args.checkpoint} holds no text tokenizer: not a UnifiedPretraining checkpoint")
    refinement = load_refinement(args.refiner, args.steps, args.seed)
    log(f"generating {args.scenes} {args.split} scenes, refining to {refinement.size}x{refinement.size}")
    with torch.no_grad():
        figures = measure(
            model, tokenizer, refinement, args.scenes, args.split, args.max_objects, args.cfg_scale,
            args.temperature, seed=args.seed,
        )  # fmt: skip
    steps = refinement.steps or refinement.refiner.num_inference_steps
    result = {
        "benchmark": "refined_generation", **info, "checkpoint": args.checkpoint, "refiner": args.refiner,
        "scenes": args.scenes, "split": args.split, "refiner_steps": steps, "size": refinement.size,
        **{k: round(v, 4) for k, v in figures.items()},
    }  # fmt: skip
    emit(result)
    return result


if __name__ == "__main__":
    main()
