"""A short RL fit for the tests that train an `RLTask` end to end: the metrics every step logged."""

from __future__ import annotations

from pathlib import Path

import lightning as L


def fit_logging_metrics(task: L.LightningModule, data: L.LightningDataModule, root: Path,
                        steps: int = 2) -> tuple[L.Trainer, list[dict[str, float]]]:  # fmt: skip
    """Fit `task` on `data` for `steps` steps (one validation batch at the end); returns the trainer (its
    `callback_metrics` hold the validation's) and the callback metrics after every training batch."""
    logged: list[dict[str, float]] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
            logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    trainer = L.Trainer(
        accelerator="cpu", max_steps=steps, default_root_dir=root, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=1,
        val_check_interval=steps, callbacks=[Record()],
    )  # fmt: skip
    trainer.fit(task, datamodule=data)
    return trainer, logged
