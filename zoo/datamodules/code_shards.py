"""Pre-tokenized code shards (`zoo tokenize`) as documents for `UnifiedPretraining`: training reads codes
and raw captions, and never runs the visual tokenizer or the audio codec (issue 14, item 3).

The shards stream through the streaming core (`zoo.datamodules.streaming`: exact partition over ranks and
workers, shuffle buffer, mid-epoch resume, bad samples replaced and counted). Each record becomes the
document of a task drawn for it (`zoo.datamodules.task_documents`: the same function, and the same draws,
as for the raw media the record was made from), its codes a `VisualSegment(codes=...)` or
`AudioSegment(codes=...)` and its caption tokenized here, BPE-dropout included.

Codes are only meaningful for the tokenizer that made them, so before any loader is built the shards are
checked against the model being trained: the first record of every shard must carry the fingerprint
(`zoo.fingerprint.tokenizer_hash`) of the model's visual tokenizer or audio codec, or the run stops with an
error naming both; later records that disagree are bad samples (counted, and stopping the run past
`bad_samples.max_bad_fraction`).
"""

from __future__ import annotations

from typing import Any

from zoo.datamodules.bad_samples import BadSample, BadSamplePolicy
from zoo.datamodules.code_records import CodeRecord
from zoo.datamodules.documents import DocumentDataModule
from zoo.datamodules.loaders import ReportingLoader
from zoo.datamodules.sequence import Document, MediaLayout, document_length
from zoo.datamodules.shards import Shard, TarSamples, count_shards, read_index
from zoo.datamodules.streaming import StreamDataset
from zoo.datamodules.task_documents import PairedDocuments, TaskWeights
from zoo.datamodules.text import split_shards
from zoo.fingerprint import tokenizer_hash
from zoo.tokenizers.text import TextTokenizer
from zoo.tokenizers.vocab import UnifiedVocab


def model_fingerprints(model: Any) -> dict[str, str | None]:
    """The fingerprints of a unified model's visual tokenizer and audio codec (None where it has none)."""
    return {
        name: tokenizer_hash(module) if (module := getattr(model, name, None)) is not None else None
        for name in ("visual_tokenizer", "audio_codec")
    }


def check_record(record: CodeRecord, expected: dict[str, str | None] | None, layout: MediaLayout) -> None:
    """`BadSample` when the record's tokenizer is not the model's, or its scales are not the layout's."""
    where = f"{record.source} [{record.key}]"
    name = record.tokenizer_name
    if expected is not None:
        if expected.get(name) is None:
            raise BadSample(f"{where}: {record.kind} codes, but the model has no {name}")
        if record.tokenizer_hash != expected[name]:
            raise BadSample(
                f"{where}: codes of the {name} with fingerprint {record.tokenizer_hash}, but the model's "
                f"{name} has fingerprint {expected[name]}: re-tokenize with the model's tokenizers"
            )
    if record.kind != "audio" and record.scales != tuple(layout.visual_scales):
        raise BadSample(
            f"{where}: codes of the scales {record.scales}, but the layout has {layout.visual_scales}"
        )


class CodeDocuments:
    """The `map` of a code-shard stream: a record -> the document of the task drawn for it
    (`PairedDocuments`), refused when longer than `seq_len`. Picklable: DataLoader workers receive it.

    `expected` holds the model's tokenizer fingerprints (None: not checked, as when no model is known).
    """

    def __init__(
        self,
        documents: PairedDocuments,
        layout: MediaLayout,
        seq_len: int,
        expected: dict[str, str | None] | None = None,
    ) -> None:
        self.documents, self.layout, self.seq_len, self.expected = documents, layout, seq_len, expected

    def __call__(self, sample: dict) -> Document:
        record = CodeRecord.from_sample(sample)
        check_record(record, self.expected, self.layout)
        return self.document(record, sample.get("__epoch__", 0))

    def document(self, record: CodeRecord, epoch: int) -> Document:
        """The document of `record` in `epoch`."""
        task, document = self.documents(
            record.kind, record.text, record.segment(), record.source, record.key, epoch
        )
        length = document_length(document, self.layout)
        if length > self.seq_len:
            raise BadSample(
                f"{record.source} [{record.key}]: its {task} document has {length} tokens, more than "
                f"seq_len={self.seq_len}; raise seq_len"
            )
        return document


