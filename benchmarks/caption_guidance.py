"""Captions decoded with guidance against the model's own caption prior (an experiment, not an option yet).

Image to caption and speech to caption on held-out colour-shape pairs fail by writing a colour with a shape
seen beside it in training: the text prior outvotes the medium. This scores each greedy caption decoded
from `log p(. | medium, prefix) + g (log p(. | medium, prefix) - log p(. | prefix))`, the text-only
prefix being the `<bos> caption` document the captions task trains, with the plausibility constraint of
contrastive decoding (only ids within `--plausibility` of the conditional argmax's probability may be
picked; without it guidance spells words wrong). g = 0 is the plain greedy decode the gallery uses, so the
baseline is measured in the same run, on the same scenes; deltas are paired over scenes (95% intervals).

    .venv/bin/python benchmarks/caption_guidance.py runs/demo/multimodal/latest/checkpoints/last.ckpt \
        [--scenes 128] [--scales 0 1 2 4] [--plausibility 0.1]

Progress on stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, load_shapes_checkpoint, log, machine_info, mean_ci  # noqa: E402

from zoo.datamodules.sequence import TextSegment  # noqa: E402
from zoo.models.generation import collect, stream_text  # noqa: E402
from zoo.models.sampling import Sampler  # noqa: E402
from zoo.world.scenes import verify_caption  # noqa: E402

TASKS = ("image_to_text", "audio_to_text")


class PriorGuidedGreedy(Sampler):
    """Greedy over `conditional` rows guided against the rows after them (the text-only prior); every row
    is fed the conditional row's id, so each prior row follows its partner's caption."""

    def __init__(self, guidance: float, plausibility: float, conditional: int) -> None:
        super().__init__(temperature=0.0)
        self.guidance, self.floor, self.conditional = guidance, math.log(plausibility), conditional

    def sample(self, logits: Tensor) -> Tensor:
        logp = torch.log_softmax(logits.float(), dim=-1)
        cond, prior = logp[: self.conditional], logp[self.conditional :]
        plausible = cond >= cond.max(dim=-1, keepdim=True).values + self.floor
        guided = torch.where(plausible, cond + self.guidance * (cond - prior), -torch.inf)
        return super().sample(guided).repeat(2)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("checkpoint", help="a UnifiedPretraining checkpoint (make demo's last.ckpt)")
    parser.add_argument("--scenes", type=int, default=128, help="scenes per task and split")
    parser.add_argument("--scales", type=float, nargs="+", default=[0.0, 1.0, 2.0, 4.0], help="g (0: plain)")
    parser.add_argument("--plausibility", type=float, default=0.1, help="plausibility alpha")
    parser.add_argument("--max-tokens", type=int, default=48, help="as the gallery decodes captions")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if 0.0 not in args.scales:
        parser.error("--scales must include 0 (the plain decode every delta is paired against)")
    info = machine_info(args.threads)
    model, data = load_shapes_checkpoint(args.checkpoint)
    tasks = [t for t in TASKS if t != "audio_to_text" or model.ncp is not None]
    result: dict[str, object] = {"scenes": args.scenes, "plausibility": args.plausibility, **info}
    for split in ("val", "test"):
        scenes = data.world.scenes(split, args.scenes)
        prior = [[TextSegment([model.vocab.bos_id])] for _ in scenes]
        for task in tasks:
            prompts = [data.understanding_prompt(task, s, i, split) for i, s in enumerate(scenes)]
            batch = data.builder.collate_prompts(prompts + prior)
            plain: dict[str, list[float]] = {}
            for g in sorted(args.scales):
                sampler = PriorGuidedGreedy(g, args.plausibility, len(scenes))
                with torch.no_grad():
                    stream = stream_text(model, batch, args.max_tokens, sampler, (model.vocab.eos_id,))
                    ids = collect(stream, batch.batch_size)[: len(scenes)]
                scores = [verify_caption(data.decode(i), s) for i, s in zip(ids, scenes, strict=True)]
                for metric, values in (
                    ("exact", [float(s.exact) for s in scores]),
                    ("attributes", [s.attribute_accuracy for s in scores]),
                ):
                    key = f"{split}/{task}/g{g:g}/{metric}"
                    result[key] = round(sum(values) / len(values), 4)
                    if g == 0:
                        plain[metric] = values
                    else:
                        deltas = [a - b for a, b in zip(values, plain[metric], strict=True)]
                        result[f"{key}_delta"], result[f"{key}_delta_pm95"] = mean_ci(deltas)
                log(
                    f"{split} {task} g={g:g}: exact {result[f'{split}/{task}/g{g:g}/exact']} "
                    f"attributes {result[f'{split}/{task}/g{g:g}/attributes']}"
                )
    emit(result)


if __name__ == "__main__":
    main()
