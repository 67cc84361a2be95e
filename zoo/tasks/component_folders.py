"""The end of a component task's fit: the trained component as its own publishable folder.

Beside the bare weights file each task writes (`visual_tokenizer.safetensors`, which configs load through
`weights`), `write_component_folder` writes the folder of the same stem (`visual_tokenizer/`: config,
safetensors, card; `PretrainedComponent.save_pretrained`). `zoo export` of a unified model built from that
weights file names the folder instead of copying the component, and `zoo push --folder` publishes it.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L

from zoo.publishing.component import PretrainedComponent


def fit_metrics(trainer: L.Trainer) -> dict[str, float]:
    """The last validation and test figures the trainer logged (`val/...`, `test/...`), for the card."""
    return {
        key: float(value)
        for key, value in trainer.callback_metrics.items()
        if key.startswith(("val", "test")) and getattr(value, "numel", lambda: 1)() == 1
    }


def dataset_names(trainer: L.Trainer) -> list[str]:
    """What the component was trained on: the datamodule's `dataset_name` if it has one, else its class;
    without a datamodule, the class of the training loader's dataset ("unrecorded" when there is none)."""
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None:
        return [str(getattr(datamodule, "dataset_name", None) or type(datamodule).__name__)]
    loader = getattr(trainer, "train_dataloader", None)
    dataset = getattr(loader, "dataset", None)
    return [type(dataset).__name__ if dataset is not None else "unrecorded"]


def write_component_folder(trainer: L.Trainer, component: PretrainedComponent, weights_file: Path) -> Path:
    """`component.save_pretrained` into the folder beside `weights_file` of the same stem; returns it."""
    folder = weights_file.with_suffix("")
    return component.save_pretrained(folder, datasets=dataset_names(trainer), metrics=fit_metrics(trainer))
