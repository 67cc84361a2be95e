"""Pre-tokenized code shards (`zoo tokenize`) as a source of `PairedDataModule`: training reads codes and raw
captions, and never runs the visual tokenizer or the audio codec (issue 14, item 3).

A code record (`zoo.datamodules.code_records`) decodes, in stage (a), to the `PairedSample` (for an
interleaved record, the `InterleavedSample`) its raw sample would give, with `VisualSegment(codes=...)` or
`AudioSegment(codes=...)` in place of pixels and waves, and the raw sample's identity (the input file's name
and key the record keeps): stage (b) then draws and builds the same document from it as from the raw media.
So YAML chooses raw media or code shards by the source's class (configs/data/code_shards.yaml), and both
kinds mix in one datamodule.

Codes are only meaningful for the tokenizer that made them, so before any loader is built the shards are
checked against the model being trained: the first record of every shard must carry the fingerprint
(`zoo.fingerprint.tokenizer_hash`) of the model's visual tokenizer or audio codec, or the run stops with an
error naming both; later records that disagree are bad samples (counted, and stopping the run past
`bad_samples.max_bad_fraction`).
"""

from __future__ import annotations

from typing import Any

from zoo.datamodules.bad_samples import BadSample
from zoo.datamodules.code_records import CodeRecord, InterleavedRecord, read_record
from zoo.datamodules.media_samples import InterleavedSample, MediaSpec, PairedSample, sample_id
from zoo.datamodules.paired_documents import Prompts, TaskWeights
from zoo.datamodules.sequence import MediaLayout
from zoo.datamodules.shards import Shard, TarSamples, count_shards, read_index
from zoo.datamodules.sources import PairedSource
from zoo.fingerprint import tokenizer_hash

Fingerprints = dict[str, str | None]


def model_fingerprints(model: Any) -> Fingerprints:
    """The fingerprints of a unified model's visual tokenizer and audio codec (None where it has none)."""
    return {
        name: tokenizer_hash(module) if (module := getattr(model, name, None)) is not None else None
        for name in ("visual_tokenizer", "audio_codec")
    }


def check_record(record: CodeRecord, expected: Fingerprints | None, layout: MediaLayout) -> None:
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


class CodeShardSource(PairedSource):
    """The code shards `zoo tokenize` wrote (module docstring).

    Args:
        shards: the `index.json` `zoo tokenize` wrote, or paths, urls or brace patterns of its shards
            (`codes/codes-{00000..00099}.tar`).
        weight, tasks, prompts: see `PairedSource`.
        index: an index JSON of the shards' record counts, for shards given by path (default: an
            `index.json` beside them).
    """

    format = TarSamples()

    def __init__(
        self,
        shards: list[str],
        weight: float = 1.0,
        tasks: TaskWeights = TaskWeights(),
        prompts: Prompts = Prompts(),
        index: str | None = None,
    ) -> None:
        super().__init__(weight, tasks, prompts)
        if not shards:
            raise ValueError("shards is empty: give the index.json (or the code shards) `zoo tokenize` wrote")
        self.shards, self.index = list(shards), index
        self.layout = MediaLayout()  # the model's, from `check_model`
        self.expected: Fingerprints | None = None  # the model's fingerprints, once its shards are checked

    def __repr__(self) -> str:
        return f"CodeShardSource({', '.join(self.shards)})"

    def count(self) -> list[Shard]:
        """An index JSON (`zoo tokenize`'s `index.json`) gives its shards; anything else is counted."""
        found: list[Shard] = []
        for shards in self.shards:
            if shards.endswith(".json"):
                found += read_index(shards)
            else:
                found += count_shards([shards], self.format, self.index)
        return found

    def decode(self, sample: dict, spec: MediaSpec) -> PairedSample | InterleavedSample:
        record = read_record(sample)
        for medium in media_of(record):
            check_record(medium, self.expected, self.layout)
        where = f"{sample['__url__']} [{sample['__key__']}] (codes of {record.source} [{record.key}])"
        identity = sample_id(record.source, record.key)
        if isinstance(record, InterleavedRecord):
            return InterleavedSample(where, record.segments(), identity)
        return PairedSample(where, record.text, record.segment(), identity)

    def texts(self, sample: dict) -> list[str]:
        try:
            return [bytes(sample["txt"]).decode("utf-8")]
        except (KeyError, UnicodeDecodeError):
            return []

    def check_model(self, model: object | None, layout: MediaLayout) -> None:
        """Refuse shards made by other tokenizers than `model`'s (a `UnifiedModel`): the first record of
        every shard must carry the fingerprint of the model's tokenizer for its medium and the layout's
        scales; later records are checked as they stream (bad samples)."""
        self.layout = layout
        if model is None:
            return
        expected = model_fingerprints(model)
        if expected == self.expected:
            return
        for shard in dict.fromkeys(s.url for s in self.count() if s.samples):
            try:
                for medium in media_of(first_record(shard)):
                    check_record(medium, expected, layout)
            except BadSample as error:
                raise ValueError(f"refusing the code shard {shard}: {error}") from None
        self.expected = expected


def media_of(record: CodeRecord | InterleavedRecord) -> list[CodeRecord]:
    """The media a record holds: itself, or an interleaved document's."""
    return record.media if isinstance(record, InterleavedRecord) else [record]


def first_record(url: str) -> CodeRecord | InterleavedRecord:
    """The first record of a code shard; `BadSample` when it has none or it is not a code record."""
    samples = TarSamples().read(url, 0)
    try:
        sample = next(samples, None)
    finally:
        samples.close()
    if sample is None:
        raise BadSample(f"{url}: no record, though its count says some")
    return read_record(sample)
