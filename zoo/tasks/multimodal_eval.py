"""Evaluation of the unified model on ShapesWorld in every modality, and the gallery page of its outputs.

For each task the model supports (its tokenizers) and the data enables, `evaluate` runs the model on
`n` scenes and scores the result with the world's exact verifiers, next to a trivial baseline scored
the same way on the same scenes:

    text_to_image / text_to_video   verify_image / verify_video of the decoded generation;
                                    baseline: random codes, decoded
    image_to_text / video_to_text   exact match of the generated caption (verify_caption);
    audio_to_text                   baseline: the most frequent training caption
    text_to_audio                   verify_speech of the decoded generation, and the share of the caption's
                                    words read back in place (word_accuracy); baseline: random codes

Every generation task also reports its ceiling (`ceiling_exact`, `ceiling_attribute_accuracy`, for speech
`ceiling_word_accuracy`): the same verifier on the scenes' true media encoded and decoded by the frozen
tokenizer. A model draws codes, so it cannot score above what its tokenizer reconstructs; a low ceiling says
the tokenizer, not the model, needs the budget (docs/results.md, issue 19).

`write_gallery` saves every sample (PNG, GIF, WAV) with a Markdown page that shows each beside its
prompt and verifier score.

Given an `ImageRefinement` (the diffusion refiner, `zoo.models.refinement`), caption-to-image decodes are
also refined and scored again (`refined_exact`, `psnr`, `refined_psnr`, ...: `zoo.tasks.refined_eval`); the
page shows the decode and the refined image side by side. Every other key stays as it is.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from zoo.datamodules.requests import MediaRequest, MediaRequests
from zoo.datamodules.sequence import AudioSegment, document_length
from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule
from zoo.inference.best_of import best_of_speech, best_of_visual, check_best_of
from zoo.media.writing import save_gif, save_png, save_spectrogram_png, save_wav
from zoo.models.media_generation import generate_audio, generate_text_after, generate_visual
from zoo.models.nfsp import unflatten_scales
from zoo.models.refinement import ImageRefinement, decode_visual
from zoo.models.unified import UnifiedModel
from zoo.task_names import GENERATION, UNDERSTANDING, Task
from zoo.tasks.refined_eval import refined_metrics
from zoo.world.render import verify_image, verify_video
from zoo.world.scenes import CaptionScore, Scene, verify_caption
from zoo.world.speech import SAMPLE_RATE, read_speech, verify_speech, word_accuracy


@dataclass
class Sample:
    """One evaluated sample: what went in, what came out, how the verifier scored it."""

    task: str
    scene: Scene
    prompt: str
    output: str = ""  # generated caption (understanding) or "" (generation)
    media: Tensor | None = None  # generated or given pixels / waveform
    score: CaptionScore | None = None
    refined: Tensor | None = None  # the refiner's output from the same codes (caption to image, when refined)
    refined_score: CaptionScore | None = None


@dataclass
class Evaluation:
    metrics: dict[str, float] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)


def supported_tasks(model: UnifiedModel, data: ShapesMultimodalDataModule) -> list[Task]:
    tasks = []
    for task in (*GENERATION, *UNDERSTANDING):
        if data.weights.get(task, 0) <= 0:
            continue
        if task.media == "audio" and model.ncp is None:
            continue
        context = (task is Task.IMAGE_TO_TEXT and data.image_context) or (
            task is Task.VIDEO_TO_TEXT and data.video_context
        )
        if context:  # read through the vision encoder, whatever the visual tokenizer
            tasks.append(task)
            continue
        if task.media == "video" and (model.nfsp is None or not model.nfsp.tokenizer.temporal):
            continue
        if task.media == "image" and model.nfsp is None:
            continue
        tasks.append(task)
    return tasks


def _mean(scores: list[CaptionScore], field_name: str) -> float:
    return sum(float(getattr(s, field_name)) for s in scores) / max(len(scores), 1)


def interval95(values: list[float], proportion: bool = False) -> tuple[float, float]:
    """95% interval of the mean of `values` in [0, 1]: Wilson's for a proportion of 0/1 outcomes (honest at
    0 and 1, where the normal one collapses to a point), else mean +- 1.96 standard errors, clipped."""
    n = len(values)
    if n == 0:
        return 0.0, 1.0
    mean = sum(values) / n
    if proportion:
        z2 = 1.96**2
        centre = (mean + z2 / (2 * n)) / (1 + z2 / n)
        half = 1.96 * math.sqrt(mean * (1 - mean) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    else:
        var = sum((v - mean) ** 2 for v in values) / max(n - 1, 1)
        centre, half = mean, 1.96 * math.sqrt(var / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _scored(
    task: str, scores: list[CaptionScore], base: list[CaptionScore], scenes: list[Scene]
) -> dict[str, float]:
    """The model's and the baseline's exact and attribute scores, with the model's 95% intervals, and the
    model's exact by the number of objects in the scene (`task/exact_objects_<n>`, `task/scenes_objects_<n>`):
    a score that holds for one object and fails for two says the model cannot compose, not that it cannot
    draw or read."""
    exact = [float(s.exact) for s in scores]
    attributes = [float(s.attribute_accuracy) for s in scores]
    metrics = {
        f"{task}/exact": _mean(scores, "exact"),
        f"{task}/attribute_accuracy": _mean(scores, "attribute_accuracy"),
        f"{task}/baseline_exact": _mean(base, "exact"),
        f"{task}/baseline_attribute_accuracy": _mean(base, "attribute_accuracy"),
    }
    for name, values, proportion in (("exact", exact, True), ("attribute_accuracy", attributes, False)):
        low, high = interval95(values, proportion)
        metrics[f"{task}/{name}_ci95_low"], metrics[f"{task}/{name}_ci95_high"] = low, high
    counts = [len(s.objects) for s in scenes]
    for n in sorted(set(counts)):
        of_n = [e for e, c in zip(exact, counts, strict=True) if c == n]
        metrics[f"{task}/exact_objects_{n}"] = sum(of_n) / len(of_n)
        metrics[f"{task}/scenes_objects_{n}"] = float(len(of_n))
    return metrics


def random_codes(model: UnifiedModel, n: int, frames: int, generator: torch.Generator) -> list[Tensor]:
    nfsp = model.nfsp
    size = nfsp.tokenizer.codebook_size
    flat = torch.randint(0, size, (n, frames * nfsp.tokens_per_frame), generator=generator)
    return unflatten_scales(flat, nfsp.scales, frames)


@torch.no_grad()
def evaluate(
    model: UnifiedModel,
    data: ShapesMultimodalDataModule,
    n: int = 16,
    split: str = "val",
    cfg_scale: float = 2.0,
    temperature: float = 1.0,
    top_k: int | None = 8,
    max_caption_tokens: int = 48,
    max_audio_frames: int = 160,
    seed: int = 0,
    tasks: list[str] | None = None,
    caption_temperature: float = 0.0,
    refinement: ImageRefinement | None = None,
    audio_cfg_scale: float = 0.0,
    best_of: int = 1,
    audio_best_of: int = 1,
) -> Evaluation:
    """Score the model on `n` scenes of `split` per task; metrics are keyed `task/verifier`.

    Media are sampled at `temperature` with `top_k` (and guidance `cfg_scale`); captions are decoded at
    `caption_temperature` (0: greedy, the one best answer, which is what exact match should judge).
    refinement: also refine and score the caption-to-image decodes (the same codes; `refined_*` keys).
    audio_cfg_scale: guidance of caption to speech (0: off; for a model trained with caption-less speech).
    best_of, audio_best_of: draw this many images (videos) / utterances a caption and keep the one the model
    itself reads back as the caption most likely (`zoo.inference.best_of`; 1: one sample). The usual keys
    then score the kept ones; `task/one_sample_exact` and `task/one_sample_attribute_accuracy` (for speech
    also `.../one_sample_word_accuracy`) score the first candidates, one plain sample each, and
    `task/best_of` says how many were drawn."""
    check_best_of(best_of=best_of, audio_best_of=audio_best_of)
    if data.tokenizer is None:
        data.setup("validate")
    if refinement is not None and model.nfsp is not None:  # refused before any generation
        refinement.check_fits(model.nfsp.tokenizer.image_size)
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    cpu_generator = torch.Generator().manual_seed(seed)
    result = Evaluation()
    for task in map(Task, tasks or supported_tasks(model, data)):
        world = data.motion_world if task.media == "video" else data.world
        scenes = world.scenes(split, n)
        if task in GENERATION:
            guidance = audio_cfg_scale if task == Task.TEXT_TO_AUDIO else cfg_scale
            draws = audio_best_of if task == Task.TEXT_TO_AUDIO else best_of
            _evaluate_generation(model, data, task, scenes, guidance, temperature, top_k, max_audio_frames,
                                 generator, cpu_generator, result, draws)
            if refinement is not None and task == Task.TEXT_TO_IMAGE:
                _refine_samples(task, refinement, result)
        else:
            _evaluate_understanding(model, data, task, scenes, split, caption_temperature, top_k,
                                    max_caption_tokens, generator, result)
    return result


def _verify(task: str, media: Tensor, scene: Scene, data: ShapesMultimodalDataModule) -> CaptionScore:
    if task == Task.TEXT_TO_IMAGE:
        return verify_image(media, scene)
    if task == Task.TEXT_TO_VIDEO:
        return verify_video(media, scene)
    return verify_speech(media, scene, SAMPLE_RATE)


def _evaluate_generation(model, data, task, scenes, cfg_scale, temperature, top_k, max_frames,
                         generator, cpu_generator, result, best_of=1) -> None:  # noqa: ANN001 (internal)
    prompts = [data.generation_prompt(task, s) for s in scenes]
    codes, first = _draw(model, data, task, prompts, cfg_scale, temperature, top_k, max_frames, generator,
                         best_of)
    media = _decoded(model, task, codes)
    if task == Task.TEXT_TO_AUDIO:
        q, size = model.ncp.levels, model.ncp.size
        baseline = [
            model.ncp.decode(torch.randint(0, size, (1, max(len(c), 1), q), generator=cpu_generator))[0]
            for c in codes
        ]
    else:
        frames = data.layout.latent_frames(data.video_frames) if task == Task.TEXT_TO_VIDEO else 1
        baseline = list(decode_visual(model, random_codes(model, len(scenes), frames, cpu_generator)).cpu())
    scores = [_verify(task, m, s, data) for m, s in zip(media, scenes, strict=True)]
    base = [_verify(task, m, s, data) for m, s in zip(baseline, scenes, strict=True)]
    ceiling = _reconstructions(model, data, task, scenes)
    result.metrics.update(_ceiling_metrics(task, ceiling, scenes, data))
    world = data.motion_world if task.media == "video" else data.world
    for scene, m, score in zip(scenes, media, scores, strict=True):
        result.samples.append(Sample(task, scene, world.caption(scene), media=m, score=score))
    result.metrics.update(_scored(task, scores, base, scenes))
    said = [world.caption(s) for s in scenes]
    if task == Task.TEXT_TO_AUDIO:  # partial credit: the right words in a caption that does not parse
        for key, waves in (("word_accuracy", media), ("baseline_word_accuracy", baseline)):
            words = _words(said, waves)
            result.metrics[f"{task}/{key}"] = sum(words) / max(len(words), 1)
            if key == "word_accuracy":
                low, high = interval95(words)
                result.metrics.update({f"{task}/{key}_ci95_low": low, f"{task}/{key}_ci95_high": high})
    if first is not None:  # what one sample scores, beside the best of `best_of`
        one = _decoded(model, task, first)
        one_scores = [_verify(task, m, s, data) for m, s in zip(one, scenes, strict=True)]
        result.metrics[f"{task}/best_of"] = float(best_of)
        result.metrics[f"{task}/one_sample_exact"] = _mean(one_scores, "exact")
        result.metrics[f"{task}/one_sample_attribute_accuracy"] = _mean(one_scores, "attribute_accuracy")
        if task == Task.TEXT_TO_AUDIO:
            words = _words(said, one)
            result.metrics[f"{task}/one_sample_word_accuracy"] = sum(words) / max(len(words), 1)


def _draw(model, data, task, prompts, cfg_scale, temperature, top_k, max_frames, generator,
          best_of) -> tuple[list[Tensor], list[Tensor] | None]:  # noqa: ANN001 (internal)
    """Each prompt's codes (speech: `[F, Q]` a prompt; images and videos: per scale `[B, frames, s, s]`, as
    `decode_visual` takes them): one sample, or the best of `best_of` by the model's own reading
    (`zoo.inference.best_of`), and then also the first candidates (one plain sample each) to score beside."""
    if task == Task.TEXT_TO_AUDIO:
        def speech(rows: list[list[int]]) -> list[Tensor]:
            return generate_audio(model, rows, max_frames, temperature, top_k, None, generator, cfg_scale)

        if best_of == 1:
            return speech(prompts), None
        return best_of_speech(model, data.builder, prompts, best_of, speech)
    frames = data.layout.latent_frames(data.video_frames) if task == Task.TEXT_TO_VIDEO else 1

    def visual(rows: list[list[int]]) -> list[Tensor]:
        return generate_visual(model, rows, frames, cfg_scale, temperature, top_k, None, generator)

    if best_of == 1:
        return visual(prompts), None
    return best_of_visual(model, data.builder, prompts, best_of, visual, data.read, 2 if cfg_scale > 0 else 1)


def _decoded(
    model: UnifiedModel, task: Task, codes: list[Tensor], refinement: ImageRefinement | None = None
) -> list[Tensor]:
    """Codes as `_draw` gives them, decoded to waveforms `[N]` or pixels (refined, given a refinement), on
    the CPU."""
    if task == Task.TEXT_TO_AUDIO:
        return [model.ncp.decode(c[None])[0].cpu() if len(c) else torch.zeros(1) for c in codes]
    return list(decode_visual(model, codes, refinement).cpu())


def _words(captions: list[str], waves: list[Tensor]) -> list[float]:
    """Per caption, the share of its words `read_speech` hears in place in its waveform."""
    return [word_accuracy(c, read_speech(w, SAMPLE_RATE)) for c, w in zip(captions, waves, strict=True)]


def _reconstructions(model: UnifiedModel, data: ShapesMultimodalDataModule, task: Task,
                     scenes: list[Scene]) -> list[Tensor]:
    """The scenes' true media through the frozen tokenizer (encode, decode): the best a generation can be
    scored, since the model only ever draws codes the tokenizer decodes."""
    if task == Task.TEXT_TO_AUDIO:
        world = data.world
        waves = [data.speech(world.caption(s), "val", i, 0) for i, s in enumerate(scenes)]
        codec = model.ncp.codec
        return [codec.decode(codec.encode(w[None].float()))[0].cpu() for w in waves]
    render = data.video if task == Task.TEXT_TO_VIDEO else data.image
    pixels = torch.stack([render(s) for s in scenes]).to(next(model.parameters()).device)
    return list(decode_visual(model, model.nfsp.tokenizer.encode(pixels)).cpu())


def _ceiling_metrics(task: Task, media: list[Tensor], scenes: list[Scene],
                     data: ShapesMultimodalDataModule) -> dict[str, float]:
    """`task/ceiling_*`: the verifier's scores of the tokenizer's reconstructions (`_reconstructions`)."""
    scores = [_verify(task, m, s, data) for m, s in zip(media, scenes, strict=True)]
    metrics = {f"{task}/ceiling_exact": _mean(scores, "exact"),
               f"{task}/ceiling_attribute_accuracy": _mean(scores, "attribute_accuracy")}
    if task == Task.TEXT_TO_AUDIO:
        words = _words([data.world.caption(s) for s in scenes], media)
        metrics[f"{task}/ceiling_word_accuracy"] = sum(words) / max(len(words), 1)
    return metrics


def _refine_samples(task: Task, refinement: ImageRefinement, result: Evaluation) -> None:
    """Refine the decodes of `task`'s samples just evaluated, score them and add the refined metrics."""
    samples = [s for s in result.samples if s.task == task]
    refined = list(refinement.refine(torch.stack([s.media for s in samples])).cpu())
    scores, metrics = refined_metrics(task, [s.media for s in samples], refined, [s.scene for s in samples])
    for sample, image, score in zip(samples, refined, scores, strict=True):
        sample.refined, sample.refined_score = image, score
    result.metrics.update(metrics)


