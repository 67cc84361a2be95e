"""Real paired media for the unified model: captioned images, captioned videos, transcribed speech and
interleaved documents from jsonl manifests, WebDataset shards and pre-tokenized code shards, streamed
(issue 14, items 1, 3, 5 and 7).

    sources (`zoo.datamodules.sources`: raw media; `zoo.datamodules.code_shards`: `zoo tokenize`'s codes)
      ->  each source's share of the epoch (`zoo.datamodules.mixture`)
      ->  the streaming core (`zoo.datamodules.streaming`): exact rank/worker split, shuffle buffer, resume
      ->  in the worker, `PairedMap`: (a) the record's source decodes it to a media sample (pixels and waves
          at the model's sizes, or codes), (b) the sample's task, caption dropping and BPE-dropout seed are
          drawn from (seed, epoch, the sample's identity) and `DocumentMaker` makes the task's document,
          ShapesWorld's shape (`zoo.datamodules.paired_documents`)
      ->  bad samples (`BadSample`, `MediaError`) replaced, counted, named; batches packed by the builder.

Raw and code sources mix freely in one datamodule. Because the draws key on the sample's identity (its
file's name and key, which a code record keeps), not on its place in the stream, a corpus read raw and the
code shards `zoo tokenize` made of it give the same documents (with the same text tokenizer).

Sizes come from the model: at setup the datamodule reads the trainer's `UnifiedModel` (its visual
tokenizer's image size and temporal stride, its codec's rate and hop, its vision encoder's grid) for every
setting left `None`, and refuses one that disagrees. The text tokenizer is a JSON file or is trained at
setup on the training sources' texts; either way it travels in the checkpoint and comes back on resume.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterator
from itertools import accumulate, islice
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from zoo.datamodules.bad_samples import SAMPLE_ERRORS, BadSamplePolicy
from zoo.datamodules.documents import DocumentDataModule
from zoo.datamodules.loaders import ReportingLoader
from zoo.datamodules.media_samples import MediaSample, MediaSpec, PairedSample, decode_media
from zoo.datamodules.mixture import SourcePart, describe_mixture, held_out_tail, weighted_part
from zoo.datamodules.paired_documents import (
    DocumentMaker,
    Draw,
    InterleavedMedia,
    MediaSupport,
    draw,
)
from zoo.datamodules.requests import MediaRequest, MediaRequests
from zoo.datamodules.sequence import Document, MediaLayout, Packing
from zoo.datamodules.shards import SampleFormat, Shard
from zoo.datamodules.sources import PairedSource
from zoo.datamodules.streaming import StreamDataset
from zoo.task_names import GENERATION, Task
from zoo.tokenizers.text import TextTokenizer
from zoo.tokenizers.vocab import UnifiedVocab

log = logging.getLogger(__name__)


class SourceFormats:
    """The `SampleFormat` of a stream that mixes sources: each url read by its own source's format."""

    def __init__(self, formats: dict[str, SampleFormat]) -> None:
        self.formats = formats

    def count(self, path: str) -> int:
        return self.formats[path].count(path)

    def read(self, url: str, start: int) -> Iterator[dict]:
        return self.formats[url].read(url, start)


