"""What the zoo's DataLoaders share: bad-sample accounting in the main process and a mid-epoch resume
state that Lightning checkpoints.

Lightning saves `state_dict()` of every train loader that has `state_dict`/`load_state_dict` (from rank 0
only, so the state must be the same on every rank) and restores it on resume, but by itself restarts the
epoch's iteration from the first batch. The state here is (epoch, batches handed out in that epoch); after
`load_state_dict` the next iteration of that same epoch starts after them. Counting batches in the loader
rather than in the sampler is what makes the count exact: with workers, sampling runs ahead of training.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader

from zoo.datamodules.bad_samples import BadSampleLedger, BadSamplePolicy, ReportedBatch, ReportingCollate


class ReportingLoader(DataLoader):
    """A DataLoader over a dataset that yields `Delivered` items: batches come out plain, their bad-sample
    records are counted (`bad_samples`, `samples_seen`, `bad_fraction`) and past the policy the iteration
    raises `TooManyBadSamples` here, in the main process.

    `collate_fn` is the plain collate of the values, which the loader wraps. The other arguments are
    DataLoader's own, passed through: Lightning rebuilds a loader from its constructor arguments to inject
    a distributed sampler, so the constructor has to accept everything DataLoader does.
    """

    _epoch, _delivered = 0, 0
    _resume: tuple[int, int] | None = None

    def __init__(
        self,
        dataset: Any,
        collate_fn: Callable[[list[Any]], Any],
        bad_samples: BadSamplePolicy = BadSamplePolicy(),
        **loader_args: Any,
    ) -> None:
        if not isinstance(collate_fn, ReportingCollate):
            collate_fn = ReportingCollate(collate_fn)
        super().__init__(dataset, collate_fn=collate_fn, **loader_args)
        self.ledger = BadSampleLedger(bad_samples)

    @property
    def bad_samples(self) -> int:
        return self.ledger.bad

    @property
    def samples_seen(self) -> int:
        return self.ledger.samples

    @property
    def bad_fraction(self) -> float:
        return self.ledger.fraction

    # -- resume ------------------------------------------------------------------------------------
    def _begin_epoch(self, epoch: int) -> int:
        """Starts counting `epoch`; returns how many of its batches a restored state says were trained."""
        skip = 0
        if self._resume is not None:
            resume_epoch, batches = self._resume
            self._resume = None
            skip = batches if resume_epoch == epoch else 0
        self._epoch, self._delivered = epoch, skip
        return skip

    def _unwrap(self, reports: Iterable[ReportedBatch]) -> Iterator[Any]:
        for report in reports:
            batch = self.ledger.add(report)
            self._delivered += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "batches": self._delivered}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        if not {"epoch", "batches"} <= set(state_dict):
            raise ValueError(
                f"a train dataloader state needs 'epoch' and 'batches', got {sorted(state_dict)}"
            )
        epoch, batches = int(state_dict["epoch"]), int(state_dict["batches"])
        # A finished epoch leaves nothing to skip: the next epoch starts from its first batch.
        self._resume = (epoch, batches) if 0 < batches < len(self) else None
