"""Who reads what in an epoch of a stream: an exact partition of shards over ranks and workers, the
shuffle buffer, and the delivery order of torch's DataLoader (issue 14, item 4).

All of it is arithmetic on sample counts, a function of (seed, epoch) and the layout alone, so every rank
computes the same partition without talking to the others, a resumed run recomputes what the interrupted
one did, and the order of an epoch can be listed without reading any data.

The epoch's global sequence is the shards, permuted by (seed, epoch), read in file order. Rank r gets a
contiguous range of it and splits that range over its workers in whole batches: a worker (a *slot*,
`rank * workers + worker`) opens only the shards overlapping its range and skips into at most the first
one. Every rank delivers the same number of batches, `floor(N / ranks) // batch_size` when training (DDP
needs equal step counts); the `N - ranks * batches * batch_size` samples left over are the ones just before
a start offset drawn from (seed, epoch), so different samples are left out in different epochs. Evaluation
(`drop_last=False`) keeps every sample: ranks get `ceil(N / ranks)` samples each, the last ones wrapping
round to the start of the sequence (as torch's DistributedSampler pads), and a worker's last batch may be
short.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Layout:
    """Who reads a stream: `ranks` processes with `workers` DataLoader workers each (0 = the main process
    reads, which counts as one slot), batches of `batch_size`, short batches kept or not."""

    rank: int = 0
    ranks: int = 1
    workers: int = 0
    batch_size: int = 1
    drop_last: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.ranks:
            raise ValueError(f"rank {self.rank} is outside 0..{self.ranks - 1}")
        if self.workers < 0 or self.batch_size < 1:
            raise ValueError(f"need workers >= 0 and batch_size >= 1, got {self.workers}, {self.batch_size}")

    @property
    def slots_per_rank(self) -> int:
        return max(1, self.workers)

    def slot(self, worker: int) -> int:
        return self.rank * self.slots_per_rank + worker


@dataclass(frozen=True)
class Piece:
    """Samples `[first, first + count)` of shard `shard` (numbered within the shard)."""

    shard: int
    first: int
    count: int


@dataclass(frozen=True)
class SlotPlan:
    """What one worker reads in an epoch (`pieces`, in order) and how many samples it delivers."""

    pieces: tuple[Piece, ...]
    samples: int
    batch_size: int

    @property
    def batches(self) -> int:
        return -(-self.samples // self.batch_size)


def shard_order(shards: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    order = list(range(shards))
    if shuffle:
        random.Random(f"zoo.shards/{seed}/{epoch}").shuffle(order)
    return order


def samples_per_rank(total: int, layout: Layout) -> int:
    if layout.drop_last:
        return total // layout.ranks // layout.batch_size * layout.batch_size
    return -(-total // layout.ranks)


def start_offset(total: int, layout: Layout, seed: int, epoch: int, shuffle: bool) -> int:
    """Where the epoch's sequence starts: 0 unless samples are left out, then a (seed, epoch) draw."""
    left_out = total - layout.ranks * samples_per_rank(total, layout)
    if not shuffle or left_out <= 0:
        return 0
    return random.Random(f"zoo.offset/{seed}/{epoch}").randrange(total)


def worker_samples(rank_samples: int, layout: Layout) -> list[int]:
    """A rank's samples split over its workers in whole batches (the earlier workers take one batch more
    when they do not divide evenly; a short last batch goes to the worker that holds the rank's end)."""
    b = layout.batch_size
    batches = -(-rank_samples // b)
    workers = layout.slots_per_rank
    counts = [(batches // workers + (w < batches % workers)) * b for w in range(workers)]
    excess = sum(counts) - rank_samples
    for w in reversed(range(workers)):  # the rank's end lies in the last worker with any batch
        if counts[w]:
            counts[w] -= excess
            break
    return counts


def batches_per_rank(total: int, layout: Layout) -> int:
    """Batches each rank delivers per epoch (`len()` of its loader)."""
    counts = worker_samples(samples_per_rank(total, layout), layout)
    return sum(-(-n // layout.batch_size) for n in counts)


def plan_epoch(counts: Sequence[int], seed: int, epoch: int, shuffle: bool, layout: Layout) -> list[SlotPlan]:
    """The plan of every worker of `layout.rank` for `epoch`, over shards of `counts` samples."""
    total = sum(counts)
    if total == 0:
        raise ValueError("the stream has no samples")
    order = shard_order(len(counts), seed, epoch, shuffle)
    ends = list(accumulate(counts[s] for s in order))  # sequence position where each permuted shard ends
    per_rank = samples_per_rank(total, layout)
    start = start_offset(total, layout, seed, epoch, shuffle) + layout.rank * per_rank
    plans = []
    for samples in worker_samples(per_rank, layout):
        plans.append(SlotPlan(tuple(_pieces(start, samples, ends, order, total)), samples, layout.batch_size))
        start += samples
    return plans


def _pieces(start: int, count: int, ends: list[int], order: list[int], total: int) -> Iterator[Piece]:
    """Positions `start .. start + count - 1` of the cyclic sequence, as runs within shards."""
    position = start % total
    while count > 0:
        i = bisect.bisect_right(ends, position)
        shard_start = ends[i - 1] if i else 0
        take = min(count, ends[i] - position)
        yield Piece(order[i], position - shard_start, take)
        count -= take
        position = (position + take) % total


def delivered_per_worker(batches: Sequence[int], delivered: int) -> tuple[list[int], int]:
    """How many batches each worker had handed over when the DataLoader had delivered `delivered`, and
    which worker's turn is next.

    torch's DataLoader (in order, the default) asks its workers for batches in turn and skips a worker once
    it is exhausted: round k takes batch k of every worker that has more than k. A resumed DataLoader
    starts its turns at its worker 0 again, so the resumed stream gives that role to the worker whose turn
    was next (`StreamDataset` rotates the workers by it).
    """
    taken = [0] * len(batches)
    left = delivered
    for k in range(max(batches, default=0)):
        for w, n in enumerate(batches):
            if n <= k:
                continue
            if left == 0:
                return taken, w
            taken[w] += 1
            left -= 1
    if left:
        raise ValueError(f"{delivered} batches delivered, but the workers hold only {sum(batches)}")
    return taken, 0


def delivery_order(per_worker: Sequence[Sequence[T]], batch_size: int) -> Iterator[T]:
    """Items of every worker in the order the DataLoader delivers them: worker batches in turn."""
    batches = [[items[i : i + batch_size] for i in range(0, len(items), batch_size)] for items in per_worker]
    for k in range(max((len(b) for b in batches), default=0)):
        for worker_batches in batches:
            if k < len(worker_batches):
                yield from worker_batches[k]


def shuffle_buffer(items: Iterable[T], size: int, rng: random.Random) -> Iterator[T]:
    """Streams `items` through a buffer of `size`: each new item replaces a random one, which leaves.

    The draws depend on positions only, never on the items, so the same seed shuffles a stream of indices
    exactly as it shuffles the samples those indices stand for.
    """
    buffer: list[T] = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        j = rng.randrange(size)
        yield buffer[j]
        buffer[j] = item
    rng.shuffle(buffer)
    yield from buffer


def slot_rng(seed: int, epoch: int, slot: int) -> random.Random:
    return random.Random(f"zoo.buffer/{seed}/{epoch}/{slot}")
