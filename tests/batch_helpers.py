"""Every tensor of a `GroupBatch` by name, for tests that compare two batches or ask which media they hold:
`input_ids`, ..., `targets.text`, `targets.visual`, `visual.slot`, `visual.image_pixels`, `audio.waves`,
`context.pixels` (a payload's tensors under its name; absent payloads and fields are left out)."""

from __future__ import annotations

from dataclasses import fields

from torch import Tensor

from zoo.batch import GroupBatch

PAYLOADS = ("visual", "audio", "context")


def batch_tensors(batch: GroupBatch) -> dict[str, Tensor]:
    named = {f.name: getattr(batch, f.name) for f in fields(batch) if f.name not in ("targets", *PAYLOADS)}
    named |= {f"targets.{k}": v for k, v in batch.targets.items()}
    for name in PAYLOADS:
        payload = getattr(batch, name)
        if payload is not None:
            tensors = {f.name: getattr(payload, f.name) for f in fields(payload)}
            named |= {f"{name}.{k}": v for k, v in tensors.items() if isinstance(v, Tensor)}
    return named