def _evaluate_understanding(model, data, task, scenes, split, temperature, top_k, max_tokens,
                            generator, result) -> None:  # noqa: ANN001 (internal)
    world = data.motion_world if task.media == "video" else data.world
    prompts = [data.understanding_prompt(task, s, i, split) for i, s in enumerate(scenes)]
    batch = data.builder.collate_prompts(prompts).to(next(model.parameters()).device)
    ids = generate_text_after(model, batch, max_tokens, temperature, top_k, None, None, generator)
    texts = [data.decode(i) for i in ids]
    include_motion = task.media == "video"
    scores = [verify_caption(t, s, include_motion) for t, s in zip(texts, scenes, strict=True)]
    frequent = Counter(world.caption(s) for s in world.scenes("train", 2048)).most_common(1)[0][0]
    base = [verify_caption(frequent, s, include_motion) for s in scenes]
    for prompt, scene, text, score in zip(prompts, scenes, texts, scores, strict=True):
        media = next(seg for seg in prompt if hasattr(seg, "pixels") or hasattr(seg, "wave"))
        given = getattr(media, "pixels", None)
        given = given if given is not None else getattr(media, "wave", None)
        result.samples.append(Sample(task, scene, world.caption(scene), text, given, score))
    result.metrics.update(_scored(task, scores, base, scenes))


