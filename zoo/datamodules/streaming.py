"""Streams of samples larger than memory, split exactly over ranks and workers, resumable mid-epoch
(issue 14, item 4). Generic over what a sample is: tar members, jsonl lines, text documents.

    shards (counted)  ->  the worker's part of the epoch (`partition.plan_epoch`)
                      ->  samples read in file order, undecoded (`SampleFormat.read`)
                      ->  shuffle buffer seeded by (seed, epoch, slot)
                      ->  `map` (decode, tokenize), bad samples replaced (`bad_samples`)
                      ->  batches, collated in the worker  ->  `StreamLoader` in the main process

`StreamLoader` is a DataLoader whose state is {epoch, batches} (plus the layout, checked on restore),
identical on every rank. On resume every worker re-reads its part up to where it had got, without `map`
(nothing is decoded): how many batches each had delivered follows from the DataLoader's in-order round
robin (`partition.delivered_per_worker`), and the workers' parts are rotated so that the resumed
DataLoader, which asks its worker 0 first, gets the batch whose turn was next. Workers are never
persistent, so each iteration's workers see the current epoch and skip. The epoch comes from Lightning:
the loader's `sampler` is a `StreamSampler`, on which Lightning calls `set_epoch` every epoch, as it does
for map-style samplers.

Rank and world size are bound when the loader is built (`rank_and_world(trainer)` in the datamodule), never
read from the environment inside a worker: spawned workers would otherwise each read the whole corpus
(REFERENCES Part C §1).
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate, islice
from typing import Any

import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from zoo.datamodules.bad_samples import (
    SAMPLE_ERRORS,
    BadSamplePolicy,
    Delivered,
    describe,
    replace_bad_in_stream,
)
from zoo.datamodules.loaders import ReportingLoader
from zoo.datamodules.partition import (
    Layout,
    SlotPlan,
    batches_per_rank,
    delivered_per_worker,
    delivery_order,
    plan_epoch,
    samples_per_rank,
    shuffle_buffer,
    slot_rng,
)
from zoo.datamodules.shards import SampleFormat, Shard

# Lightning warns that `len()` of a loader over an IterableDataset "could be inaccurate" with several
# workers. Here it is exact by construction (every worker's share is fixed in advance), so say it once.
warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")


def rank_and_world(trainer: Any | None) -> tuple[int, int]:
    """The process's rank and the world size, from the Lightning trainer when there is one, else from an
    initialised process group (read here, in the main process), else a single process."""
    if trainer is not None:
        return int(trainer.global_rank), int(trainer.world_size)
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class StreamDataset(IterableDataset):
    """The samples of `shards`, streamed through a shuffle buffer and `map`.

    Each sample reaches `map` as the format's dict plus `__index__` (its position in the source: shards in
    the given order, samples in file order; stable across epochs and layouts, for per-sample seeds) and
    `__epoch__`. `map` runs in the worker after the buffer, so the buffer holds undecoded bytes.

    `ds[i]` reads sample `i` and maps it (its shard is read up to it: for looking at data, not training).

    Args:
        shards: the files and their counts (`shards.count_shards`).
        format: how to read a file (`TarSamples`, `JsonlLines`, `TextDocuments`).
        map: sample -> what the batch collates (a `Document`, ...); picklable.
        seed: shard order, start offset and buffer seed.
        shuffle: permute shards and shuffle samples (training); off keeps file order (evaluation).
        shuffle_buffer: samples per worker buffer (memory: this many undecoded samples per worker).
        bad_samples: when bad samples stop the run.
        errors: what `map` raises for a bad sample (skipped and replaced); anything else propagates.
    """

    def __init__(
        self,
        shards: Sequence[Shard],
        format: SampleFormat,
        map: Callable[[dict], Any],
        seed: int = 0,
        shuffle: bool = True,
        shuffle_buffer: int = 1000,
        bad_samples: BadSamplePolicy = BadSamplePolicy(),
        errors: tuple[type[BaseException], ...] = SAMPLE_ERRORS,
    ) -> None:
        if not shards or sum(s.samples for s in shards) == 0:
            raise ValueError("a stream needs at least one sample")
        if shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer must be >= 1, got {shuffle_buffer}")
        self.shards, self.format, self.map = list(shards), format, map
        self.seed, self.shuffle, self.buffer_size = seed, shuffle, shuffle_buffer
        self.policy, self.errors = bad_samples, errors
        self.starts = [0, *accumulate(s.samples for s in self.shards)]  # source index of each shard's first
        self.epoch = 0
        self.layout = Layout()  # the layout of the loader built last (for `sampler`)
        self._next: tuple[int, Layout, int] | None = None  # (epoch, layout, skip) of the next iteration

    def __len__(self) -> int:
        return self.starts[-1]

    @property
    def sampler(self) -> StreamSampler:
        return StreamSampler(self, self.layout)

    def plan(self, epoch: int, layout: Layout) -> list[SlotPlan]:
        return plan_epoch([s.samples for s in self.shards], self.seed, epoch, self.shuffle, layout)

    # -- in the worker ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Delivered]:
        # Not a generator: the epoch, layout and skip are taken now, when the DataLoader starts its workers
        # (or, without workers, makes its fetcher), before the loader clears them.
        epoch, layout, skip = self._next or (self.epoch, self.layout, 0)
        info = get_worker_info()
        worker = info.id if info is not None else 0
        if (info.num_workers if info is not None else 0) != layout.workers:
            raise RuntimeError(
                f"the stream was laid out for {layout.workers} workers but runs in "
                f"{info.num_workers if info else 0}: build the loader with StreamLoader"
            )
        plans = self.plan(epoch, layout)
        taken, turn = delivered_per_worker([p.batches for p in plans], skip)
        role = (worker + turn) % layout.slots_per_rank  # whose part this worker reads (see partition)
        samples = self._read(plans[role], epoch)
        if self.shuffle:
            rng = slot_rng(self.seed, epoch, layout.slot(role))
            samples = shuffle_buffer(samples, self.buffer_size, rng)
        done = taken[role] * layout.batch_size
        return replace_bad_in_stream(samples, self.map, self.errors, self.policy, skip=done)

    def _read(self, plan: SlotPlan, epoch: int) -> Iterator[dict]:
        for piece in plan.pieces:
            shard = self.shards[piece.shard]
            first = self.starts[piece.shard] + piece.first
            for offset, sample in enumerate(self._read_piece(shard, piece.first, piece.count)):
                sample["__index__"], sample["__epoch__"] = first + offset, epoch
                yield sample

    def _read_piece(self, shard: Shard, first: int, count: int) -> Iterator[dict]:
        """`count` samples from sample `first` of `shard`. A shard that breaks off or ends early makes the
        rest of its samples bad (`__error__`), so that every rank still delivers its count."""
        read, reason = 0, ""
        samples = self.format.read(shard.url, shard.start + first)
        try:
            for sample in islice(samples, count):
                read += 1
                yield sample
        except Exception as error:  # noqa: BLE001 - a broken shard is data to count, not a crash
            at = shard.start + first + read
            reason = f"the shard could not be read past sample {at}: {describe(error)}"
        finally:
            samples.close()
        if read < count and not reason:
            reason = f"the shard ended after {shard.start + first + read} samples; its count says more"
        for k in range(read, count):
            yield {"__url__": shard.url, "__key__": f"sample {shard.start + first + k}", "__error__": reason}

    # -- random access, for inspection ---------------------------------------------------------------
    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range 0..{len(self) - 1}")
        i = bisect.bisect_right(self.starts, index) - 1
        shard = self.shards[i]
        samples = self.format.read(shard.url, shard.start + index - self.starts[i])
        try:
            sample = next(samples)
        finally:
            samples.close()
        sample["__index__"], sample["__epoch__"] = index, self.epoch
        return self.map(sample)


class StreamSampler:
    """The epoch of a stream, where Lightning sets it, and the order in which a loader with `layout`
    delivers the stream's samples: `(index, epoch)` pairs, listed without reading any data (but held in
    memory: an index per sample of the rank; Lightning never lists it)."""

    def __init__(self, dataset: StreamDataset, layout: Layout) -> None:
        self.dataset, self.layout = dataset, layout

    @property
    def epoch(self) -> int:
        return self.dataset.epoch

    def set_epoch(self, epoch: int) -> None:
        self.dataset.epoch = epoch

    def __iter__(self) -> Iterator[tuple[int, int]]:
        ds, epoch = self.dataset, self.epoch
        per_worker = []
        for worker, plan in enumerate(ds.plan(epoch, self.layout)):
            indices = (ds.starts[p.shard] + p.first + k for p in plan.pieces for k in range(p.count))
            if ds.shuffle:
                rng = slot_rng(ds.seed, epoch, self.layout.slot(worker))
                indices = shuffle_buffer(indices, ds.buffer_size, rng)
            per_worker.append(list(indices))
        return ((index, epoch) for index in delivery_order(per_worker, self.layout.batch_size))

    def __len__(self) -> int:
        return samples_per_rank(len(self.dataset), self.layout)


class StreamLoader(ReportingLoader):
    """A DataLoader of a `StreamDataset` for one rank: exact `len()`, {epoch, batches} state, bad samples
    counted here (see `ReportingLoader`).

    Args:
        dataset: the stream.
        collate_fn: values of a batch -> the batch (runs in the worker).
        batch_size: samples per batch.
        rank, world_size: this process and how many there are (bind them from the trainer).
        num_workers: DataLoader workers (0: the main process reads).
        drop_last: training: every batch full, every rank the same count; evaluation: keep every sample.
        multiprocessing_context: as DataLoader's (None: torch's default).
    """

    def __init__(
        self,
        dataset: StreamDataset,
        collate_fn: Callable[[list[Any]], Any],
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        drop_last: bool = True,
        multiprocessing_context: str | None = None,
    ) -> None:
        self.layout = Layout(rank, world_size, num_workers, batch_size, drop_last)
        super().__init__(
            dataset,
            collate_fn,
            bad_samples=dataset.policy,
            batch_size=batch_size,
            num_workers=num_workers,
            persistent_workers=False,
            multiprocessing_context=multiprocessing_context if num_workers else None,
        )
        dataset.layout = self.layout

    # DataLoader keeps an `_InfiniteConstantSampler` for iterable datasets and, batching automatically,
    # never reads `self.sampler` again (its batch sampler holds that one). Exposing the StreamSampler here
    # is what makes Lightning's per-epoch `set_epoch` reach the stream.
    @property
    def sampler(self) -> StreamSampler:
        return StreamSampler(self.dataset, self.layout)

    @sampler.setter
    def sampler(self, value: Any) -> None:
        self._torch_sampler = value

    def __len__(self) -> int:
        return batches_per_rank(len(self.dataset), self.layout)

    def __iter__(self) -> Iterator[Any]:
        # A generator: nothing runs before the first batch is asked for, i.e. after Lightning's `set_epoch`.
        skip = self._begin_epoch(self.dataset.epoch)
        self.dataset._next = (self.dataset.epoch, self.layout, skip)
        try:
            reports = super().__iter__()  # the workers start (and copy the dataset) here
        finally:
            self.dataset._next = None
        yield from self._unwrap(reports)

    def state_dict(self) -> dict[str, int]:
        layout = self.layout
        return {
            **super().state_dict(),
            "world_size": layout.ranks, "num_workers": layout.workers, "batch_size": layout.batch_size,
        }  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        layout = self.layout
        now = {"world_size": layout.ranks, "num_workers": layout.workers, "batch_size": layout.batch_size}
        changed = {k: (state_dict[k], v) for k, v in now.items() if k in state_dict and state_dict[k] != v}
        if changed and 0 < int(state_dict.get("batches", 0)) < self._saved_len(state_dict):
            raise ValueError(
                "a stream resumes mid-epoch only with the layout it was saved with; (saved, now): "
                f"{changed}. Resume with those settings or from a checkpoint at an epoch end"
            )
        super().load_state_dict(state_dict)

    def _saved_len(self, state_dict: dict[str, int]) -> int:
        """Batches per epoch of the layout a state was saved with (a stream rank's count is rank-blind)."""
        saved = Layout(
            0,
            int(state_dict.get("world_size", self.layout.ranks)),
            int(state_dict.get("num_workers", self.layout.workers)),
            int(state_dict.get("batch_size", self.layout.batch_size)),
            self.layout.drop_last,
        )
        return batches_per_rank(len(self.dataset), saved)
