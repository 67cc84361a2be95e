"""Where caption-to-image fails, scale by scale: a trained unified model's images with the true codes of the
first j scales given and the rest sampled, against the tokenizer's ceiling (the true codes decoded).

For `--scenes` val scenes of ShapesWorld, the scenes' images are encoded by the model's frozen tokenizer.
Then, for j = 0 .. K (K scales):
- `forced_j`: the model draws the image after its caption, but the codes of scales 1..j are the true ones;
  the decode is read back by `verify_image` (attributes, exact). `forced_0` is plain generation, `forced_K`
  the ceiling.
- `argmax_accuracy`: teacher-forced (all coarser scales true), the share of each scale's codes that the
  model's guided argmax gets right.
A big step from forced_j to forced_{j+1} says scale j+1 is where the model loses the scene; each forced_j also
says which attributes it loses there (cell, colour, shape, size: `generation_errors.py`).

    .venv/bin/python benchmarks/nfsp_scales.py runs/demo/multimodal/latest/checkpoints/last.ckpt [--scenes 32]

Progress on stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, load_drawing_model, log, machine_info  # noqa: E402
from generation_errors import errors  # noqa: E402

from zoo.batch import Modality  # noqa: E402
from zoo.datamodules.sequence import MediaLayout  # noqa: E402
from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule  # noqa: E402
from zoo.models.decode import prefill, text_prompts, visual_scale_step  # noqa: E402
from zoo.models.sampling import (
    Sampler,  # noqa: E402
    guided_logits,  # noqa: E402
)
from zoo.task_names import Task  # noqa: E402
from zoo.world.render import render_image, to_tensor, verify_image  # noqa: E402


@torch.no_grad()
def draw_with_true_scales(model, prompts, true_codes, forced, sampler, guidance):  # noqa: ANN001, ANN201
    """Codes per scale `[B, 1, s, s]`: scales < `forced` the true ones, the rest sampled; and the guided
    argmax accuracy of every scale given the codes before it."""
    nfsp, b = model.nfsp, len(prompts)
    rows = list(prompts) + ([[model.vocab.bos_id, p[-1]] for p in prompts] if guidance > 0 else [])
    _, cursor, cache = prefill(model, text_prompts(model, rows), nfsp.tokens_per_frame, None)
    t0, group = cursor.t, cursor.group
    codes = [torch.zeros(len(rows), 1, s, s, dtype=torch.long) for s in nfsp.scales]
    accuracy = []
    for k, side in enumerate(nfsp.scales):
        hidden = visual_scale_step(model, cache, codes, 0, k, t0, group, Modality.IMAGE)
        group = group + 1
        logits = guided_logits(nfsp.logits(hidden).float(), guidance, b)
        accuracy.append((logits.argmax(-1).view(b, side, side) == true_codes[k][:, 0]).float().mean().item())
        sampled = k >= forced
        token = sampler.sample(logits.flatten(0, 1)).view(b, side, side) if sampled else true_codes[k][:, 0]
        codes[k][:, 0] = token.repeat(len(rows) // b, 1, 1)
    return [c[:b] for c in codes], accuracy


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("checkpoint", help="a UnifiedPretraining checkpoint with a visual tokenizer")
    parser.add_argument("--scenes", type=int, default=32)
    parser.add_argument("--max-objects", type=int, default=2, help="as the model was trained (the demo: 2)")
    parser.add_argument("--temperature", type=float, default=0.5)
    parser.add_argument("--cfg-scale", type=float, default=2.0)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    info = machine_info(args.threads)
    model, tokenizer = load_drawing_model(args.checkpoint)
    layout = MediaLayout.of(model)
    data = ShapesMultimodalDataModule(vocab=model.vocab, layout=layout, max_objects=args.max_objects)
    data.tokenizer = tokenizer
    data.setup("validate")
    scenes = data.world.scenes("val", args.scenes)
    prompts = [data.generation_prompt(Task.TEXT_TO_IMAGE, s) for s in scenes]
    nfsp = model.nfsp
    pixels = torch.stack([to_tensor(render_image(s, nfsp.tokenizer.image_size)) for s in scenes])
    true_codes = nfsp.tokenizer.encode(pixels)

    def read(codes: list[torch.Tensor]) -> dict[str, float]:
        """Attribute accuracy, and exact with the attribute-by-attribute errors of `generation_errors.py`."""
        images = nfsp.decode(codes)
        scores = [verify_image(image, s) for image, s in zip(images, scenes, strict=True)]
        return {"attributes": round(sum(x.attribute_accuracy for x in scores) / len(scores), 4),
                **errors(images, scenes)}  # fmt: skip

    result: dict[str, object] = {}
    for forced in range(len(nfsp.scales) + 1):
        log(f"true codes for the first {forced} scales")
        generator = torch.Generator().manual_seed(args.seed)
        sampler = Sampler(args.temperature, args.top_k or None, None, generator)
        codes, accuracy = draw_with_true_scales(model, prompts, true_codes, forced, sampler, args.cfg_scale)
        result[f"forced_{forced}"] = read(codes)
        if forced == len(nfsp.scales):
            result["argmax_accuracy"] = [round(a, 4) for a in accuracy]
    emit({"benchmark": "nfsp_scales", **info, "checkpoint": args.checkpoint, "scenes": args.scenes,
          "scales": list(nfsp.scales), "temperature": args.temperature, "cfg_scale": args.cfg_scale,
          **result})


if __name__ == "__main__":
    main()
