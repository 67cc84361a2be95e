"""Stage (b) of paired data: a media sample and a task become the `Document` ShapesWorld makes for that task.

The tasks (`zoo.task_names.Task`) and document shapes are ShapesWorld's (`zoo.datamodules.shapes_multimodal`),
so that metrics, configs and the model see one format whatever the data; `interleaved` is added for documents
of texts and media in any order:

    caption          <bos> caption <eos>
    text_to_image    <bos> caption <boi> image <eoi> <eos>      (`uncond`: the caption dropped)
    image_to_text    <bos> <boi> image <eoi> caption <eos>      (codes, or the encoder: `image_context`)
    text_to_video    <bos> caption <bov> video <eov> <eos>      (`uncond`: the caption dropped)
    video_to_text    <bos> <bov> video <eov> caption <eos>      (codes, or the encoder: `video_context`)
    text_to_audio    <bos> caption <boa> audio <eoa> <eos>
    audio_to_text    <bos> <boa> audio <eoa> caption <eos>
    interleaved      <bos> part part ... <eos>                  (texts predicted; media: `interleaved_media`)

In generation tasks the caption is the condition (never a target); in understanding tasks it is the target.
A source's prompt for a task (`Prompts`) is plain text right after `<bos>`, never predicted, in every task
(`<bos> Describe the image: <boi> image <eoi> caption <eos>`); the unconditional documents of guidance drop
it with the caption, since generation's unconditional prompt is `<bos> <boi>`.

`DocumentMaker` accepts media as pixels and waves or as codes alike (`VisualSegment(codes=...)`,
`AudioSegment(codes=...)`); only `image_context` and `video_context` need pixels (the vision encoder reads
them).

What a sample is in an epoch (`draw`: its task, whether its caption drops out, the seed of its captions'
BPE-dropout) is a function of (seed, epoch, the sample's key) alone. The key is the sample's identity
(`zoo.datamodules.media_samples.sample_id`: its file's name and its key there), never its place in a stream,
so that a sample read from raw media and its code record from `zoo tokenize` make the same document.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields, replace
from typing import Literal

from zoo.datamodules.bad_samples import BadSample
from zoo.datamodules.media_samples import InterleavedSample, Media, MediaSample, PairedSample, SampleKind
from zoo.datamodules.sequence import (
    AudioSegment,
    ContextSegment,
    Document,
    MediaLayout,
    Segment,
    TextSegment,
    VisualSegment,
    document_length,
)
from zoo.task_names import Task
from zoo.tokenizers.text import TextTokenizer
from zoo.tokenizers.vocab import UnifiedVocab

# The tasks a sample of each kind can serve, in the order its task is drawn among them.
TASKS_OF_KIND: dict[SampleKind, tuple[Task, ...]] = {
    **{
        kind: (Task.CAPTION, Task.generating(kind), Task.understanding(kind))
        for kind in ("image", "video", "audio")
    },
    "interleaved": (Task.INTERLEAVED,),
}
InterleavedMedia = Literal["input", "predict"]


@dataclass(frozen=True)
class TaskWeights:
    """Which tasks a source feeds and how often: a sample's task is drawn among the tasks its media allow
    (an image sample: caption, text_to_image, image_to_text) with these relative weights; 0 disables."""

    caption: float = 0.0
    text_to_image: float = 1.0
    image_to_text: float = 1.0
    text_to_video: float = 1.0
    video_to_text: float = 1.0
    text_to_audio: float = 1.0
    audio_to_text: float = 1.0
    interleaved: float = 1.0

    def __post_init__(self) -> None:
        bad = {f.name: getattr(self, f.name) for f in fields(self) if not getattr(self, f.name) >= 0}
        if bad:
            raise ValueError(f"task weights must be >= 0, got {bad}")

    def of(self, task: str) -> float:
        return float(getattr(self, task))


@dataclass(frozen=True)
class Prompts:
    """Plain text a source puts right after `<bos>` in the documents of each task (never predicted), e.g.
    `image_to_text: "Describe the image:"`. Empty: none."""

    caption: str = ""
    text_to_image: str = ""
    image_to_text: str = ""
    text_to_video: str = ""
    video_to_text: str = ""
    text_to_audio: str = ""
    audio_to_text: str = ""
    interleaved: str = ""

    def of(self, task: str) -> str:
        return str(getattr(self, task))

    def texts(self) -> list[str]:
        return [p for p in (getattr(self, f.name) for f in fields(self)) if p]


@dataclass(frozen=True)
class MediaSupport:
    """Which media the model can take (the tokenizers and encoder it has); everything without a model."""

    image: bool = True
    video: bool = True
    audio: bool = True
    context: bool = True

    @classmethod
    def of(cls, model: object | None) -> MediaSupport:
        if model is None:
            return cls()
        nfsp = getattr(model, "nfsp", None)
        return cls(
            image=nfsp is not None,
            video=nfsp is not None and bool(nfsp.tokenizer.temporal),
            audio=getattr(model, "ncp", None) is not None,
            context=getattr(model, "vision_encoder", None) is not None,
        )

    def check(self, media: Media, where: str, as_context: bool = False) -> None:
        """`BadSample` naming `where` when these media cannot take `media` (as a context image)."""
        if isinstance(media, AudioSegment):
            ok, what = self.audio, "audio (there is no audio codec)"
        elif as_context:
            kind = "videos" if media.is_video else "images"
            ok, what = self.context, f"context {kind} (there is no vision encoder)"
        elif media.is_video:
            ok, what = self.video, "video (there is no causal 3D visual tokenizer)"
        else:
            ok, what = self.image, "images (there is no visual tokenizer)"
        if not ok:
            raise BadSample(f"{where}: cannot take {what}")

    def tasks(self, image_context: bool, video_context: bool = False) -> frozenset[Task]:
        """The tasks a model with these media can train (understanding through the vision encoder where
        `image_context` / `video_context` say so)."""
        tasks = {Task.CAPTION, Task.INTERLEAVED}
        if self.image:
            tasks.add(Task.TEXT_TO_IMAGE)
        if self.context if image_context else self.image:
            tasks.add(Task.IMAGE_TO_TEXT)
        if self.video:
            tasks.add(Task.TEXT_TO_VIDEO)
        if self.context if video_context else self.video:
            tasks.add(Task.VIDEO_TO_TEXT)
        if self.audio:
            tasks |= {Task.TEXT_TO_AUDIO, Task.AUDIO_TO_TEXT}
        return frozenset(tasks)


@dataclass(frozen=True)
class Draw:
    """What a sample is in one epoch: its task, whether its caption is dropped (guidance), the seed of its
    texts' BPE-dropout."""

    task: Task
    uncond: bool
    text_seed: int


