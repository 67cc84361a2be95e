"""What `zoo tokenize` reads: its inputs cut into units, one output shard each, and the stream of decoded
samples that DataLoader workers make of them.

A unit is a whole input tar shard, or `lines_per_shard` lines of a manifest (a `Shard` piece: a file, a
first sample, a count). Units are numbered in input order; unit i becomes `codes-0000i.tar`. Each worker
reads whole units (unit i goes to worker i mod workers), decodes every sample with the paired datamodule's
own stage (a) (`ManifestSource` / `TarSource`.decode at the tokenizers' sizes, `MediaSpec`) and hands the
main process, in order: a `Decoded` sample (a `DecodedDocument` for an interleaved one) or a `Failed` one
(with why), and a `UnitEnd` when the unit is read. A unit that cannot be read to its end (a truncated tar)
ends with an error and is not written.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Literal

from torch import Tensor
from torch.utils.data import IterableDataset, get_worker_info

from zoo.datamodules.bad_samples import SAMPLE_ERRORS, describe
from zoo.datamodules.media_samples import Media, MediaSpec, PairedSample
from zoo.datamodules.paired_documents import MediaSupport
from zoo.datamodules.sequence import VisualSegment
from zoo.datamodules.shards import expand
from zoo.datamodules.sources import ManifestSource, PairedSource, TarSource

InputFormat = Literal["tar", "manifest"]
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
DECODE_ERRORS = (*SAMPLE_ERRORS, RuntimeError)  # zoo.media's MediaError is a ValueError; decoders' own


@dataclass(frozen=True)
class Unit:
    """Samples `[start, start + count)` of the input `url`, written as output shard number `index`."""

    index: int
    url: str
    format: InputFormat
    start: int
    count: int

    @property
    def name(self) -> str:
        return f"codes-{self.index:05d}.tar"

    def describe(self) -> str:
        if self.format == "tar":
            return self.url
        return f"{self.url} samples {self.start}..{self.start + self.count - 1}"

    def as_json(self) -> dict[str, object]:
        return {"url": self.url, "format": self.format, "start": self.start, "count": self.count}

    def source(self) -> PairedSource:
        """The paired datamodule's source that reads this unit's input."""
        return input_source(self.url, self.format)


@dataclass(frozen=True)
class PlanFailure:
    """An input that could not even be counted (a corrupt tar): its unit number is kept for it."""

    index: int
    url: str
    reason: str


def input_format(url: str) -> InputFormat:
    name = url.lower()
    if name.endswith(".jsonl"):
        return "manifest"
    if name.endswith(TAR_SUFFIXES):
        return "tar"
    raise ValueError(
        f"{url}: unknown input; expected a .jsonl manifest or a WebDataset shard (.tar, .tar.gz)"
    )


def input_source(url: str, format: InputFormat, index: str | None = None) -> PairedSource:
    """The source of `PairedDataModule` that reads (and counts) the input `url`."""
    return TarSource([url], index=index) if format == "tar" else ManifestSource([url])


def plan_units(
    inputs: Sequence[str], lines_per_shard: int, index: str | None = None
) -> tuple[list[Unit], list[PlanFailure]]:
    """The units of `inputs` (paths, urls, brace patterns), and the tar shards that could not be counted.

    Counted as the paired datamodule counts its sources: manifests must exist (a missing one is a mistyped
    argument: `FileNotFoundError`); tar counts come from `index`, an `index.json` beside the shard, or a
    scan of the local file.
    """
    if lines_per_shard < 1:
        raise ValueError(f"lines_per_shard must be >= 1, got {lines_per_shard}")
    urls = expand(inputs)
    if not urls:
        raise ValueError("no inputs given: name manifests (.jsonl) or tar shards (brace patterns work)")
    units: list[Unit] = []
    failures: list[PlanFailure] = []
    for url in urls:
        number, format = len(units) + len(failures), input_format(url)
        if format == "manifest":
            (shard,) = input_source(url, format).count()
            for start in range(0, shard.samples, lines_per_shard):
                count = min(lines_per_shard, shard.samples - start)
                units.append(Unit(len(units) + len(failures), url, "manifest", start, count))
            continue
        try:
            (shard,) = input_source(url, format, index).count()
        except ValueError as error:
            failures.append(PlanFailure(number, url, str(error)))
            continue
        if shard.samples:
            units.append(Unit(number, url, "tar", 0, shard.samples))
    return units, failures


@dataclass(frozen=True)
class Decoded:
    """A sample ready for its tokenizer: `value` is pixels [3, S, S], a clip [3, T, S, S] or a wave [N]."""

    unit: int
    position: int
    source: str
    key: str
    kind: str
    text: str
    value: Tensor


@dataclass(frozen=True)
class DecodedDocument:
    """An interleaved sample ready for its tokenizers: texts and media (`VisualSegment` pixels, `AudioSegment`
    waves) in order."""

    unit: int
    position: int
    source: str
    key: str
    parts: tuple[str | Media, ...]


@dataclass(frozen=True)
class Failed:
    """A sample that cannot be used, and why (the failure manifest lists it)."""

    unit: int
    position: int
    source: str
    key: str
    reason: str


@dataclass(frozen=True)
class UnitEnd:
    """Unit `unit` is read: `read` samples; `error` when it could not be read to its end."""

    unit: int
    read: int
    error: str | None = None


Item = Decoded | DecodedDocument | Failed | UnitEnd


def decode_sample(
    unit: Unit, source: PairedSource, position: int, sample: dict, spec: MediaSpec, support: MediaSupport
) -> Decoded | DecodedDocument | Failed:
    key = str(sample.get("__key__", f"sample {position}"))
    try:
        decoded = source.decode(sample, spec)
        media_parts = [decoded.media] if isinstance(decoded, PairedSample) else [
            p for p in decoded.parts if not isinstance(p, str)
        ]  # fmt: skip
        for media in media_parts:
            support.check(media, decoded.name)
    except DECODE_ERRORS as error:
        return Failed(unit.index, position, unit.url, key, describe(error))
    if not isinstance(decoded, PairedSample):
        return DecodedDocument(unit.index, position, unit.url, key, decoded.parts)
    media = decoded.media
    value = media.pixels if isinstance(media, VisualSegment) else media.wave
    assert value is not None  # raw media decode to pixels and waves, never codes
    return Decoded(unit.index, position, unit.url, key, decoded.kind, decoded.caption, value)


def read_unit(unit: Unit, spec: MediaSpec, support: MediaSupport) -> Iterator[Item]:
    """The unit's samples decoded, then its `UnitEnd`."""
    source = unit.source()
    samples = source.format.read(unit.url, unit.start)
    read = 0
    try:
        taken = islice(samples, unit.count)
        while True:
            try:
                sample = next(taken)
            except StopIteration:
                break
            except Exception as error:  # noqa: BLE001 - a broken input is reported, the others go on
                at = unit.start + read
                yield UnitEnd(unit.index, read, f"could not be read past sample {at}: {describe(error)}")
                return
            yield decode_sample(unit, source, unit.start + read, sample, spec, support)
            read += 1
    finally:
        samples.close()
    short = f"it ended after {read} samples, but its count says {unit.count}" if read < unit.count else None
    yield UnitEnd(unit.index, read, short)


class DecodedStream(IterableDataset):
    """The decoded samples of `units`, unit i read by DataLoader worker i mod workers (module docstring);
    media decoded at the sizes of a resolved `spec`, those the tokenizers cannot take (`support`) refused."""

    def __init__(self, units: Sequence[Unit], spec: MediaSpec, support: MediaSupport) -> None:
        self.units, self.spec, self.support = list(units), spec, support

    def __iter__(self) -> Iterator[Item]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for unit in self.units[worker::workers]:
            yield from read_unit(unit, self.spec, self.support)
