"""Logs the bad samples the train loaders met (issue 14, item 5): `data/bad_samples` and
`data/bad_fraction`, summed over ranks, so a run that trains on partly broken data says so in its logs.

The counts come from the zoo's loaders (`zoo.datamodules.loaders.ReportingLoader`: streams and map-style
document datasets), which count in the main process on the batches actually delivered.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning as L
import torch


def reporting_loaders(loaders: Any) -> Iterator[Any]:
    """The loaders that count bad samples, among Lightning's train loaders (one, or a list or dict)."""
    if hasattr(loaders, "bad_samples") and hasattr(loaders, "samples_seen"):
        yield loaders
    elif isinstance(loaders, dict):
        for loader in loaders.values():
            yield from reporting_loaders(loader)
    elif isinstance(loaders, list | tuple):
        for loader in loaders:
            yield from reporting_loaders(loader)


class BadSampleMonitor(L.Callback):
    """Every `every_n_steps` optimiser steps (default: the trainer's `log_every_n_steps`), logs the bad
    samples met so far in this run and their share of the samples delivered, over all ranks.

    Args:
        every_n_steps: logging interval in steps; None follows the trainer.
    """

    def __init__(self, every_n_steps: int | None = None) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        every = self.every_n_steps or trainer.log_every_n_steps
        if trainer.global_step % every:  # the same step on every rank: the reduction below is collective
            return
        loaders = list(reporting_loaders(trainer.train_dataloader))
        if not loaders:
            return
        counts = torch.tensor(
            [sum(x.bad_samples for x in loaders), sum(x.samples_seen for x in loaders)], dtype=torch.float64
        )
        bad, seen = trainer.strategy.reduce(counts.to(pl_module.device), reduce_op="sum").tolist()
        pl_module.log("data/bad_samples", bad, on_step=True, on_epoch=False)
        pl_module.log("data/bad_fraction", bad / seen if seen else 0.0, on_step=True, on_epoch=False)