@torch.no_grad()
def answer_requests(
    model: UnifiedModel,
    data: ShapesMultimodalDataModule,
    requests: list[MediaRequest] | MediaRequests,
    cfg_scale: float = 2.0,
    temperature: float = 1.0,
    top_k: int | None = 8,
    max_caption_tokens: int = 48,
    max_audio_frames: int = 160,
    refinement: ImageRefinement | None = None,
    best_of: int = 1,
    audio_best_of: int = 1,
) -> list[dict[str, object]]:
    """Rows for `GenerationWriter`: {"task", "name", "text" or "media", "scores" when the scene is known}.

    refinement: generated images and video frames are refined (`decode_visual`) before they are written and
    scored. best_of, audio_best_of: as `evaluate`'s (the best of that many by the model's own reading)."""
    check_best_of(best_of=best_of, audio_best_of=audio_best_of)
    if refinement is not None and model.nfsp is not None:  # refused before any generation
        refinement.check_fits(model.nfsp.tokenizer.image_size)
    model.eval()
    if isinstance(requests, MediaRequests):
        requests = requests.requests
    rows: list[dict[str, object]] = []
    limit = model.backbone.max_seq_len
    for request in requests:
        if request.error is None:
            request.error = _too_long(request, data, limit, max_caption_tokens, max_audio_frames)
    for request in (r for r in requests if r.error is not None):
        rows.append({"task": request.task, "name": request.name, "error": request.error})
    requests = [r for r in requests if r.error is None]
    for task in dict.fromkeys(Task(r.task) for r in requests):
        chosen = [r for r in requests if r.task == task]
        if task in GENERATION:
            prompts = [r.prompt for r in chosen]
            audio = task == Task.TEXT_TO_AUDIO
            guidance, draws = (0.0, audio_best_of) if audio else (cfg_scale, best_of)
            codes, _ = _draw(model, data, task, prompts, guidance, temperature, top_k, max_audio_frames, None,
                             draws)
            media = _decoded(model, task, codes, refinement)
            for r, m in zip(chosen, media, strict=True):
                row: dict[str, object] = {"task": task, "name": r.name, "prompt": data.decode(r.prompt)}
                row["media"] = m
                if r.scene is not None:
                    row["scores"] = asdict(_verify(task, m, r.scene, data))
                rows.append(row)
        else:
            device = next(model.parameters()).device
            batch = data.builder.collate_prompts([r.document for r in chosen]).to(device)
            ids = generate_text_after(model, batch, max_caption_tokens, temperature, None)
            for r, out in zip(chosen, ids, strict=True):
                text = data.decode(out)
                row = {"task": task, "name": r.name, "text": text}
                if r.scene is not None:
                    row["scores"] = asdict(verify_caption(text, r.scene, task.media == "video"))
                rows.append(row)
    return rows


