"""What `zoo predict` asks of the unified model: the requests a multimodal datamodule makes, a task answers.

`ShapesMultimodalDataModule` and `PairedDataModule` turn their validation samples, the captions to render
and the files to caption into `MediaRequest`s (their `predict_dataloader` batches them as `MediaRequests`);
`zoo.tasks.multimodal_eval.answer_requests` generates the answers and scores those whose scene is known.
The producer owns the type: the task layer imports it from here, the datamodules never import a task.
"""

from __future__ import annotations

from dataclasses import dataclass

from zoo.datamodules.sequence import Document
from zoo.world.scenes import Scene


@dataclass
class MediaRequest:
    """One `zoo predict` request: a caption to render (`prompt` ids ending with the media opener) or
    media to caption (`document`, a prompt document). `scene`, when known, lets the verifier score it.

    `task` is a `zoo.task_names.Task` (or "val_sample" for a validation sample that could not be read)."""

    task: str
    name: str
    prompt: list[int] | None = None
    document: Document | None = None
    scene: Scene | None = None
    error: str | None = None  # why this request cannot be answered (a bad file): reported, others go on


class MediaRequests:
    """A batch of requests. Deliberately not a list or dataclass: Lightning moves batches to the device by
    walking collections, and scenes are frozen dataclasses it refuses; the model moves what it needs."""

    def __init__(self, requests: list[MediaRequest]) -> None:
        self.requests = list(requests)

    def __len__(self) -> int:
        return len(self.requests)
