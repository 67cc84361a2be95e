"""Image captions ranked by how well each draws the image back (noisy-channel reranking; issue 19, held out).

Image to caption fails on held-out colour-shape pairs because the colour the model has just written vetoes
the shape (`benchmarks/colour_swap.py`): in training a held-out pair's colour is never followed by its
shape, so `p(caption | image)` has learned a prior that rules the pair out. The other direction of the same
model does not have that prior: caption to image is trained on the same captions but conditions on the whole
caption at once, and draws held-out pairs with val's attributes (docs/results.md). So this draws candidate
captions from the model (its greedy caption, `--samples` sampled ones and, with `--pool edits`, every
caption one colour or one shape from the greedy one), scores each one both ways,

- reading: `log p(caption | image)`, the understanding document (`zoo.inference.best_of.score_documents`);
- drawing: `log p(codes | caption)`, the caption-to-image document's teacher-forced NFSP log-prob of the
  image's own visual-tokenizer codes (the channel);
- prior: `log p(caption)`, the text-only captions document,

and keeps per scene the candidate a ranking likes best: reading alone, drawing + prior (the noisy channel,
Bayes' rule) and drawing + w x reading for each `--reading-weights` w (w = 0: drawing alone). The greedy
caption (what the gallery writes) is the baseline in the same run, on the same scenes; deltas are paired over
scenes (95% intervals). The oracle keeps the candidate the verifier likes best: what any ranking of this
pool could reach. No verifier or ground truth takes part in any ranking. Measured, and why it is not in the
gallery: docs/results.md, "Captions ranked by how well they draw the image back".

    .venv/bin/python benchmarks/caption_channel.py runs/demo/multimodal/latest/checkpoints/last.ckpt \
        [--scenes 64] [--samples 16] [--temperature 1.0] [--pool sampled|edits] [--reading-weights 0 1 2]

Progress on stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, load_shapes_checkpoint, log, machine_info, mean_ci  # noqa: E402

from zoo.datamodules.sequence import Document, SequenceBuilder, TextSegment, VisualSegment  # noqa: E402
from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule  # noqa: E402
from zoo.inference.best_of import score_documents  # noqa: E402
from zoo.models.media_generation import generate_text_after  # noqa: E402
from zoo.models.unified import UnifiedModel  # noqa: E402
from zoo.world.scenes import COLOURS, SHAPES, Scene, caption, parse_caption, verify_caption  # noqa: E402


def edits(text: str, order: str = "attributes_first") -> list[str]:
    """Every caption one colour or one shape away from `text` (none if the grammar cannot read it), in
    caption order `order`: the pool in which a caption whose shape the written colour vetoed has its right
    neighbour."""
    objects = parse_caption(text)
    if objects is None:
        return []
    out = []
    for j, obj in enumerate(objects):
        for field, values in (("colour", COLOURS), ("shape", SHAPES)):
            for value in values:
                if value != getattr(obj, field):
                    edited = (*objects[:j], replace(obj, **{field: value}), *objects[j + 1 :])
                    out.append(caption(Scene(edited, 0, "val"), order=order))
    return out


@torch.no_grad()
def score_drawings(model: UnifiedModel, builder: SequenceBuilder, documents: list[Document]) -> Tensor:
    """`[n]`: each document's summed log-prob of its visual codes (the NFSP head, teacher-forced, the codes
    being the visual tokenizer's of the document's own image; one document a row)."""
    batch = builder.collate_prompts(documents).to(next(model.parameters()).device)
    media = model.encode_media(batch)
    hidden = model.forward_hidden(batch, media=media).hidden
    slot = batch.targets["visual"]
    picked = slot >= 0
    logprobs = torch.log_softmax(model.nfsp.logits(hidden[picked]).float(), dim=-1)
    chosen = logprobs.gather(-1, media.visual.tokens[slot[picked]][:, None])[:, 0]
    rows = torch.arange(len(documents), device=hidden.device)[:, None].expand_as(picked)[picked]
    return torch.zeros(len(documents), device=hidden.device).index_add(0, rows, chosen).cpu()


def caption_pools(
    model: UnifiedModel, data: ShapesMultimodalDataModule, prompts: list, args: argparse.Namespace,
    generator: torch.Generator, split: str,
) -> tuple[list[tuple[int, ...]], list[set[tuple[int, ...]]]]:  # fmt: skip
    """Each prompt's greedy caption and its pool of candidates (unified text ids, `<eos>` dropped): the
    greedy one, `args.samples` sampled ones and, for `--pool edits`, the greedy one's `edits`."""
    eos = model.vocab.eos_id
    batch = data.builder.collate_prompts(prompts)

    def captions(temperature: float) -> list[tuple[int, ...]]:
        ids = generate_text_after(model, batch, args.max_tokens, temperature, generator=generator)
        return [tuple(i[:-1] if i[-1:] == [eos] else i) for i in ids]

    greedy = captions(0.0)
    pools = [{ids} for ids in greedy]
    for s in range(args.samples):
        for pool, ids in zip(pools, captions(args.temperature), strict=True):
            pool.add(ids)
        log(f"{split}: sampled {s + 1}/{args.samples} captions a scene")
    if args.pool == "edits":
        for pool, ids in zip(pools, greedy, strict=True):
            neighbours = edits(data.decode([*ids, eos]), data.world.caption_order)
            pool.update(tuple(data.caption_ids(text)) for text in neighbours)
    return greedy, pools


