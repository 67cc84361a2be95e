"""Paired samples (one medium and its caption) as task documents, whatever holds the medium: pixels and
waveforms decoded from raw files, or codes read from pre-tokenized shards (issue 14, items 1 and 3).

The documents have the shapes of ShapesWorld's (`zoo.datamodules.shapes_multimodal`):

    caption          <bos> caption <eos>
    text_to_image    <bos> caption <boi> image <eoi> <eos>     (caption dropped with p = uncond_prob)
    image_to_text    <bos> <boi> image <eoi> caption <eos>
    text_to_video    <bos> caption <bov> video <eov> <eos>     (caption dropped with p = uncond_prob)
    video_to_text    <bos> <bov> video <eov> caption <eos>
    text_to_audio    <bos> caption <boa> speech <eoa> <eos>
    audio_to_text    <bos> <boa> speech <eoa> caption <eos>

In generation tasks the caption is the condition and the medium the target; in understanding tasks the
medium is input only and the caption the target. Which task a sample serves in an epoch, whether its
caption is dropped and its BPE-dropout draw are a function of (seed, epoch, sample id) alone, the sample id
being its file's name and its key there (`sample_id`): a sample read from raw media and the same sample
read from the code shard `zoo tokenize` made of it get the same draws, so both give the same document.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from dataclasses import dataclass
from pathlib import PurePosixPath

from zoo.datamodules.bad_samples import BadSample
from zoo.datamodules.sequence import AudioSegment, Document, TextSegment, VisualSegment
from zoo.tokenizers.text import TextTokenizer
from zoo.tokenizers.vocab import UnifiedVocab

TASKS_OF_KIND = {
    "image": ("caption", "text_to_image", "image_to_text"),
    "video": ("caption", "text_to_video", "video_to_text"),
    "audio": ("caption", "text_to_audio", "audio_to_text"),
}
GENERATION = ("text_to_image", "text_to_video", "text_to_audio")
CAPTION_DROPPED = ("text_to_image", "text_to_video")  # the unconditional model that guidance needs


@dataclass(frozen=True)
class TaskWeights:
    """Relative frequency of each task among the samples of its medium (0 disables it); a sample of an
    image-caption pair serves `caption`, `text_to_image` or `image_to_text`, drawn by these weights."""

    caption: float = 0.0
    text_to_image: float = 1.0
    image_to_text: float = 1.0
    text_to_video: float = 1.0
    video_to_text: float = 1.0
    text_to_audio: float = 1.0
    audio_to_text: float = 1.0

    def __post_init__(self) -> None:
        negative = {k: v for k, v in dataclasses.asdict(self).items() if v < 0}
        if negative:
            raise ValueError(f"task weights must be >= 0, got {negative}")

    def of_kind(self, kind: str) -> dict[str, float]:
        """The enabled tasks of a medium with their weights."""
        if kind not in TASKS_OF_KIND:
            raise ValueError(f"unknown media kind {kind!r}; expected one of {sorted(TASKS_OF_KIND)}")
        return {t: getattr(self, t) for t in TASKS_OF_KIND[kind] if getattr(self, t) > 0}


@dataclass(frozen=True)
class Draw:
    """What a sample is in one epoch: its task, whether its caption is dropped, its BPE-dropout seed."""

    task: str
    uncond: bool
    text_seed: int


def sample_id(source: str, key: str) -> str:
    """A sample's identity for its draws: the name of the file that holds it (not its folder, which moves
    between machines) and its key there (a tar key, or `line N` of a manifest)."""
    return f"{PurePosixPath(str(source)).name}#{key}"


def _seed(*parts: object) -> int:
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big")


def draw(
    kind: str, weights: TaskWeights, uncond_prob: float, seed: int, epoch: int, sample: str, train: bool
) -> Draw:
    """The draws of sample `sample` (a `sample_id`) in `epoch`; evaluation (`train=False`) draws as in
    epoch 0 and never drops a caption. `BadSample` when no task of `kind` is enabled."""
    tasks = weights.of_kind(kind)
    if not tasks:
        raise BadSample(f"no task for {kind} samples is enabled (every weight of {TASKS_OF_KIND[kind]} is 0)")
    epoch = epoch if train else 0
    rng = random.Random(_seed("paired-task", seed, epoch, sample))
    task = rng.choices(list(tasks), weights=list(tasks.values()))[0]
    uncond = train and task in CAPTION_DROPPED and rng.random() < uncond_prob
    return Draw(task, uncond, _seed("paired-text", seed, epoch, sample) % 2**31)


def paired_document(
    task: str,
    caption: list[int],
    media: VisualSegment | AudioSegment,
    vocab: UnifiedVocab,
    uncond: bool = False,
) -> Document:
    """The document of `task` (module docstring) for unified caption ids `caption` (without `<bos>` /
    `<eos>`) and one medium (pixels, a waveform or codes; its `predict` is set here by the task)."""
    bos, eos = TextSegment([vocab.bos_id]), TextSegment([vocab.eos_id])
    if task == "caption":
        return [TextSegment([vocab.bos_id, *caption, vocab.eos_id])]
    if task not in GENERATION and task not in ("image_to_text", "video_to_text", "audio_to_text"):
        known = sorted({t for tasks in TASKS_OF_KIND.values() for t in tasks})
        raise ValueError(f"unknown task {task!r}; known: {', '.join(known)}")
    kind = "audio" if isinstance(media, AudioSegment) else "video" if media.is_video else "image"
    if task not in TASKS_OF_KIND[kind]:
        raise ValueError(f"task {task!r} does not take a {kind}")
    medium = dataclasses.replace(media, predict=task in GENERATION)
    if task in GENERATION:
        if uncond:
            return [bos, medium, eos]
        return [TextSegment([vocab.bos_id, *caption], predict=False), medium, eos]
    return [bos, medium, TextSegment([*caption, vocab.eos_id])]


class PairedDocuments:
    """Paired samples -> documents: the draws, the caption tokenized (BPE-dropout seeded by the draw) and
    `paired_document`. One object for every source of paired samples (raw media, code shards), so that
    the same sample gives the same document from either; small and picklable (workers receive it).

    Args:
        tokenizer: the text tokenizer.
        vocab: the unified vocabulary.
        tasks: task weights per medium.
        uncond_prob: share of text-to-image/video documents whose caption is dropped (training only).
        dropout: BPE-dropout probability (training only).
        seed: the draws' seed.
        train: training draws (per epoch, with caption dropping and dropout) or evaluation ones.
    """

    def __init__(
        self,
        tokenizer: TextTokenizer,
        vocab: UnifiedVocab,
        tasks: TaskWeights,
        uncond_prob: float,
        dropout: float,
        seed: int,
        train: bool,
    ) -> None:
        self.tokenizer, self.vocab, self.tasks = tokenizer, vocab, tasks
        self.uncond_prob, self.dropout, self.seed, self.train = uncond_prob, dropout, seed, train

    def __call__(
        self, kind: str, text: str, media: VisualSegment | AudioSegment, source: str, key: str, epoch: int
    ) -> tuple[str, Document]:
        """(task, document) of the sample `key` of `source` in `epoch`: a `kind` medium and its caption."""
        drawn = draw(kind, self.tasks, self.uncond_prob, self.seed, epoch, sample_id(source, key), self.train)
        dropout = self.dropout if self.train else 0.0
        ids = self.tokenizer.encode(text, dropout=dropout or None, seed=drawn.text_seed)
        caption = self.vocab.text_to_unified(ids).tolist()
        return drawn.task, paired_document(drawn.task, caption, media, self.vocab, drawn.uncond)