class PairedMap:
    """The `map` of a paired stream, run in the workers (picklable): record -> media sample -> Document.

    The sample's source is found from its stream index (sources' ranges are laid out in order). Its draws
    (`paired_documents.draw`) key on (seed, epoch, the sample's identity): the task among those its media,
    its source and the model allow; for a guided generation document, whether its caption drops out
    (probability `uncond_prob`); the seed of its texts' BPE-dropout. Evaluation draws as in epoch 0, with
    no caption dropping and no dropout, so validation documents are the same every epoch. A sample that a
    weight above 1 reads several times an epoch draws anew at each reading after the first.
    """

    def __init__(
        self,
        sources: list[PairedSource],
        parts: list[SourcePart],
        spec: MediaSpec,
        maker: DocumentMaker,
        supported: frozenset[str],
        seed: int,
        uncond_prob: float,
        train: bool,
    ) -> None:
        self.sources, self.spec, self.maker, self.supported = sources, spec, maker, supported
        self.starts = [0, *accumulate(p.samples for p in parts)][:-1]
        self.sizes = [p.size for p in parts]
        self.seed, self.uncond_prob, self.train = seed, uncond_prob, train

    def __call__(self, sample: dict) -> Document:
        source, media, drawn = self.draw(sample)
        seed = drawn.text_seed if self.train else None
        return self.maker(media, drawn.task, source.prompts.of(drawn.task), drawn.uncond, seed)

    def draw(self, sample: dict) -> tuple[PairedSource, MediaSample, Draw]:
        """Stage (a) of one record, and the draws of its sample."""
        index, epoch = int(sample["__index__"]), int(sample["__epoch__"]) if self.train else 0
        number = bisect.bisect_right(self.starts, index) - 1
        source = self.sources[number]
        media = source.decode(sample, self.spec)
        if not media.identity:
            raise RuntimeError(f"{type(source).__name__}.decode gave {media.name} no identity (sample_id)")
        reading = (index - self.starts[number]) // self.sizes[number]  # a weight's whole passes come first
        key = media.identity if reading == 0 else f"{media.identity}/{reading}"
        drawn = draw(media, source.tasks, self.supported, self.uncond_prob if self.train else 0.0,
                     self.seed, epoch, key)  # fmt: skip
        return source, media, drawn