def _too_long(
    request: MediaRequest,
    data: ShapesMultimodalDataModule,
    limit: int,
    caption_tokens: int,
    audio_frames: int,
) -> str | None:
    """Why a request does not fit the model's context (positions, the limit, what to change), or None."""
    if request.document is not None:
        length = document_length(request.document, data.layout)
        budget, what = caption_tokens, "caption tokens"
    else:
        length = len(request.prompt or [])
        if request.task == Task.TEXT_TO_AUDIO:
            budget, what = audio_frames + 2, "audio frames"
        else:
            frames = data.layout.latent_frames(data.video_frames) if request.task == Task.TEXT_TO_VIDEO else 1
            budget, what = 2 + frames * data.layout.tokens_per_frame, "visual codes"
    if length + budget <= limit:
        return None
    message = (
        f"{request.name}: the prompt takes {length} positions and the answer up to {budget} {what}, "
        f"{length + budget} in all, over the model's max_seq_len of {limit}"
    )
    if request.document is not None and any(isinstance(s, AudioSegment) for s in request.document):
        seconds = max(0, limit - budget - 4) * data.layout.audio_hop / SAMPLE_RATE
        return message + f"; audio of about {seconds:.1f} s at most fits (cut the file)"
    return message + ("; use a smaller file" if request.document is not None else "; use a shorter prompt")


