"""The progress bar `zoo fit` shows: steps against `max_steps` on step-limited runs.

Lightning's bar counts batches per epoch and names the epoch against `max_epochs - 1`; a run limited by
`trainer.max_steps` has `max_epochs = -1`, so it read `Epoch 1/-2` with a bar that restarts every epoch.
Here a step-limited run shows one bar over the whole run, `Epoch 1, step ━━━━ 120/400`: optimizer steps
(`trainer.global_step`, so gradient accumulation and resumed runs count right) against `max_steps`. Runs
limited by epochs keep Lightning's bar as it is. `ZooCLI` installs it unless the config names a progress
bar itself.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar


class StepProgressBar(RichProgressBar):
    """Rich's progress bar, counting optimizer steps against `trainer.max_steps` when that is set (module
    docstring). Takes RichProgressBar's arguments (`refresh_rate`, `leave`, `theme`, `console_kwargs`)."""

    def _step_limited(self) -> bool:
        max_steps = self.trainer.max_steps
        return max_steps is not None and max_steps > 0

    @property
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps if self._step_limited() else super().total_train_batches

    def _get_train_description(self, current_epoch: int) -> str:
        if not self._step_limited():
            return super()._get_train_description(current_epoch)
        description = f"Epoch {current_epoch}, step"
        return f"{description:{len(self.validation_description)}}"  # as wide as "Validation": no flicker

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)  # resets the bar to 0 for the epoch
        if self._step_limited():
            self._update(self.train_progress_bar_id, trainer.global_step)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._step_limited():
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        if not self.is_disabled and self.train_progress_bar_id is None:  # resumed in the middle of an epoch
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()
