"""How several sources make one epoch: each source's share by its weight, as `Shard` ranges.

A source of N samples with weight w contributes T = round(w * N) samples to every epoch: floor(T / N)
whole passes over the source, then the R = T mod N samples that follow a fixed offset (drawn once from the
seed and the source's number; the run wraps round the source's end). So weight 1 reads each sample once,
weight 3 three times, weight 0.25 a quarter of the source. The epoch's stream is these ranges of every
source in source order, and the streaming core does the rest as for any list of shards: it permutes them
per epoch, splits them exactly over ranks and workers, shuffles through its buffer and resumes mid-epoch.
Every range is its own part of the stream, so a sample read twice in an epoch sits at two stream indices
and draws its task twice, independently.

The fractional part is the same samples every epoch: with w = 0.5 one half of the source is read each
epoch and the other half never (`describe_mixture` says so at setup). Use w < 1 to cap a large source
whose tail you do not need, or give the source fewer files.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from zoo.datamodules.shards import Shard
from zoo.datamodules.text import split_shards


@dataclass(frozen=True)
class SourcePart:
    """What one source contributes to an epoch: its ranges of samples and how many of its own it reads."""

    shards: tuple[Shard, ...]
    size: int  # the source's samples (after any validation tail)
    distinct: int  # how many different samples of it an epoch reads

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)


def window(shards: Sequence[Shard], offset: int, count: int) -> list[Shard]:
    """`count` samples of the sequence of `shards` from position `offset` on, wrapping round its end."""
    starts = [0, *accumulate(s.samples for s in shards)]
    total = starts[-1]
    if not 0 <= count <= total:
        raise ValueError(f"a window of {count} samples does not fit {total}")
    pieces, position, left = [], offset % total if total else 0, count
    while left > 0:
        i = bisect.bisect_right(starts, position) - 1  # empty shards are stepped over
        shard = shards[i]
        first = position - starts[i]
        take = min(left, shard.samples - first)
        pieces.append(Shard(shard.url, take, shard.start + first))
        left -= take
        position = (position + take) % total
    return pieces


def weighted_part(shards: Sequence[Shard], weight: float, seed: int, number: int, name: str) -> SourcePart:
    """Source `number`'s ranges for one epoch at `weight` (module docstring)."""
    size = sum(s.samples for s in shards)
    target = round(weight * size)
    if size == 0 or target == 0:
        raise ValueError(
            f"source {number} ({name}) gives no samples to an epoch: {size} samples at weight {weight:g}; "
            "raise its weight or give it more samples"
        )
    passes, rest = divmod(target, size)
    offset = random.Random(f"zoo.mixture/{seed}/{number}").randrange(size)
    parts = [*(list(shards) * passes), *window(shards, offset, rest)]
    return SourcePart(tuple(parts), size, size if passes else rest)


def held_out_tail(shards: Sequence[Shard], fraction: float) -> tuple[list[Shard], list[Shard]]:
    """The head of a source for training and its last `fraction` (at least one sample, when it has two or
    more and fraction > 0) for validation."""
    total = sum(s.samples for s in shards)
    n_val = max(1, int(total * fraction)) if fraction > 0 and total > 1 else 0
    head, tail = split_shards(list(shards), total - n_val)
    return head, [s for s in tail if s.samples]


def describe_mixture(parts: Sequence[SourcePart], names: Sequence[str]) -> list[str]:
    """One line per source: its share of the epoch, and what it never reads when its weight is fractional."""
    total = sum(p.samples for p in parts)
    lines = []
    for part, name in zip(parts, names, strict=True):
        line = f"{name}: {part.samples} of the epoch's {total} samples ({part.samples / total:.1%})"
        if part.distinct < part.size:
            line += (
                f"; its weight reads {part.distinct} of its {part.size} samples, the same ones every epoch"
            )
        lines.append(line)
    return lines