def save_media(media: Tensor, path: Path, upscale: int = 4) -> Path:
    """A waveform `[N]` as WAV, an image `[3, H, W]` as PNG, a video `[3, T, H, W]` as GIF (pixels scaled up
    `upscale` times, nearest, so a 32-pixel image is visible on a page). Returns the written path."""
    if media.dim() == 1:
        return save_wav(media, path.with_suffix(".wav"), SAMPLE_RATE)
    frames = media.unsqueeze(0) if media.dim() == 3 else media.transpose(0, 1)
    big = torch.nn.functional.interpolate(frames, scale_factor=upscale, mode="nearest")
    if media.dim() == 3:
        return save_png(big[0], path.with_suffix(".png"))
    return save_gif(big.transpose(0, 1), path.with_suffix(".gif"))


def _save_media(sample: Sample, path: Path) -> str:
    return "" if sample.media is None else save_media(sample.media, path).name


def _cell(m: dict[str, float], key: str) -> str:
    """`0.42 [0.30, 0.55]`: a score with its 95% interval, when the evaluation gave one."""
    low, high = m.get(f"{key}_ci95_low"), m.get(f"{key}_ci95_high")
    return f"{m[key]:.2f}" + (f" [{low:.2f}, {high:.2f}]" if low is not None and high is not None else "")


