"""Bad samples: skipped, replaced, counted, named, and stopped past a threshold (issue 14, item 5).

Every real corpus has samples that cannot be used: a truncated image, an undecodable clip, a malformed
manifest line, an empty caption. Dropping them would change how many samples (and so how many steps) a
rank sees, and unequal step counts hang DDP; returning `None` and filtering in `collate` changes the batch
size (pytorch/pytorch#1137). So a bad sample is *replaced* by a good one, deterministically:

- streams: by the next good sample of the same worker's epoch order (wrapping round to the worker's first
  good sample for bad ones at its very end). This depends only on (seed, epoch, slot), never on what was
  delivered before a resume, so a resumed run replaces exactly as the uninterrupted one did;
- map-style datasets: by an index drawn from a hash of (seed, epoch, index, attempt).

Workers attach a `BadRecord` to each replacement (`Delivered`); `ReportingCollate` carries the records of a
batch beside it to the main process, where `BadSampleLedger` counts them, logs them (rate-limited, each
named by file and key) and raises `TooManyBadSamples` past `BadSamplePolicy.max_bad_fraction`. Counting on
the delivered batches, rather than in shared memory, keeps the figures exact (workers run ahead of
training) and puts the error in the main process, as a plain exception, at the batch where it happened.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


class BadSample(Exception):
    """Raised by a caller's `map` for a sample that its own checks refuse (an empty caption, a clip too
    short); the message says what was expected."""


# What a `map` (decode, tokenize) raises for bad data: `ValueError` covers JSON and UTF-8 errors and the
# zoo's `MediaError`, `OSError` truncated or unidentified images and missing files. Callers add their
# decoders' own types (PIL's `DecompressionBombError`, a video decoder's `RuntimeError`).
SAMPLE_ERRORS: tuple[type[BaseException], ...] = (BadSample, ValueError, OSError, EOFError)


@dataclass(frozen=True)
class BadSamplePolicy:
    """When bad samples stop the run.

    Args:
        max_bad_fraction: the largest tolerated share of bad samples among those delivered.
        min_samples: the fraction is judged only after this many samples (one bad sample among the first
            ten is not a broken corpus).
    """

    max_bad_fraction: float = 0.01
    min_samples: int = 100

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise ValueError(f"max_bad_fraction must lie in [0, 1], got {self.max_bad_fraction}")
        if self.min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {self.min_samples}")

    def exceeded(self, bad: int, samples: int) -> bool:
        return samples >= self.min_samples and bad > self.max_bad_fraction * samples


@dataclass(frozen=True)
class BadRecord:
    """One bad sample: where it is (`source`: file or url, `key`: tar key, line or index) and why."""

    source: str
    key: str
    reason: str

    def __str__(self) -> str:
        return f"{self.source} [{self.key}]: {self.reason}"


def describe(error: BaseException, limit: int = 300) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Delivered:
    """What a worker hands to collate for one sample position: the value (the sample's own, or its
    replacement's), the record of the bad sample it replaces, and `fatal` when the worker must stop."""

    value: Any
    bad: tuple[BadRecord, ...] = ()
    fatal: str | None = None


@dataclass(frozen=True)
class ReportedBatch:
    """A collated batch with the bad-sample records of its positions (`batch` is None when fatal)."""

    batch: Any
    samples: int
    bad: tuple[BadRecord, ...]
    fatal: str | None = None


class ReportingCollate:
    """`collate_fn` of loaders whose datasets yield `Delivered`: collates the values, keeps the records."""

    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, items: list[Delivered]) -> ReportedBatch:
        bad = tuple(record for item in items for record in item.bad)
        fatal = next((item.fatal for item in items if item.fatal is not None), None)
        if fatal is not None:
            return ReportedBatch(None, len(items), bad, fatal)
        return ReportedBatch(self.collate([item.value for item in items]), len(items), bad)


class TooManyBadSamples(RuntimeError):
    """The bad samples passed `BadSamplePolicy.max_bad_fraction`: the data, not the model, needs fixing."""


