"""The learning-rate schedule every training task shares: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math

import torch


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> dict[str, object]:
    """Lightning's `configure_optimizers` return value for `optimizer` with the schedule

        lr(step) / lr = (step + 1) / W                                   for step < W
                      = r + (1 - r) * (1 + cos(pi * (step - W) / (T - W))) / 2   afterwards

    with W = min(warmup_steps, T), T = max(1, total_steps), r = min_lr_ratio, stepped every batch.
    """
    total = max(1, int(total_steps))
    warmup, floor = min(warmup_steps, total), min_lr_ratio

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