def _ceiling(m: dict[str, float], p: str) -> str:
    """The tokenizer's ceiling cell of a generation task: `exact / attributes[ / words]`; empty otherwise."""
    if f"{p}/ceiling_exact" not in m:
        return ""
    cell = f"{m[f'{p}/ceiling_exact']:.2f} / {m[f'{p}/ceiling_attribute_accuracy']:.2f}"
    return cell + (f" / {m[f'{p}/ceiling_word_accuracy']:.2f}" if f"{p}/ceiling_word_accuracy" in m else "")


def _by_objects(m: dict[str, float], p: str) -> str:
    """`1: 0.31 of 29; 2: 0.00 of 35`: exact by the number of objects in the scene, when scored so."""
    counts = sorted(int(k.rsplit("_", 1)[1]) for k in m if k.startswith(f"{p}/exact_objects_"))
    return "; ".join(f"{n}: {m[f'{p}/exact_objects_{n}']:.2f} of {m[f'{p}/scenes_objects_{n}']:.0f}"
                     for n in counts)  # fmt: skip


def _verdict(score: CaptionScore | None) -> str:
    """A verifier score as the gallery's sample rows say it."""
    if score is None or not score.parsed:
        return "unreadable"
    return f"{'exact' if score.exact else 'inexact'}, attributes {score.attribute_accuracy:.2f}"