class BadSampleLedger:
    """The main process's count of bad samples, with rate-limited warnings and the stop rule.

    The first `named` bad samples are each logged with their file, key and reason; after that one line per
    `interval` seconds gives the running count and the latest one, so a corpus with many bad samples cannot
    flood the log.
    """

    def __init__(self, policy: BadSamplePolicy, named: int = 10, interval: float = 30.0) -> None:
        self.policy, self.named, self.interval = policy, named, interval
        self.samples = self.bad = 0
        self.latest: list[BadRecord] = []
        self._unlogged, self._last_log = 0, float("-inf")

    @property
    def fraction(self) -> float:
        return self.bad / self.samples if self.samples else 0.0

    def add(self, report: ReportedBatch) -> Any:
        """Counts a batch's report; returns its batch or raises `TooManyBadSamples`."""
        self.samples += report.samples
        for record in report.bad:
            self._note(record)
        if report.fatal is not None:
            raise TooManyBadSamples(f"{report.fatal}; {self._summary()}")
        if self.policy.exceeded(self.bad, self.samples):
            raise TooManyBadSamples(
                f"{self.bad} of {self.samples} samples were bad ({self.fraction:.1%}), more than "
                f"max_bad_fraction={self.policy.max_bad_fraction}; {self._summary()}"
            )
        return report.batch

    def _note(self, record: BadRecord) -> None:
        self.bad += 1
        self.latest = [*self.latest[-4:], record]
        if self.bad <= self.named:
            log.warning("bad sample %d skipped and replaced: %s", self.bad, record)
            return
        self._unlogged += 1
        now = time.monotonic()
        if now - self._last_log >= self.interval:
            log.warning(
                "%d more bad samples skipped (%d in all, %.2f%% of %d); latest: %s",
                self._unlogged, self.bad, 100 * self.fraction, self.samples, record,
            )  # fmt: skip
            self._unlogged, self._last_log = 0, now

    def _summary(self) -> str:
        latest = "; ".join(str(r) for r in self.latest)
        return f"the latest bad samples: {latest}" if latest else "no sample was named"


def replace_bad_in_stream(
    samples: Iterable[dict],
    map: Callable[[dict], Any],
    errors: tuple[type[BaseException], ...],
    policy: BadSamplePolicy,
    skip: int = 0,
) -> Iterator[Delivered]:
    """`map` over one worker's samples, each bad one replaced by the next good one (see the module doc).

    The first `skip` samples (those a resumed run already trained on) are passed over without `map`,
    except that the worker's first good sample is still found, since bad samples at the very end take it.
    A sample with an `"__error__"` field (a shard that could not be read there) is bad without `map`.
    A run of consecutive bad samples that alone passes the policy stops the worker at once (`fatal`)
    instead of reading on for a replacement.
    """
    nothing = object()
    first_good: Any = nothing
    pending: list[BadRecord] = []
    seen = bad = 0
    for position, sample in enumerate(samples):
        if position < skip:
            if first_good is nothing:
                first_good, _ = _try_map(map, sample, errors, nothing)
            continue
        seen += 1
        value, record = _try_map(map, sample, errors, nothing)
        if record is not None:
            bad += 1
            pending.append(record)
            if len(pending) >= policy.min_samples and policy.exceeded(bad, seen):
                yield Delivered(None, tuple(pending), fatal=f"{len(pending)} consecutive bad samples")
                return
            continue
        if first_good is nothing:
            first_good = value
        for record in pending:
            yield Delivered(value, (record,))
        pending = []
        yield Delivered(value)
    if pending:
        if first_good is nothing:
            yield Delivered(None, tuple(pending), fatal="a worker's samples were all bad")
            return
        for record in pending:
            yield Delivered(first_good, (record,))


def _try_map(
    map: Callable[[dict], Any], sample: dict, errors: tuple[type[BaseException], ...], nothing: object
) -> tuple[Any, BadRecord | None]:
    source, key = str(sample.get("__url__", "?")), str(sample.get("__key__", "?"))
    if "__error__" in sample:
        return nothing, BadRecord(source, key, str(sample["__error__"]))
    try:
        return map(sample), None
    except errors as error:
        return nothing, BadRecord(source, key, describe(error))
