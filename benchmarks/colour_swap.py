"""Is a caption's shape read from the medium, or from the colour written before it? (issue 19, held-out pairs)

Image to caption on held-out colour-shape pairs writes the colour with a shape seen beside it in training.
Two causes would look the same in the gallery: the model reads the shape wrong from the medium, or it reads
it right and the colour it has just written outvotes it (in training, a held-out pair's colour is never
followed by its shape). This tells them apart. For each object of a scene the true caption is fed up to and
including the object's colour, and the model's next word is read among the shapes: the shape whose
byte-pair ids it gives the highest log-prob, teacher-forced. Then the colour is swapped for each other
colour and the shape read again. A shape right after a swapped colour but wrong after the true one means
the written colour is what misleads it.

    .venv/bin/python benchmarks/colour_swap.py runs/demo/multimodal/latest/checkpoints/last.ckpt \
        [--scenes 128]

Reported per split, task and object group (all, held-out pair, trained pair): `shape_true_colour` (the
shape right after the true colour), `shape_swapped` (over the other colours) and `shape_swapped_to_trained`
(over the colours whose pair with the true shape was trained). Progress on stderr; the last stdout line is
one JSON object.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, load_shapes_checkpoint, log, machine_info  # noqa: E402

from zoo.datamodules.sequence import TextSegment  # noqa: E402
from zoo.inference.best_of import score_documents  # noqa: E402
from zoo.world.scenes import COLOURS, SHAPES, Scene, caption  # noqa: E402

TASKS = ("image_to_text", "audio_to_text")


def object_prefixes(
    scene: Scene, colour: str | None = None, order: str = "attributes_first"
) -> list[tuple[str, str]]:
    """(caption words up to and including object j's colour, object j's shape) for each object j; with
    `colour`, that colour is written instead of object j's own; `order` is the world's caption order."""
    if order == "shape_first":
        raise ValueError("colour_swap reads a shape after its colour; a shape_first caption writes it before")
    words = caption(scene, order=order).split()
    out, start = [], 0
    for obj in scene.objects:
        start = words.index("a", start)  # each object's phrase opens with "a": a size, colour, shape
        prefix = [*words[: start + 2], colour or obj.colour]
        out.append((" ".join(prefix), obj.shape))
        start += 4
    return out


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("checkpoint", help="a UnifiedPretraining checkpoint (make demo's last.ckpt)")
    parser.add_argument("--scenes", type=int, default=128, help="scenes per task and split")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    info = machine_info(args.threads)
    model, data = load_shapes_checkpoint(args.checkpoint)
    shape_ids = {shape: data.caption_ids(f" {shape}") for shape in SHAPES}  # several byte-pair ids each
    heldout = data.world.heldout_pairs
    tasks = [t for t in TASKS if t != "audio_to_text" or model.ncp is not None]
    result: dict[str, object] = {"scenes": args.scenes, **info}
    for split in ("val", "test"):
        scenes = data.world.scenes(split, args.scenes)
        for task in tasks:
            # rows: (prompt documents, one a shape; the true shape; the swapped colour or None; held-out pair)
            rows: list[tuple[list, str, str | None, bool]] = []
            order = data.world.caption_order
            for i, scene in enumerate(scenes):
                medium = data.understanding_prompt(task, scene, i, split)
                for j, obj in enumerate(scene.objects):
                    pair_held = (obj.colour, obj.shape) in heldout
                    for colour in (None, *[c for c in COLOURS if c != obj.colour]):
                        prefix = TextSegment(
                            data.caption_ids(object_prefixes(scene, colour, order)[j][0]), predict=False
                        )
                        documents = [[*medium, prefix, TextSegment(shape_ids[s])] for s in SHAPES]
                        rows.append((documents, obj.shape, colour, pair_held))
            read: list[str] = []
            per_batch = max(1, args.batch // len(SHAPES))
            for b in range(0, len(rows), per_batch):
                chunk = rows[b : b + per_batch]
                scores = score_documents(model, data.builder, [d for r in chunk for d in r[0]])
                read += [SHAPES[k] for k in scores.view(len(chunk), len(SHAPES)).argmax(-1).tolist()]
                if (b // per_batch) % 20 == 0:
                    log(f"{split} {task}: {min(b + per_batch, len(rows))}/{len(rows)} prompts")
            for group, held in (("all", None), ("heldout_pair", True), ("trained_pair", False)):
                true_c, swapped, to_trained = [], [], []
                for (_, shape, colour, pair_held), got in zip(rows, read, strict=True):
                    if held is not None and pair_held != held:
                        continue
                    right = float(got == shape)
                    if colour is None:
                        true_c.append(right)
                    else:
                        swapped.append(right)
                        if (colour, shape) not in heldout:
                            to_trained.append(right)
                key = f"{split}/{task}/{group}"
                result[f"{key}/objects"] = len(true_c)
                for name, values in (
                    ("shape_true_colour", true_c),
                    ("shape_swapped", swapped),
                    ("shape_swapped_to_trained", to_trained),
                ):
                    if values:
                        result[f"{key}/{name}"] = round(sum(values) / len(values), 4)
                log(
                    f"{key}: "
                    + ", ".join(f"{k.split('/')[-1]} {v}" for k, v in result.items() if k.startswith(key))
                )
    emit(result)


if __name__ == "__main__":
    main()