def write_gallery(evaluation: Evaluation, directory: str | Path, title: str = "ShapesWorld gallery") -> Path:
    """Save every sample's media, `overview.png` (every task at a glance, verdicts marked), a Markdown page
    (`gallery.md`) and `metrics.json`; returns the page. Metrics of further splits, keyed `<split>/<task>/..`
    (`MultimodalGallery(score_splits=...)`), get their own rows in the page's table."""
    from zoo.tasks.gallery_overview import CURVE_FILE, curve_figure, overview_figure

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "metrics.json").write_text(json.dumps(evaluation.metrics, indent=2) + "\n")
    m = evaluation.metrics
    lines = [f"# {title}", "", "![every task at a glance](overview.png)", "",
             "Scores with 95% intervals (Wilson's for exact); another split than the pictures' is prefixed.",
             "",
             "The tokenizer's ceiling is the verifier's score of the true media encoded and decoded by the",
             "frozen tokenizer or codec (exact / attributes, and words for speech): no generation can score",
             "above it.",
             "",
             "| task | exact | attributes | words in place | baseline exact | baseline attributes "
             "| tokenizer's ceiling | exact by objects in the scene |",
             "|---|---|---|---|---|---|---|---|"]
    tasks = sorted({k.split("/")[0] for k in m if f"{k.split('/')[0]}/exact" in m})
    prefixes = [""] + sorted({k.split("/")[0] + "/" for k in m if k.count("/") >= 2})
    for prefix in prefixes:
        for task in tasks:
            p = f"{prefix}{task}"
            if f"{p}/exact" not in m:
                continue
            words = _cell(m, f"{p}/word_accuracy") + f" (random {m[f'{p}/baseline_word_accuracy']:.2f})" \
                if f"{p}/word_accuracy" in m else ""
            lines.append(
                f"| {p} | {_cell(m, f'{p}/exact')} | {_cell(m, f'{p}/attribute_accuracy')} | {words} | "
                f"{m[f'{p}/baseline_exact']:.2f} | {m[f'{p}/baseline_attribute_accuracy']:.2f} | "
                f"{_ceiling(m, p)} | {_by_objects(m, p)} |"
            )
            if f"{p}/best_of" in m:  # what the kept samples were chosen from: one plain sample's scores
                one = f"{p}/one_sample"
                words = f"{m[f'{one}_word_accuracy']:.2f}" if f"{one}_word_accuracy" in m else ""
                lines.append(
                    f"| {p}, one sample (above: the best of {m[f'{p}/best_of']:.0f} by the model's own "
                    f"reading) | {m[f'{one}_exact']:.2f} | {m[f'{one}_attribute_accuracy']:.2f} | {words} "
                    "|  |  |  |  |"
                )
            if f"{p}/refined_exact" in m:  # the same codes through the diffusion refiner
                lines.append(
                    f"| {p} refined (PSNR {m[f'{p}/psnr']:.2f} -> {m[f'{p}/refined_psnr']:.2f} dB) | "
                    f"{m[f'{p}/refined_exact']:.2f} | {m[f'{p}/refined_attribute_accuracy']:.2f} "
                    "|  |  |  |  |  |"
                )
    if evaluation.samples:
        overview_figure(evaluation.samples, m, directory / "overview.png", title=title)
    if curve_figure(directory.parent / CURVE_FILE, directory / "curve.png") is not None:
        lines[3:3] = ["![the verifiers while training](curve.png)", ""]
    for task in tasks:
        refined = f"{task}/refined_exact" in evaluation.metrics
        header = "| prompt | decode | refined | verifier |" if refined else "| prompt | output | verifier |"
        lines += ["", f"## {task}", "", header, "|---|---|---|---|" if refined else "|---|---|---|"]
        for i, sample in enumerate(s for s in evaluation.samples if s.task == task):
            name = _save_media(sample, directory / f"{task}_{i:03d}")
            link = f"![{task} {i}]({name})" if name.endswith((".png", ".gif")) else f"[{name}]({name})"
            if name.endswith(".wav"):  # the spectrogram to look at, linking to the WAV to listen to
                picture = save_spectrogram_png(sample.media, directory / f"{task}_{i:03d}_spectrogram.png")
                link = f"[![{task} {i}]({picture.name})]({name})"
            verdict = _verdict(sample.score)
            if sample.refined is not None:  # shown at the decode's displayed size, so the two line up
                upscale = max(1, round(4 * sample.media.shape[-1] / sample.refined.shape[-1]))
                refined_name = save_media(sample.refined, directory / f"{task}_{i:03d}_refined", upscale).name
                refined_link = f"![{task} {i} refined]({refined_name})"
                verdicts = f"decode: {verdict}; refined: {_verdict(sample.refined_score)}"
                lines.append(f"| {sample.prompt} | {link} | {refined_link} | {verdicts} |")
            elif task in GENERATION:
                lines.append(f"| {sample.prompt} | {link} | {verdict} |")
            else:
                output = sample.output or "(empty)"
                lines.append(f"| {link} | {output} | {verdict} (truth: {sample.prompt}) |")
    page = directory / "gallery.md"
    page.write_text("\n".join(lines) + "\n")
    return page
