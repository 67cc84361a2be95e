"""The learning-rate schedule every training task shares: linear warm-up, then cosine decay to a floor.

Tasks pass the schedule's length as `lambda: self.trainer.estimated_stepping_batches`, resolved at the
first step that needs it, not in `configure_optimizers`. Reading `estimated_stepping_batches` there with a
finite `max_epochs` makes Lightning (2.6, issue #20550) build the train loader before the checkpoint is
restored, and then it never calls the loader's `load_state_dict`: a resumed run would restart the epoch's
data instead of continuing it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

UNBOUNDED_RUN = (
    "the run has no step or epoch limit (only max_time), so the cosine schedule has no length: the learning"
    " rate stays at its peak after warm-up; set trainer.max_steps to decay it"
)
Total = int | float | Callable[[], int | float]


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: Total, min_lr_ratio: float
) -> dict[str, object]:
    """Lightning's `configure_optimizers` return value for `optimizer` with the schedule

        lr(step) / lr = (step + 1) / W                                   for step < W
                      = r + (1 - r) * (1 + cos(pi * (step - W) / (T - W))) / 2   afterwards

    with W = min(warmup_steps, T), T = max(1, total_steps), r = min_lr_ratio, stepped every batch.

    `total_steps` may be a zero-argument callable, called once at the first step after step 0. Step 0's
    factor is computed while `LambdaLR` is constructed, before the total is known; it is the same for any
    total of at least `warmup_steps` (1 / warmup_steps, or 1 without warm-up), and the only case that
    differs is a run shorter than its own warm-up, where step 0 uses 1 / warmup_steps, not 1 / T.
    An infinite total (a run limited only by time, `max_time`) has no length to decay over: the rate
    stays at its peak after warm-up, with a warning.
    """
    resolved: list[float] = []  # the total, once known; a closure, so nothing of it enters state_dict

    def total() -> float:
        if not resolved:
            value = total_steps() if callable(total_steps) else total_steps
            if math.isinf(value):
                rank_zero_warn(UNBOUNDED_RUN)
            resolved.append(max(1.0, value if math.isinf(value) else float(int(value))))
        return resolved[0]

    def schedule(step: int) -> float:
        if step == 0 and callable(total_steps) and not resolved:
            warmup, progress = warmup_steps, 0.0  # neither needs the total when T >= warmup_steps
        else:
            warmup = min(warmup_steps, total())
            progress = 0.0 if math.isinf(total()) else min(1.0, (step - warmup) / max(1, total() - warmup))
        if step < warmup:
            return (step + 1) / warmup
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
