"""One tokenization: inputs -> decoded in DataLoader workers -> tokenized in batches -> code shards.

The main process takes the workers' items in order, queues decoded samples per medium and tokenizes a
queue when it holds `batch_size` samples, or when a unit ends (so every unit's shard is complete when its
`UnitEnd` arrives); an interleaved document's media are tokenized when it arrives. Records are written to
their unit's shard in input order; the unit is committed, or dropped when it could not be read to its end
(`zoo.pretokenize.output`). A progress bar (rich, on stderr) shows samples/s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text
from torch import Tensor
from torch.utils.data import DataLoader

from zoo.datamodules.code_records import CodeRecord, InterleavedRecord
from zoo.datamodules.frozen_tokenizers import FrozenTokenizers
from zoo.datamodules.media_samples import Media, MediaSpec
from zoo.datamodules.sequence import AudioSegment
from zoo.pretokenize.output import OutputFolder, ShardOutput
from zoo.pretokenize.sources import (
    Decoded,
    DecodedDocument,
    DecodedStream,
    Failed,
    Item,
    Unit,
    UnitEnd,
    plan_units,
)


@dataclass(frozen=True)
class TokenizeResult:
    """What a run did: shards written now, skipped (finished before) and failed (unreadable inputs);
    samples tokenized now and refused (all runs: `failures.jsonl`); media tokenized now and how long it took.
    """

    out: Path
    shards_written: int
    shards_skipped: int
    shards_failed: tuple[str, ...]
    samples: int
    bad_samples: int
    images: int
    videos: int
    audio_clips: int
    audio_seconds: float
    seconds: float

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    @property
    def images_per_second(self) -> float:
        return self.images / self.seconds if self.seconds else 0.0

    @property
    def audio_seconds_per_second(self) -> float:
        return self.audio_seconds / self.seconds if self.seconds else 0.0

    def describe(self) -> str:
        failed = f", {len(self.shards_failed)} inputs unreadable" if self.shards_failed else ""
        return (
            f"{self.out}: {self.shards_written} shards written, {self.shards_skipped} already done{failed}; "
            f"{self.samples} samples in {self.seconds:.1f} s ({self.samples_per_second:.1f}/s: "
            f"{self.images} images, {self.videos} videos, {self.audio_seconds:.1f} s of audio); "
            f"{self.bad_samples} bad samples listed in failures.jsonl"
        )


class RateColumn(ProgressColumn):
    """samples/s of the bar."""

    def render(self, task: Any) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:.1f} samples/s" if speed else "- samples/s")


@contextlib.contextmanager
def progress_bar(total: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A function that advances a progress bar over `total` samples (a no-op when not `enabled`)."""
    if not enabled:
        yield lambda n: None
        return
    columns = (TextColumn("tokenize"), BarColumn(), MofNCompleteColumn(), RateColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as progress:
        task = progress.add_task("tokenize", total=total)
        yield lambda n: progress.advance(task, n)


@dataclass
class _Tally:
    samples: int = 0
    images: int = 0
    videos: int = 0
    audio_clips: int = 0
    audio_seconds: float = 0.0
    written: dict[int, dict[str, Any]] = field(default_factory=dict)
    unreadable: list[dict[str, Any]] = field(default_factory=list)


class _Writer:
    """The main process's side of a run: queues per medium, open shards, commits."""

    def __init__(
        self,
        folder: OutputFolder,
        units: Sequence[Unit],
        tokenizers: FrozenTokenizers,
        batch_size: int,
        advance: Callable[[int], None],
        on_batch: Callable[[int], None] | None,
    ) -> None:
        self.folder, self.units = folder, {u.index: u for u in units}
        self.tokenizers, self.batch_size = tokenizers, batch_size
        self.advance, self.on_batch = advance, on_batch
        self.open: dict[int, ShardOutput] = {}
        self.queues: dict[str, list[Decoded]] = {"image": [], "video": [], "audio": []}
        self.tally = _Tally()

    def take(self, item: Item) -> None:
        if item.unit not in self.open:
            self.open[item.unit] = self.folder.open(self.units[item.unit])
        if isinstance(item, Failed):
            self.open[item.unit].fail(item.position, item.key, item.reason)
            self.advance(1)
        elif isinstance(item, Decoded):
            queue = self.queues[item.kind]
            queue.append(item)
            if len(queue) >= self.batch_size:
                self.flush(item.kind)
        elif isinstance(item, DecodedDocument):
            self.write_document(item)
        else:
            self.end(item)

    def write_document(self, item: DecodedDocument) -> None:
        """An interleaved document, its media tokenized one by one on arrival (a document's media have
        mixed kinds and sizes; interleaved corpora hold few media a document)."""
        parts = tuple(p if isinstance(p, str) else self.medium(p) for p in item.parts)
        self.open[item.unit].write(InterleavedRecord(parts, item.source, item.key), item.position)
        self.tally.samples += 1
        self.advance(1)

    def medium(self, media: Media) -> CodeRecord:
        """One medium of an interleaved document as a code record (no text: the document holds the texts)."""
        if isinstance(media, AudioSegment):
            kind, value = "audio", media.wave
            (codes,) = self.tokenizers.encode_audio([value])
            frames = len(codes)
        else:
            kind, value = ("video" if media.is_video else "image"), media.pixels
            ((codes, frames),) = self.tokenizers.encode_visual([value], video=media.is_video)
        assert value is not None  # raw media decode to pixels and waves, never codes
        self._count_media(kind, [value])
        tokenizer = self.tokenizers.records["audio_codec" if kind == "audio" else "visual_tokenizer"]
        return CodeRecord(
            kind, codes, "", "", "", tokenizer["hash"], tokenizer["config"], self._scales(kind), frames,
            self._info(kind, value),
        )  # fmt: skip

    def end(self, item: UnitEnd) -> None:
        for kind, queue in self.queues.items():
            if any(d.unit == item.unit for d in queue):
                self.flush(kind)
        output = self.open.pop(item.unit)
        if item.error is None:
            self.tally.written[item.unit] = output.commit()
            return
        output.abort()
        unit = self.units[item.unit]
        self.tally.unreadable.append(input_failure(unit.describe(), item.error))
        self.advance(unit.count - item.read)

    def flush(self, kind: str) -> None:
        items, self.queues[kind] = self.queues[kind], []
        if not items:
            return
        if kind == "audio":
            codes = [(c, len(c)) for c in self.tokenizers.encode_audio([d.value for d in items])]
        else:
            codes = self.tokenizers.encode_visual([d.value for d in items], video=kind == "video")
        name = "audio_codec" if kind == "audio" else "visual_tokenizer"
        tokenizer = self.tokenizers.records[name]
        for item, (values, frames) in zip(items, codes, strict=True):
            record = CodeRecord(
                kind, values, item.text, item.source, item.key, tokenizer["hash"], tokenizer["config"],
                self._scales(kind), frames, self._info(kind, item.value),
            )  # fmt: skip
            self.open[item.unit].write(record, item.position)
        self._count(kind, items)
        self.advance(len(items))
        if self.on_batch is not None:
            self.on_batch(self.tally.samples)

    def _scales(self, kind: str) -> tuple[int, ...]:
        return () if kind == "audio" else tuple(self.tokenizers.visual.scales)

    def _info(self, kind: str, value: Tensor) -> dict[str, Any]:
        if kind == "audio":
            return {"sample_rate": self.tokenizers.audio.sample_rate, "samples": len(value)}
        if kind == "video":
            return {"clip_frames": int(value.shape[1])}
        return {}

    def _count(self, kind: str, items: list[Decoded]) -> None:
        self.tally.samples += len(items)
        self._count_media(kind, [d.value for d in items])

    def _count_media(self, kind: str, values: list[Tensor]) -> None:
        t = self.tally
        if kind == "image":
            t.images += len(values)
        elif kind == "video":
            t.videos += len(values)
        else:
            t.audio_clips += len(values)
            t.audio_seconds += sum(len(v) for v in values) / self.tokenizers.audio.sample_rate

    def abort(self) -> None:
        for output in self.open.values():
            output.abort()
        self.open.clear()


def input_failure(source: str, reason: str) -> dict[str, Any]:
    """A failure-manifest entry for a whole input (a sample's has its key and position, and its shard)."""
    return {"input": source, "key": None, "position": None, "reason": reason, "shard": None}


def _items(batch: Item) -> Item:
    return batch  # the DataLoader's collate: items travel as they are


def tokenize_corpus(
    inputs: Sequence[str],
    out: str | Path,
    tokenizers: FrozenTokenizers,
    media: MediaSpec = MediaSpec(),
    batch_size: int = 32,
    num_workers: int = 0,
    lines_per_shard: int = 10_000,
    index: str | None = None,
    progress: bool = True,
    on_batch: Callable[[int], None] | None = None,
) -> TokenizeResult:
    """Tokenize `inputs` (manifests, tar shards, brace patterns) into code shards under `out` (module
    docstring); shards finished by an earlier run into the same folder are skipped. Media are decoded as
    `PairedDataModule` decodes them with `media` (`None` sizes: the tokenizers').

    `on_batch(samples)` is called after every tokenized batch with the samples tokenized so far.
    """
    if batch_size < 1 or num_workers < 0:
        raise ValueError(f"need batch_size >= 1 and num_workers >= 0, got {batch_size} and {num_workers}")
    spec = tokenizers.resolve(media)
    units, unreadable_inputs = plan_units(inputs, lines_per_shard, index)
    run = {"tokenizers": tokenizers.summary(), "decode": dataclasses.asdict(spec)}
    folder = OutputFolder(out, run)
    finished = {u.index: state for u in units if (state := folder.finished(u)) is not None}
    todo = [u for u in units if u.index not in finished]
    start = time.perf_counter()
    with progress_bar(sum(u.count for u in todo), progress and bool(todo)) as advance:
        writer = _Writer(folder, todo, tokenizers, batch_size, advance, on_batch)
        if todo:
            loader = DataLoader(
                DecodedStream(todo, spec, tokenizers.support),
                batch_size=None,
                num_workers=min(num_workers, len(todo)),
                collate_fn=_items,
            )
            try:
                for item in loader:
                    writer.take(item)
            finally:
                writer.abort()  # shards still open were not finished: nothing of them stays
    seconds = time.perf_counter() - start
    states = {**finished, **writer.tally.written}
    folder.write_index([(u, states[u.index]) for u in units if u.index in states])
    failures = [input_failure(f.url, f.reason) for f in unreadable_inputs] + writer.tally.unreadable
    bad = 0
    for unit in units:
        for failure in states.get(unit.index, {}).get("failures", []):
            failures.append({"input": unit.url, **failure, "shard": unit.name})
            bad += 1
    folder.write_failures(failures)
    t = writer.tally
    return TokenizeResult(
        folder.root, len(t.written), len(finished), tuple(f["input"] for f in failures if f["shard"] is None),
        t.samples, bad, t.images, t.videos, t.audio_clips, t.audio_seconds, seconds,
    )  # fmt: skip