def draw(
    sample: MediaSample,
    weights: TaskWeights,
    supported: frozenset[str],
    uncond_prob: float,
    seed: int,
    epoch: int,
    key: object,
) -> Draw:
    """The draws of the sample keyed `key` (its identity) in `epoch` (module docstring)."""
    task = draw_task(sample, weights, supported, seed, epoch, key)
    uncond = task.guided and draws_uncond(uncond_prob, seed, epoch, key)
    return Draw(task, uncond, random.Random(f"zoo.paired.text/{seed}/{epoch}/{key}").getrandbits(31))


def draw_task(
    sample: MediaSample, weights: TaskWeights, supported: frozenset[str], seed: int, epoch: int, key: object
) -> Task:
    """The task of the sample keyed `key` in `epoch`, a function of (seed, epoch, key) and the weights of
    the tasks the sample's media and the model allow; `BadSample` when none has a positive weight."""
    names = [t for t in TASKS_OF_KIND[sample.kind] if t in supported and weights.of(t) > 0]
    if not names:
        possible = ", ".join(t for t in TASKS_OF_KIND[sample.kind] if t in supported) or "none"
        raise BadSample(
            f"{sample.name}: {sample.kind} sample, but its source feeds none of the tasks for it that the "
            f"model supports ({possible}); "
            "give one a positive weight in the source's `tasks`, or a model with that tokenizer"
        )
    rng = random.Random(f"zoo.paired.task/{seed}/{epoch}/{key}")
    return rng.choices(names, weights=[weights.of(t) for t in names])[0]


