"""Best of N by the model's own reading against one sample: caption to image and to speech (issue 19).

For `--scenes` scenes of `--split`, the model draws `--candidates` images (`--audio-candidates` utterances) a
caption at the gallery's sampling (guidance 2 for images; temperature 0.5 and top-k 8 unless `--temperature`,
`--top-k` say otherwise); the verifier scores every candidate. For each N (1, 2, 4, ... up to the candidates
drawn) the first N are ranked three ways:
- `reading`: the caption's log-prob when the model reads the candidate back (`zoo.inference.best_of`, what
  the gallery keeps);
- `likelihood`: the mean log-prob the model gave its own draws (sample-and-rank by likelihood: the control
  that says whether reading adds anything over picking the draws the model was surest of);
- `oracle`: the verifier picks (the upper bound of any ranking; it uses the ground truth, so it is no method).
N = 1 is one plain sample, the baseline both rankings must beat; random codes ranked by the same reading
(`random_codes_reading_*`, images) are the gallery's baseline given the same best of N. Also the seconds a
candidate costs to draw and to read. Prints one JSON line. `--chunking` instead times how the draws are
batched (`ROWS_PER_DRAW`).

    .venv/bin/python benchmarks/best_of.py runs/demo/multimodal/latest/checkpoints/last.ckpt
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, load_drawing_model, log, machine_info  # noqa: E402

from zoo.datamodules.sequence import AudioSegment, MediaLayout  # noqa: E402
from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule  # noqa: E402
from zoo.inference.best_of import ROWS_PER_DRAW, draw_candidates, prompt_caption, rank_candidates  # noqa: E402
from zoo.models.decode import Recording  # noqa: E402
from zoo.models.media_generation import draw_visual, speak  # noqa: E402
from zoo.models.refinement import decode_visual  # noqa: E402
from zoo.models.sampling import Sampler  # noqa: E402
from zoo.task_names import Task  # noqa: E402
from zoo.tasks.multimodal_eval import random_codes  # noqa: E402
from zoo.world.render import verify_image  # noqa: E402
from zoo.world.speech import SAMPLE_RATE, read_speech, verify_speech, word_accuracy  # noqa: E402


def mean_logprob(recording: Recording, rows: int) -> list[float]:
    """Per conditional row, the mean log-prob of the decisions it sampled (-inf for none)."""
    return [sum(r) / len(r) if r else -float("inf") for r in recording.logprobs[:rows]]


def picked(values: torch.Tensor, by: torch.Tensor) -> float:
    """Mean over scenes of `values[c, i]` at the candidate c that `by` ranks first, `[C, S]` both."""
    best = by.argmax(0)
    return values[best, torch.arange(values.shape[1])].mean().item()


def draw_with_likelihood(model, sampler: Sampler, audio: bool, rows: list[list[int]]) -> list[tuple]:
    """One draw a prompt (its codes, the mean log-prob of its sampled decisions), as the gallery samples."""
    if audio:
        recording = Recording(len(rows), routing=False)
        codes, _ = speak(model, rows, [160] * len(rows), sampler, recording)
        return list(zip(codes, mean_logprob(recording, len(rows)), strict=True))
    recording = Recording(2 * len(rows), routing=False)  # guidance's unconditional rows too
    scales = draw_visual(model, rows, 1, sampler, 2.0, recording=recording)
    per_prompt = [[c[i] for c in scales] for i in range(len(rows))]
    return list(zip(per_prompt, mean_logprob(recording, len(rows)), strict=True))


def decoded(model, audio: bool, row: list) -> list[torch.Tensor]:
    """One candidate a prompt, decoded: waveforms, or images."""
    if audio:
        return [model.ncp.decode(c[None])[0] if len(c) else torch.zeros(1) for c in row]
    return list(decode_visual(model, [torch.stack(s) for s in zip(*row, strict=True)]))


@torch.no_grad()
def random_ranked(model, data, scenes, n: int, prompts: list[list[int]]) -> tuple[torch.Tensor, ...]:
    """`n` random-code images a scene (the gallery's baseline): their exact `[n, S]`, reading scores and
    attributes, so that the baseline gets the same best of N as the model."""
    generator = torch.Generator().manual_seed(1)
    images = [list(decode_visual(model, random_codes(model, len(scenes), 1, generator))) for _ in range(n)]
    _, reading = rank_candidates(model, data.builder, [prompt_caption(q) for q in prompts],
                                 [[data.read(m) for m in row] for row in images])  # fmt: skip
    scores = [[verify_image(m, s) for m, s in zip(row, scenes, strict=True)] for row in images]
    exact = torch.tensor([[float(s.exact) for s in row] for row in scores])
    return exact, reading, torch.tensor([[s.attribute_accuracy for s in row] for row in scores])


@torch.no_grad()
def measure(model, data, scenes, task: Task, n: int, sampler: Sampler) -> dict[str, object]:
    """Draw `n` candidates a scene, score each with the verifier, rank the first 1, 2, 4, ... three ways."""
    audio = task == Task.TEXT_TO_AUDIO
    prompts = [data.generation_prompt(task, s) for s in scenes]
    start = time.perf_counter()
    candidates = draw_candidates(lambda r: draw_with_likelihood(model, sampler, audio, r), prompts, n,
                                 1 if audio else 2)  # fmt: skip
    drawn = time.perf_counter() - start
    likelihood = torch.tensor([[lp for _, lp in row] for row in candidates])
    codes = [[c for c, _ in row] for row in candidates]
    media = [decoded(model, audio, row) for row in codes]
    if audio:
        read = [[AudioSegment(codes=c, predict=False) if len(c) else None for c in row] for row in codes]
    else:
        read = [[data.read(m) for m in row] for row in media]
    start = time.perf_counter()
    _, reading = rank_candidates(model, data.builder, [prompt_caption(q) for q in prompts], read)
    read_s = time.perf_counter() - start
    scores = [[verify_speech(m, s, SAMPLE_RATE) if audio else verify_image(m, s)
               for m, s in zip(row, scenes, strict=True)] for row in media]  # fmt: skip
    measures = {
        "exact": torch.tensor([[float(s.exact) for s in row] for row in scores]),
        "attributes": torch.tensor([[s.attribute_accuracy for s in row] for row in scores]),
    }
    if audio:
        said = [data.world.caption(s) for s in scenes]
        heard = [[read_speech(m, SAMPLE_RATE) for m in row] for row in media]
        measures["words"] = torch.tensor([[word_accuracy(c, h) for h, c in zip(row, said, strict=True)]
                                          for row in heard])  # fmt: skip
    random = None if audio else random_ranked(model, data, scenes, n, prompts)
    by_candidates, k = {}, 1
    while k <= n:
        row = {}
        for name, values in measures.items():
            row[f"reading_{name}"] = round(picked(values[:k], reading[:k]), 4)
            row[f"likelihood_{name}"] = round(picked(values[:k], likelihood[:k]), 4)
            row[f"oracle_{name}"] = round(values[:k].max(0).values.mean().item(), 4)
        if random is not None:  # the baseline at the same ranking: random codes, best of k by reading
            row["random_codes_reading_exact"] = round(picked(random[0][:k], random[1][:k]), 4)
            row["random_codes_reading_attributes"] = round(picked(random[2][:k], random[1][:k]), 4)
        by_candidates[str(k)] = row
        log(f"{task} best of {k}: {row}")
        k *= 2
    return {"by_candidates": by_candidates, "draw_s_per_candidate": round(drawn / n, 3),
            "read_s_per_candidate": round(read_s / n, 3)}  # fmt: skip


@torch.no_grad()
def chunking(model, data, scenes, sampler: Sampler, n: int = 8) -> dict[str, dict[str, float]]:
    """Seconds to draw `n` candidates for every scene: one sampler call a candidate, one call for all, and
    calls of about `ROWS_PER_DRAW` rows (what `draw_candidates` does)."""
    out = {}
    for task in (Task.TEXT_TO_IMAGE, *((Task.TEXT_TO_AUDIO,) if model.ncp is not None else ())):
        audio = task == Task.TEXT_TO_AUDIO
        prompts = [data.generation_prompt(task, s) for s in scenes]

        def draw(rows: list[list[int]]) -> list:
            return draw_with_likelihood(model, sampler, audio, rows)  # noqa: B023 (called in this iteration)

        timed = {}
        for name, per_call in (("one_a_call", 1), ("all_in_one", n), ("rows_per_draw", None)):
            start = time.perf_counter()
            if per_call is None:
                draw_candidates(draw, prompts, n, 1 if audio else 2)
            else:
                for _ in range(n // per_call):
                    draw(prompts * per_call)
            timed[name] = round(time.perf_counter() - start, 2)
        out[str(task)] = timed
        log(f"{task}: {timed}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a UnifiedPretraining checkpoint trained on understanding too")
    p.add_argument("--scenes", type=int, default=64)
    p.add_argument("--split", default="val", choices=["val", "test"])
    p.add_argument("--candidates", type=int, default=16, help="images drawn a caption")
    p.add_argument("--audio-candidates", type=int, default=8, help="utterances drawn a caption (0: skip)")
    p.add_argument("--max-objects", type=int, default=2, help="as the model was trained (the demo: 2)")
    p.add_argument("--temperature", type=float, default=0.5, help="the gallery's 0.5")
    p.add_argument("--top-k", type=int, default=8, help="the gallery's 8")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunking", action="store_true", help="only time how the candidates are batched")
    args = p.parse_args()
    info = machine_info(args.threads)
    model, tokenizer = load_drawing_model(args.checkpoint)
    speech = model.ncp is not None and args.audio_candidates > 0
    data = ShapesMultimodalDataModule(
        vocab=model.vocab, layout=MediaLayout.of(model), max_objects=args.max_objects,
        image_context=model.vision_encoder is not None, text_to_audio_weight=float(speech),
    )  # fmt: skip
    data.tokenizer = tokenizer
    data.setup("validate")
    scenes = data.world.scenes(args.split, args.scenes)
    sampler = Sampler(args.temperature, args.top_k, None, torch.Generator().manual_seed(args.seed))
    if args.chunking:
        emit({"benchmark": "best_of_chunking", **info, "scenes": args.scenes, "rows_per_draw": ROWS_PER_DRAW,
              "seconds_for_8_candidates": chunking(model, data, scenes, sampler)})  # fmt: skip
        return
    tasks = {Task.TEXT_TO_IMAGE: args.candidates}
    if speech:
        tasks[Task.TEXT_TO_AUDIO] = args.audio_candidates
    results = {str(task): measure(model, data, scenes, task, n, sampler) for task, n in tasks.items()}
    emit({"benchmark": "best_of", **info, "checkpoint": args.checkpoint, "split": args.split,
          "scenes": args.scenes, "temperature": args.temperature, "top_k": args.top_k,
          "results": results})  # fmt: skip


if __name__ == "__main__":
    main()