class CodeShardsDataModule(DocumentDataModule):
    """Code shards written by `zoo tokenize`, streamed as paired-task documents (module docstring).

    Args:
        train_shards: the shards: the `index.json` `zoo tokenize` wrote, or paths, urls or brace patterns
            of shards (`codes/codes-{00000..00099}.tar`).
        val_shards: validation shards; when empty, the last `val_fraction` of the training records.
        index: an index JSON of the shards' record counts (default: an `index.json` beside them).
        tokenizer: path of a text tokenizer JSON; None uses the byte-level tokenizer (256 ids).
        vocab: the model's unified vocabulary.
        layout: positions per visual frame / audio frame; must match the model's tokenizers.
        tasks: how often each task is drawn for the records of each medium (None: `TaskWeights()`).
        uncond_prob: share of text-to-image/video documents whose caption is dropped (for guidance).
        seq_len: packed row length.
        batch_size: documents per batch.
        bpe_dropout: BPE-dropout probability on training captions (0 disables).
        val_fraction: share of training records held out when no val_shards are given.
        num_workers: dataloader workers.
        seed: task draws, dropout and shuffling.
        shuffle_buffer: training records each worker holds to shuffle; shards are also permuted per epoch.
        bad_samples: when bad records stop the run.
    """

    def __init__(
        self,
        train_shards: list[str],
        val_shards: list[str] | None = None,
        index: str | None = None,
        tokenizer: str | None = None,
        vocab: UnifiedVocab = UnifiedVocab(),
        layout: MediaLayout = MediaLayout(),
        tasks: TaskWeights | None = None,
        uncond_prob: float = 0.1,
        seq_len: int = 256,
        batch_size: int = 16,
        bpe_dropout: float = 0.0,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        seed: int = 0,
        shuffle_buffer: int = 1000,
        bad_samples: BadSamplePolicy = BadSamplePolicy(),
    ) -> None:
        super().__init__(vocab, seq_len, batch_size, bpe_dropout, False, num_workers, seed, None, bad_samples)
        if not train_shards:
            raise ValueError("train_shards is empty: give the code shards `zoo tokenize` wrote")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}")
        if not 0.0 <= uncond_prob < 1.0:
            raise ValueError(f"uncond_prob must lie in [0, 1), got {uncond_prob}")
        if shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer must be >= 1, got {shuffle_buffer}")
        self.builder.layout = self.layout = layout
        self.train_shards, self.val_shards = list(train_shards), list(val_shards or [])
        self.index, self.tokenizer_path = index, tokenizer
        self.tasks = tasks if tasks is not None else TaskWeights()
        self.uncond_prob, self.val_fraction, self.shuffle_buffer = uncond_prob, val_fraction, shuffle_buffer
        self._shards: dict[str, list[Shard]] | None = None
        self.expected: dict[str, str | None] | None = None  # the model's fingerprints, once checked

    def make_tokenizer(self) -> TextTokenizer:
        return TextTokenizer.load(self.tokenizer_path) if self.tokenizer_path else TextTokenizer.byte_level()

    def shards(self, split: str) -> list[Shard]:
        """The shards (or parts of shards) of `split` with their record counts, counted once."""
        if self._shards is None:
            train = self._count(self.train_shards)
            total = sum(s.samples for s in train)
            if not total:
                raise ValueError(f"no records in {self.train_shards}")
            if self.val_shards:
                val = self._count(self.val_shards)
            else:
                n_val = max(1, int(total * self.val_fraction)) if total > 1 and self.val_fraction else 0
                train, val = split_shards(train, total - n_val)
            self._shards = {"train": train, "val": [s for s in val if s.samples], "test": []}
        return self._shards[split]

    def _count(self, sources: list[str]) -> list[Shard]:
        """An index JSON (`zoo tokenize`'s `index.json`) gives its shards; anything else is counted."""
        shards: list[Shard] = []
        for source in sources:
            if source.endswith(".json"):
                shards += read_index(source)
            else:
                shards += count_shards([source], TarSamples(), self.index)
        return shards

    def make_dataset(self, split: str) -> StreamDataset | None:
        shards = self.shards(split)
        if not shards:
            return None
        train = split == "train"
        return StreamDataset(
            shards, TarSamples(), self.text_map(split), seed=self.seed, shuffle=train,
            shuffle_buffer=self.shuffle_buffer, bad_samples=self.bad_sample_policy,
        )  # fmt: skip

    def text_map(self, split: str) -> CodeDocuments:
        """The stream's `map` (the base class calls it when it builds a loader)."""
        assert self.tokenizer is not None
        documents = PairedDocuments(
            self.tokenizer,
            self.vocab,
            self.tasks,
            self.uncond_prob,
            self.bpe_dropout,
            self.seed,
            split == "train",
        )
        return CodeDocuments(documents, self.layout, self.builder.seq_len, self.expected)

    # -- the tokenizers the shards were made with ----------------------------------------------------
    def check_tokenizers(self, model: Any) -> dict[str, str | None]:
        """Refuse shards made by other tokenizers than `model`'s (a `UnifiedModel`): the first record of
        every shard must carry the fingerprint of the model's tokenizer for its medium. Later records are
        checked as they stream (bad samples). Returns the model's fingerprints."""
        expected = model_fingerprints(model)
        seen: set[str] = set()
        for split in ("train", "val"):
            for shard in self.shards(split):
                if shard.url in seen:
                    continue
                seen.add(shard.url)
                record = self._first_record(shard)
                try:
                    check_record(record, expected, self.layout)
                except BadSample as error:
                    raise ValueError(f"refusing the code shard {shard.url}: {error}") from None
        self.expected = expected
        return expected

    @staticmethod
    def _first_record(shard: Shard) -> CodeRecord:
        samples = TarSamples().read(shard.url, shard.start)
        try:
            sample = next(samples, None)
        finally:
            samples.close()
        if sample is None:
            raise ValueError(f"{shard.url}: no record at sample {shard.start}, though its count says so")
        try:
            return CodeRecord.from_sample(sample)
        except BadSample as error:
            raise ValueError(f"refusing the code shard {shard.url}: {error}") from None

    def _loader(self, split: str) -> ReportingLoader:
        model = getattr(getattr(self.trainer, "lightning_module", None), "model", None)
        if model is not None and self.expected is None:
            # Here, not in setup: a checkpoint's weights (the tokenizers' included) are restored in between.
            self.check_tokenizers(model)
        return super()._loader(split)
