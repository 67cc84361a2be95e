"""What caption to image gets wrong, attribute by attribute, under each sampling setting (issue 19).

For `--scenes` val scenes (first n, as the gallery's), the model draws each caption's image once per setting
(`--settings`: guidance, temperature, top-k; one generator seeded the same for every setting), the verifier
reads the objects back, and every true object is checked in its cell: drawn there at all (`cell`), and if so
its colour, shape and size. Also exact by the number of objects in the scene, and the same counts for random
codes decoded by the same tokenizer (the baseline every setting must beat). Prints one JSON line.

    .venv/bin/python benchmarks/generation_errors.py runs/demo/multimodal/latest/checkpoints/last.ckpt
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, load_drawing_model, log, machine_info  # noqa: E402

from zoo.datamodules.sequence import MediaLayout  # noqa: E402
from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule  # noqa: E402
from zoo.models.media_generation import generate_visual  # noqa: E402
from zoo.models.refinement import decode_visual  # noqa: E402
from zoo.task_names import Task  # noqa: E402
from zoo.tasks.multimodal_eval import random_codes  # noqa: E402
from zoo.world.render import read_image_objects  # noqa: E402
from zoo.world.scenes import Scene, ShapeObject  # noqa: E402

ATTRIBUTES = ("colour", "shape", "size")

# (guidance, temperature, top-k): the gallery's setting first, then each lever moved alone.
SETTINGS = [[2.0, 0.5, 8], [0.0, 0.5, 8], [3.0, 0.5, 8], [4.0, 0.5, 8], [2.0, 0.25, 8], [2.0, 1.0, 8],
            [2.0, 1.0, 1]]  # fmt: skip


def errors(images: torch.Tensor, scenes: list[Scene]) -> dict[str, float]:
    """Share of true objects drawn in their cell and, of those, with the right colour / shape / size; exact
    per number of objects."""
    return object_errors([read_image_objects(image) for image in images], scenes)


def object_errors(
    predicted: list[Sequence[ShapeObject] | None], scenes: list[Scene],
    counted: Callable[[ShapeObject], bool] = lambda obj: True,
) -> dict[str, float]:  # fmt: skip
    """Share of the true objects `counted` keeps that are predicted in their cell (`predicted[i]`: the
    objects read from scene i's image or caption, None when unreadable) and, of those, with the right colour
    / shape / size; exact per number of objects (over whole scenes, whatever `counted` keeps)."""
    counts: Counter = Counter()
    for objects, scene in zip(predicted, scenes, strict=True):
        drawn = {(o.row, o.col): o for o in objects or ()}
        n = len(scene.objects)
        exact = len(drawn) == n
        for truth in scene.objects:
            found = drawn.get((truth.row, truth.col))
            rights = [found is not None and getattr(found, a) == getattr(truth, a) for a in ATTRIBUTES]
            exact &= all(rights)
            if counted(truth):
                counts["objects"] += 1
                counts["cell"] += found is not None
                counts.update(a for a, right in zip(ATTRIBUTES, rights, strict=True) if right)
        counts[f"scenes_objects_{n}"] += 1
        counts[f"exact_objects_{n}"] += exact
        counts["exact"] += exact
    out = {"exact": counts["exact"] / len(scenes), "objects": counts["objects"]}
    out["cell"] = counts["cell"] / max(counts["objects"], 1)
    out |= {a: counts[a] / max(counts["cell"], 1) for a in ATTRIBUTES}  # of objects found
    for key in sorted(k for k in counts if k.startswith("scenes_objects_")):
        n = key.rsplit("_", 1)[1]
        out[f"exact_objects_{n}"] = counts[f"exact_objects_{n}"] / counts[key]
        out[key] = counts[key]
    return {k: round(v, 4) for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a UnifiedPretraining checkpoint with a visual tokenizer")
    p.add_argument("--scenes", type=int, default=128, help="val scenes")
    p.add_argument("--max-objects", type=int, default=2, help="as the model was trained (the demo: 2)")
    p.add_argument("--settings", type=json.loads, default=SETTINGS, help="JSON [[guidance, T, top-k], ...]")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    info = machine_info(args.threads)
    model, tokenizer = load_drawing_model(args.checkpoint)
    data = ShapesMultimodalDataModule(
        vocab=model.vocab, layout=MediaLayout.of(model), max_objects=args.max_objects,
        image_context=model.vision_encoder is not None,
    )  # fmt: skip
    data.tokenizer = tokenizer
    data.setup("validate")
    scenes = data.world.scenes("val", args.scenes)
    prompts = [data.generation_prompt(Task.TEXT_TO_IMAGE, s) for s in scenes]
    results = {}
    with torch.no_grad():
        baseline = random_codes(model, len(scenes), 1, torch.Generator().manual_seed(0))
        results["random_codes"] = errors(decode_visual(model, baseline).cpu(), scenes)
        for guidance, temperature, top_k in args.settings:
            generator = torch.Generator().manual_seed(0)
            codes = generate_visual(model, prompts, 1, guidance, temperature, top_k, None, generator)
            name = f"g{guidance}_T{temperature}_k{top_k}"
            results[name] = errors(decode_visual(model, codes).cpu(), scenes)
            log(f"{name}: {results[name]}")
    emit({"benchmark": "generation_errors", **info, "checkpoint": args.checkpoint, "scenes": args.scenes,
          "settings": results})  # fmt: skip


if __name__ == "__main__":
    main()