def draws_uncond(probability: float, seed: int, epoch: int, key: object) -> bool:
    """Whether a generation document drops its caption (for guidance), per (seed, epoch, key)."""
    return probability > 0 and random.Random(f"zoo.paired.uncond/{seed}/{epoch}/{key}").random() < probability


class DocumentMaker:
    """Stage (b): `maker(sample, task, prompt="", uncond=False, text_seed=None) -> Document` (module
    docstring).

    Args:
        vocab: the unified vocabulary (special tokens, text offset).
        tokenizer: the text tokenizer.
        layout: positions per visual frame / audio frame / context image (for the length check).
        seq_len: the packed row length; a longer document is a `BadSample` naming the sample.
        image_context: image_to_text (and interleaved input images) read the image through the vision
            encoder (`ContextSegment`, needs pixels) instead of as the visual tokenizer's codes.
        video_context: video_to_text (and interleaved input videos) read the video's frames through the
            vision encoder, one context group a frame, instead of as the causal 3D tokenizer's codes.
        interleaved_media: media inside interleaved documents are "input" (understood: codes, or context
            images) or "predict" (generated in place: their codes are targets).
        support: the media the model takes; a part it cannot take is a `BadSample`.
        dropout: BPE-dropout probability of the sample's texts (captions, interleaved texts; never prompts),
            applied when a call gives `text_seed` (training).
    """

    def __init__(
        self,
        vocab: UnifiedVocab,
        tokenizer: TextTokenizer,
        layout: MediaLayout,
        seq_len: int,
        image_context: bool = False,
        interleaved_media: InterleavedMedia = "input",
        support: MediaSupport = MediaSupport(),
        dropout: float = 0.0,
        video_context: bool = False,
    ) -> None:
        if interleaved_media not in ("input", "predict"):
            raise ValueError(f"interleaved_media must be 'input' or 'predict', got {interleaved_media!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {dropout}")
        self.vocab, self.tokenizer, self.layout, self.seq_len = vocab, tokenizer, layout, seq_len
        self.image_context, self.interleaved_media, self.support = image_context, interleaved_media, support
        self.video_context = video_context
        self.dropout = dropout

    def __call__(
        self,
        sample: MediaSample,
        task: str,
        prompt: str = "",
        uncond: bool = False,
        text_seed: int | None = None,
    ) -> Document:
        if task not in set(Task):
            raise ValueError(f"unknown task {task!r}; known: {', '.join(Task)}")
        if task not in TASKS_OF_KIND[sample.kind]:
            raise ValueError(f"{sample.name}: a {sample.kind} sample cannot make a {task} document")
        if isinstance(sample, InterleavedSample):
            document = self.interleaved(sample, prompt, text_seed)
        else:
            document = self.paired(sample, task, prompt, uncond, text_seed)
        self.check_length(document, sample.name, task)
        return document

    # -- the shapes -------------------------------------------------------------------------------
    def ids(self, text: str, seed: int | None = None) -> list[int]:
        """Unified ids of `text`; with a `seed` and `dropout`, a BPE-dropout segmentation drawn from it."""
        dropout = self.dropout if seed is not None and self.dropout > 0 else None
        return self.vocab.text_to_unified(self.tokenizer.encode(text, dropout=dropout, seed=seed)).tolist()

    def opening(self, prompt: str) -> TextSegment:
        """`<bos>` and the prompt, never predicted (exactly ShapesWorld's `<bos>` when there is no prompt)."""
        if not prompt:
            return TextSegment([self.vocab.bos_id])
        return TextSegment([self.vocab.bos_id, *self.ids(prompt)], predict=False)

    def paired(
        self, sample: PairedSample, task: str, prompt: str, uncond: bool, text_seed: int | None
    ) -> Document:
        vocab, caption = self.vocab, self.ids(sample.caption, text_seed)
        eos = TextSegment([vocab.eos_id])
        if task == Task.CAPTION:
            if not prompt:
                return [TextSegment([vocab.bos_id, *caption, vocab.eos_id])]
            return [self.opening(prompt), TextSegment([*caption, vocab.eos_id])]
        if Task(task).generates:
            media = self.media(sample.media, predict=True, where=sample.name)
            if uncond:
                return [TextSegment([vocab.bos_id]), media, eos]
            return [TextSegment([*self.opening(prompt).ids, *caption], predict=False), media, eos]
        return [
            *self.understanding_prompt(sample.media, prompt, sample.name),
            TextSegment([*caption, vocab.eos_id]),
        ]

    def interleaved(self, sample: InterleavedSample, prompt: str, text_seed: int | None) -> Document:
        if not any(isinstance(p, str) for p in sample.parts):
            raise BadSample(f"{sample.name}: an interleaved document needs at least one text part")
        predict = self.interleaved_media == "predict"
        document: list[Segment] = [self.opening(prompt)]
        for number, part in enumerate(sample.parts):
            if isinstance(part, str):
                seed = None if text_seed is None else text_seed + number  # each text its own segmentation
                document.append(TextSegment(self.ids(part, seed)))
            else:
                document.append(self.media(part, predict, sample.name, context=not predict))
        return [*document, TextSegment([self.vocab.eos_id])]

    def media(self, media: Media, predict: bool, where: str, context: bool = False) -> Segment:
        """`media` as the segment a task wants: predicted or not, an image (a video) through the vision
        encoder when `context` and `image_context` (`video_context`)."""
        as_context = context and self.reads_as_context(media)
        self.support.check(media, where, as_context)
        if as_context:
            if media.pixels is None:
                flag, kind = ("video_context", "video") if media.is_video else ("image_context", "image")
                raise BadSample(
                    f"{where}: {flag} reads pixels through the vision encoder; this {kind} is codes"
                )
            return ContextSegment(media.pixels)
        return replace(media, predict=predict)

    def reads_as_context(self, media: Media) -> bool:
        """Whether understanding reads `media` through the vision encoder rather than as codes."""
        if not isinstance(media, VisualSegment):
            return False
        return self.video_context if media.is_video else self.image_context

    # -- prompts for generation and understanding (zoo predict) ------------------------------------
    def generation_prompt(self, task: str, caption: str, prompt: str = "") -> list[int]:
        """Unified ids of a caption-to-media prompt, ending with the media's opening token."""
        return [*self.opening(prompt).ids, *self.ids(caption), self.vocab.special(Task(task).opener)]

    def understanding_prompt(self, media: Media, prompt: str = "", where: str = "") -> Document:
        """A media-to-caption prompt document: `<bos>` (prompt), then the media, read not predicted."""
        return [self.opening(prompt), self.media(media, predict=False, where=where, context=True)]

    def check_length(self, document: Document, where: str, task: str) -> None:
        length = document_length(document, self.layout)
        if length <= self.seq_len:
            return
        audio = [self.layout.segment_length(s) - 2 for s in document if isinstance(s, AudioSegment)]
        detail = f" ({sum(audio)} of them audio frames)" if audio else ""
        raise BadSample(
            f"{where}: the {task} document takes {length} positions{detail}, more than "
            f"seq_len={self.seq_len}; "
            "raise seq_len (and the backbone's max_seq_len) or use shorter media and texts"
        )
