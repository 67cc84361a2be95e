"""The text tokenizer travels in every checkpoint under one stable key, whatever the datamodule.

Lightning keeps `datamodule.state_dict()` under the datamodule's class name, so a checkpoint of one
datamodule loaded with another (the quickstart's config with the demo's checkpoint) silently decoded with a
freshly trained tokenizer. The tasks that read text store the tokenizer under `zoo.hub.TOKENIZER_KEY` and give
it back to whatever datamodule they are run with.
"""

from __future__ import annotations

from typing import Any

import lightning as L

from zoo.hub import TOKENIZER_KEY, checkpoint_tokenizer_json
from zoo.tokenizers.text import TextTokenizer


def save_tokenizer(trainer: L.Trainer | None, checkpoint: dict[str, Any]) -> None:
    tokenizer = getattr(getattr(trainer, "datamodule", None), "tokenizer", None)
    if isinstance(tokenizer, TextTokenizer):
        checkpoint[TOKENIZER_KEY] = tokenizer.to_json()


def restore_tokenizer(trainer: L.Trainer | None, checkpoint: dict[str, Any]) -> None:
    datamodule = getattr(trainer, "datamodule", None)
    text = checkpoint_tokenizer_json(checkpoint)
    if text is not None and datamodule is not None and hasattr(datamodule, "tokenizer"):
        datamodule.tokenizer = TextTokenizer.from_json(text, source="the checkpoint")