class PairedDataModule(DocumentDataModule):
    """Paired and interleaved real media from several weighted sources as documents (module docstring).

    Args:
        sources: the training sources (`ManifestSource`, `TarSource`, `CodeShardSource`), mixed by their
            weights.
        val_sources: validation sources, each sample once; None: the tail of every training source.
        val_fraction: without `val_sources`, the share of each training source held out for validation
            (its last samples; 0: no validation).
        vocab: the model's unified vocabulary.
        layout: positions per visual frame / audio frame / context image; None: the model's (read at setup).
        media: how media are decoded and sized (`MediaSpec`; None sizes come from the model).
        uncond_prob: share of text_to_image / text_to_video training documents whose caption (and prompt)
            is dropped, for classifier-free guidance.
        bpe_dropout: BPE-dropout probability of training captions and texts (0: none), seeded per sample
            and epoch.
        image_context: image_to_text reads images through the vision encoder instead of as codes.
        video_context: video_to_text reads a video's frames through the vision encoder (one context group a
            frame) instead of as the causal 3D tokenizer's codes.
        interleaved_media: media inside interleaved documents are "input" (understood) or "predict"
            (generated in place).
        tokenizer: a tokenizer JSON; None trains a BPE on the training sources' texts at setup.
        tokenizer_size: vocabulary of the trained tokenizer (None: vocab.text_size).
        tokenizer_texts: most texts read (spread over the sources, in file order) to train it.
        seq_len: packed row length; a longer document is a bad sample (counted, named).
        batch_size: documents per batch.
        packing: how a batch's documents fill its rows (`SequenceBuilder`): "first_fit_decreasing" lays
            documents of mixed lengths in fewer rows than "in_order" (docs/benchmarks.md, packing).
        num_workers: DataLoader workers (decoding happens in them).
        tokenize_in_loader: the workers also tokenize the decoded images, clips and speech, with CPU copies
            of the fitted model's frozen visual tokenizer and audio codec, so the training step reads codes
            (`zoo.datamodules.loader_tokenizing`; code shards already hold codes). For CPU runs, where those
            encoders cost a sixth of a step (docs/benchmarks.md). Without a Trainer the model tokenizes.
        seed: task draws, guidance dropout, shard order, shuffling, the mixture's fixed parts.
        shuffle_buffer: undecoded samples each training worker holds to shuffle.
        bad_samples: when bad samples stop the run.
        predict_samples: `zoo predict` answers this many validation samples in every task they allow
            (their media captioned, their captions rendered).
        predict_captions: captions `zoo predict` renders as images, videos and speech (the enabled ones).
        predict_files: images, videos and audio files `zoo predict` captions.
    """

    def __init__(
        self,
        sources: list[PairedSource],
        val_sources: list[PairedSource] | None = None,
        val_fraction: float = 0.02,
        vocab: UnifiedVocab = UnifiedVocab(),
        layout: MediaLayout | None = None,
        media: MediaSpec = MediaSpec(),
        uncond_prob: float = 0.1,
        bpe_dropout: float = 0.0,
        image_context: bool = False,
        video_context: bool = False,
        interleaved_media: InterleavedMedia = "input",
        tokenizer: str | None = None,
        tokenizer_size: int | None = None,
        tokenizer_texts: int = 20_000,
        seq_len: int = 512,
        batch_size: int = 16,
        packing: Packing = "in_order",
        num_workers: int = 0,
        tokenize_in_loader: bool = False,
        seed: int = 0,
        shuffle_buffer: int = 1000,
        bad_samples: BadSamplePolicy = BadSamplePolicy(),
        predict_samples: int = 4,
        predict_captions: list[str] | None = None,
        predict_files: list[str] | None = None,
    ) -> None:
        super().__init__(vocab, seq_len, batch_size, bpe_dropout, False, num_workers, seed, None, bad_samples)
        if not sources:
            raise ValueError("sources is empty: give a ManifestSource, TarSource or CodeShardSource")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}")
        if not 0.0 <= uncond_prob < 1.0:
            raise ValueError(f"uncond_prob must lie in [0, 1), got {uncond_prob}")
        if interleaved_media not in ("input", "predict"):
            raise ValueError(f"interleaved_media must be 'input' or 'predict', got {interleaved_media!r}")
        if tokenizer_texts < 1 or shuffle_buffer < 1 or predict_samples < 0:
            raise ValueError("tokenizer_texts and shuffle_buffer must be >= 1 and predict_samples >= 0")
        self.builder.packing = packing
        self.tokenize_in_loader = tokenize_in_loader
        self.sources, self.val_sources = list(sources), list(val_sources or [])
        self.val_fraction, self.configured_layout, self.media = val_fraction, layout, media
        self.uncond_prob, self.image_context, self.video_context = uncond_prob, image_context, video_context
        self.interleaved_media = interleaved_media
        self.tokenizer_path, self.tokenizer_size = tokenizer, tokenizer_size
        self.tokenizer_texts = tokenizer_texts
        self.shuffle_buffer = shuffle_buffer
        self.predict_samples = predict_samples
        self.predict_captions, self.predict_files = list(predict_captions or []), list(predict_files or [])
        self.resolve_media(None)
        self._splits: dict[str, tuple[list[PairedSource], list[SourcePart]]] | None = None

    # -- sizes from the model ---------------------------------------------------------------------
    def resolve_media(self, model: object | None) -> None:
        """Layout, media sizes and supported tasks from `model` (None: the defaults)."""
        layout = self.configured_layout
        if layout is None:
            layout = MediaLayout.of(model) if model is not None else MediaLayout()
        elif model is not None:
            check_layout(layout, model)
        self.spec = self.media.resolved_for(model)
        self.video_frames = self.spec.video_frames
        if model is not None or self.configured_layout is not None:  # (the default layout is a guess)
            layout.latent_frames(self.video_frames)  # a clip that does not fit the stride is refused now
        encoder = getattr(model, "vision_encoder", None)
        context = (self.image_context or self.video_context) and encoder is not None
        if context and encoder.image_size != self.spec.image_size:
            raise ValueError(
                f"image_context / video_context: the vision encoder reads {encoder.image_size}-pixel images "
                f"but media are sized {self.spec.image_size} (the visual tokenizer's); give both the same "
                "image_size"
            )
        self.layout = self.builder.layout = layout
        self.support = MediaSupport.of(model)
        self.supported = self.support.tasks(self.image_context, self.video_context)

    def setup(self, stage: str | None = None) -> None:
        self.resolve_media(self.trainer_model())
        super().setup(stage)

    def _loader(self, split: str) -> ReportingLoader:
        self.check_sources()
        return super()._loader(split)

    def check_sources(self) -> None:
        """Every source checked against the model (code shards of other tokenizers are refused). Called when
        loaders are built, not in setup: a checkpoint's weights (the tokenizers' too) arrive in between."""
        model = self.trainer_model()
        for source in dict.fromkeys([*self.sources, *self.val_sources]):
            source.check_model(model, self.layout)

    # -- splits: sources, their parts of the epoch -------------------------------------------------
    def splits(self) -> dict[str, tuple[list[PairedSource], list[SourcePart]]]:
        """Per split, its sources and their ranges (counted once: a scan of local files, or their index)."""
        if self._splits is None:
            train: list[SourcePart] = []
            val_sources, val = [], []
            for number, source in enumerate(self.sources):
                counted = source.count()
                head, tail = (counted, []) if self.val_sources else held_out_tail(counted, self.val_fraction)
                train.append(weighted_part(head, source.weight, self.seed, number, repr(source)))
                if tail:
                    val_sources.append(source)
                    val.append(once(tail))
            for source in self.val_sources:
                val_sources.append(source)
                val.append(once(source.count()))
            lines = describe_mixture(train, [repr(s) for s in self.sources])
            for part, line in zip(train, lines, strict=True):  # a part never read is worth a warning
                (log.warning if part.distinct < part.size else log.info)("mixture: %s", line)
            self._splits = {"train": (self.sources, train), "val": (val_sources, val), "test": ([], [])}
        return self._splits

    def make_dataset(self, split: str) -> StreamDataset | None:
        sources, parts = self.splits()[split]
        if not parts:
            return None
        formats = {}
        for source, part in zip(sources, parts, strict=True):
            for shard in part.shards:
                formats[shard.url] = source.format
        train = split == "train"
        return StreamDataset(
            [s for p in parts for s in p.shards],
            SourceFormats(formats),
            self.text_map(split),
            seed=self.seed,
            shuffle=train,
            shuffle_buffer=self.shuffle_buffer,
            bad_samples=self.bad_sample_policy,
        )

    def maker(self, dropout: float = 0.0) -> DocumentMaker:
        assert self.tokenizer is not None
        return DocumentMaker(
            self.vocab, self.tokenizer, self.layout, self.builder.seq_len, self.image_context,
            self.interleaved_media, self.support, dropout, self.video_context,
        )  # fmt: skip

    def text_map(self, split: str) -> PairedMap:  # type: ignore[override]
        """The stream's `map`, built when a loader is (so it holds the current tokenizer: a checkpoint's
        tokenizer arrives after setup)."""
        sources, parts = self.splits()[split]
        train = split == "train"
        return PairedMap(
            sources,
            parts,
            self.spec,
            self.maker(self.bpe_dropout if train else 0.0),
            self.supported,
            self.seed,
            self.uncond_prob,
            train,
        )

    # -- the tokenizer -----------------------------------------------------------------------------
    def make_tokenizer(self) -> TextTokenizer:
        if self.tokenizer_path:
            return TextTokenizer.load(self.tokenizer_path)
        size = self.tokenizer_size or self.vocab.text_size
        return TextTokenizer.train(self.training_texts(), vocab_size=size, min_frequency=2)

    def training_texts(self) -> Iterator[str]:
        """Up to `tokenizer_texts` texts of what the training sources give an epoch (an equal budget each, in
        file order, each sample once however often its weight repeats it), then every prompt."""
        sources, parts = self.splits()["train"]
        budget = -(-self.tokenizer_texts // len(sources))
        for source, part in zip(sources, parts, strict=True):
            yield from islice(self.source_texts(source, part), budget)
        for source in sources:
            yield from source.prompts.texts()

    @staticmethod
    def source_texts(source: PairedSource, part: SourcePart) -> Iterator[str]:
        for shard in dict.fromkeys(part.shards):  # a weight's repeated passes read once
            for sample in islice(source.format.read(shard.url, shard.start), shard.samples):
                yield from source.texts(sample)

    # -- zoo predict --------------------------------------------------------------------------------
    def enabled(self, task: str) -> bool:
        """Whether some training source feeds `task` and the model supports it."""
        return task in self.supported and any(s.tasks.of(task) > 0 for s in self.sources)

    def prompt_of(self, task: str) -> str:
        """The prompt of the first training source that feeds `task` ("" when none has one)."""
        return next((s.prompts.of(task) for s in self.sources if s.tasks.of(task) > 0), "")

    def predict_requests(self) -> list[MediaRequest]:
        """What `zoo predict` answers: validation samples in every enabled task their media allow, the
        captions to render, the files to caption. A request that cannot be made is reported, not raised."""
        if self.tokenizer is None:
            self.setup("predict")
        self.check_sources()
        maker, requests = self.maker(), []
        for name, sample in self.predict_val_samples():
            if isinstance(sample, str):  # why the sample could not be read (its kind is unknown)
                requests.append(MediaRequest("val_sample", name, error=sample))
            elif isinstance(sample, PairedSample):
                requests += self.sample_requests(maker, name, sample)
        for i, caption in enumerate(self.predict_captions):
            for task in (t for t in GENERATION if self.enabled(t)):
                prompt = maker.generation_prompt(task, caption, self.prompt_of(task))
                requests.append(MediaRequest(task, f"caption{i:03d}", prompt))
        requests += [self.file_request(maker, path) for path in self.predict_files]
        return requests

    def predict_val_samples(self) -> Iterator[tuple[str, MediaSample | str]]:
        """The first `predict_samples` validation samples, decoded (or the reason one is bad)."""
        sources, parts = self.splits()["val"]
        wanted = self.predict_samples
        for source, part in zip(sources, parts, strict=True):
            for shard in part.shards:
                for sample in islice(source.format.read(shard.url, shard.start), min(shard.samples, wanted)):
                    name = f"val{self.predict_samples - wanted:03d}"
                    wanted -= 1
                    try:
                        yield name, source.decode(sample, self.spec)
                    except SAMPLE_ERRORS as error:
                        yield name, f"{sample.get('__url__')} [{sample.get('__key__')}]: {error}"
                    if wanted == 0:
                        return

    def sample_requests(self, maker: DocumentMaker, name: str, sample: PairedSample) -> list[MediaRequest]:
        generate, understand = Task.generating(sample.kind), Task.understanding(sample.kind)
        requests = []
        if self.enabled(understand):
            document = maker.understanding_prompt(sample.media, self.prompt_of(understand), sample.name)
            requests.append(MediaRequest(understand, name, document=document))
        if self.enabled(generate):
            prompt = maker.generation_prompt(generate, sample.caption, self.prompt_of(generate))
            requests.append(MediaRequest(generate, name, prompt))
        return requests

    def file_request(self, maker: DocumentMaker, path: str) -> MediaRequest:
        """A caption request for an image, video or audio file; a bad file gives a request with its error."""
        from zoo.media import kind_of

        kind = kind_of(path) or "image"
        task = Task.understanding(kind)
        try:
            media = decode_media(kind, path, self.spec)
            document = maker.understanding_prompt(media, self.prompt_of(task), path)
        except (ValueError, OSError) as error:  # MediaError, BadSample: reported, the others answered
            return MediaRequest(task, Path(path).stem, error=str(error))
        return MediaRequest(task, Path(path).stem, document=document)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.predict_requests(), batch_size=self.batch_size, collate_fn=MediaRequests)


def once(shards: list[Shard]) -> SourcePart:
    """A source read once per epoch, whole (validation)."""
    size = sum(s.samples for s in shards)
    return SourcePart(tuple(shards), size, size)


def check_layout(layout: MediaLayout, model: Any) -> None:
    """A configured layout must agree with the components `model` has (the model would refuse at its
    first batch; here the message names the field)."""
    theirs = MediaLayout.of(model)
    fields = []
    if getattr(model, "visual_tokenizer", None) is not None:
        fields += ["visual_scales"] + (["temporal_stride"] if model.visual_tokenizer.temporal else [])
    if getattr(model, "audio_codec", None) is not None:
        fields.append("audio_hop")
    if getattr(model, "vision_encoder", None) is not None:
        fields.append("context_grid")
    wrong = {
        f: (getattr(layout, f), getattr(theirs, f))
        for f in fields
        if getattr(layout, f) != getattr(theirs, f)
    }
    if wrong:
        raise ValueError(
            f"data layout differs from the model's (data, model): {wrong}; leave `layout` out (null) to take "
            "the model's"
        )