def candidate_scores(
    model: UnifiedModel, data: ShapesMultimodalDataModule, prompts: list, scenes: list[Scene],
    flat: list[tuple[int, list[int]]], batch: int,
) -> dict[str, Tensor]:  # fmt: skip
    """Every candidate's reading, drawing and prior log-prob; `flat[k]` = (its scene, its caption ids)."""
    vocab = model.vocab
    bos, eos = TextSegment([vocab.bos_id]), TextSegment([vocab.eos_id])
    documents = {
        "reading": [[*prompts[i], TextSegment([*ids, vocab.eos_id])] for i, ids in flat],
        "drawing": [
            [TextSegment([vocab.bos_id, *ids], predict=False), VisualSegment(data.image(scenes[i])), eos]
            for i, ids in flat
        ],
        "prior": [[bos, TextSegment([*ids, vocab.eos_id])] for _, ids in flat],
    }
    scores = {}
    for name, docs in documents.items():
        score = score_drawings if name == "drawing" else score_documents
        scores[name] = torch.cat(
            [score(model, data.builder, docs[k : k + batch]) for k in range(0, len(docs), batch)]
        )
    return scores


def picks(values: Tensor, flat: list[tuple[int, list[int]]], scenes: int) -> list[int]:
    """For each scene, the index into `flat` of its candidate with the highest value."""
    best = [-1] * scenes
    for k, (i, _) in enumerate(flat):
        if best[i] < 0 or values[k] > values[best[i]]:
            best[i] = k
    return best


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("checkpoint", help="a UnifiedPretraining checkpoint (make demo's last.ckpt)")
    parser.add_argument("--scenes", type=int, default=64, help="scenes per split")
    parser.add_argument("--samples", type=int, default=16, help="sampled captions a scene, beside the greedy")
    parser.add_argument("--temperature", type=float, default=1.0, help="of the sampled captions")
    parser.add_argument(
        "--pool", choices=("sampled", "edits"), default="sampled",
        help="candidates: the greedy and sampled captions, or those and every caption one colour or one "
        "shape from the greedy one (the world's grammar)",
    )  # fmt: skip
    parser.add_argument(
        "--reading-weights", type=float, nargs="+", default=[0.0, 0.5, 1.0, 2.0, 4.0],
        help="w of the rankings drawing + w * reading (0: drawing alone)",
    )  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=48, help="as the gallery decodes captions")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    info = machine_info(args.threads)
    model, data = load_shapes_checkpoint(args.checkpoint, drawing=True)  # it scores what captions draw
    eos = model.vocab.eos_id
    generator = torch.Generator().manual_seed(args.seed)  # one stream for both splits
    result: dict[str, object] = {"scenes": args.scenes, "samples": args.samples, "pool": args.pool, **info}
    for split in ("val", "test"):
        scenes = data.world.scenes(split, args.scenes)
        prompts = [data.understanding_prompt("image_to_text", s, i, split) for i, s in enumerate(scenes)]
        greedy, pools = caption_pools(model, data, prompts, args, generator, split)
        flat = [(i, list(ids)) for i, pool in enumerate(pools) for ids in sorted(pool)]
        score = candidate_scores(model, data, prompts, scenes, flat, args.batch)
        log(f"{split}: scored {len(flat)} candidates ({len(flat) / len(scenes):.1f} a scene)")
        verdicts = [verify_caption(data.decode([*ids, eos]), scenes[i]) for i, ids in flat]
        rankings = {"reading": score["reading"], "drawing_prior": score["drawing"] + score["prior"]}
        for w in args.reading_weights:
            rankings[f"drawing_reading_w{w:g}"] = score["drawing"] + w * score["reading"]
        rankings["oracle"] = torch.tensor([v.attribute_accuracy + float(v.exact) for v in verdicts])
        kept = {
            name: [verdicts[k] for k in picks(values, flat, len(scenes))] for name, values in rankings.items()
        }
        plain = [verify_caption(data.decode([*ids, eos]), s) for ids, s in zip(greedy, scenes, strict=True)]
        result[f"{split}/candidates_per_scene"] = round(len(flat) / len(scenes), 2)
        for metric in ("exact", "attribute_accuracy"):
            base = [float(getattr(v, metric)) for v in plain]
            result[f"{split}/greedy/{metric}"] = round(sum(base) / len(base), 4)
            for name, chosen in kept.items():
                values = [float(getattr(v, metric)) for v in chosen]
                key = f"{split}/{name}/{metric}"
                result[key] = round(sum(values) / len(values), 4)
                deltas = [a - b for a, b in zip(values, base, strict=True)]
                result[f"{key}_delta"], result[f"{key}_delta_pm95"] = mean_ci(deltas)
        summary = (f"{n} {result[f'{split}/{n}/exact']} ({result[f'{split}/{n}/attribute_accuracy']})"
                   for n in ("greedy", *kept))  # fmt: skip
        log(f"{split}: " + ", ".join(summary))
    emit(result)


if __name__ == "__main__":
    main()
