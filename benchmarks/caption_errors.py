"""What a greedy caption gets wrong, attribute by attribute, for objects of held-out and of trained pairs
(issue 19: held-out pairs, and where a model that reads better held out loses on val).

For each checkpoint, `--scenes` scenes of each split are captioned as the gallery captions them (greedy, from
the image through the model's way of reading images, and from speech where the model has an NCP head); the
caption is parsed, and every true object is checked in its cell: named there at all (`cell`), and if so with
the right colour, shape and size (`generation_errors.object_errors`, the same counts caption to image gets).
Objects are counted three ways: all, those of a held-out colour-shape pair and those of a trained one. Several
checkpoints in one run compare models on the same scenes.

    .venv/bin/python benchmarks/caption_errors.py CKPT [CKPT ...] [--scenes 64]

Progress on stderr; the last stdout line is one JSON object, keyed `CKPT_INDEX/split/task/group`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, load_shapes_checkpoint, log, machine_info  # noqa: E402
from generation_errors import object_errors  # noqa: E402

from zoo.models.media_generation import generate_text_after  # noqa: E402
from zoo.world.scenes import parse_caption  # noqa: E402

TASKS = ("image_to_text", "audio_to_text")


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("checkpoints", nargs="+", help="UnifiedPretraining checkpoints (make demo's is one)")
    parser.add_argument("--scenes", type=int, default=64, help="scenes per split, the gallery's first ones")
    parser.add_argument("--max-tokens", type=int, default=48, help="as the gallery decodes captions")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    result: dict[str, object] = {"checkpoints": args.checkpoints, "scenes": args.scenes}
    result |= machine_info(args.threads)
    for c, checkpoint in enumerate(args.checkpoints):
        model, data = load_shapes_checkpoint(checkpoint)
        held = data.world.heldout_pairs
        groups = {
            "all": lambda obj: True,
            "heldout_pair": lambda obj, held=held: (obj.colour, obj.shape) in held,
            "trained_pair": lambda obj, held=held: (obj.colour, obj.shape) not in held,
        }
        for split in ("val", "test"):
            scenes = data.world.scenes(split, args.scenes)
            for task in (t for t in TASKS if t != "audio_to_text" or model.ncp is not None):
                prompts = [data.understanding_prompt(task, s, i, split) for i, s in enumerate(scenes)]
                ids = generate_text_after(model, data.builder.collate_prompts(prompts), args.max_tokens, 0.0)
                predicted = [parse_caption(data.decode(i)) for i in ids]
                for group, counted in groups.items():
                    errors = object_errors(predicted, scenes, counted)
                    if errors["objects"]:
                        result[f"{c}/{split}/{task}/{group}"] = errors
                log(f"{checkpoint} {split} {task}: {result[f'{c}/{split}/{task}/all']}")
    emit(result)


if __name__ == "__main__":
    main()
