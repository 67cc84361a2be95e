"""What a published zoo folder holds: file names, the two formats, and reading a folder's `config.json`."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# Past `max_shard_size` the weights are shards named by an index instead (`shards.py`).
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_SHARDS = "model-*-of-*.safetensors"
TOKENIZER_NAME = "tokenizer.json"
CARD_NAME = "README.md"
LIBRARY_NAME = "zoo"
UNIFIED_FORMAT = "zoo.unified_model"
COMPONENT_FORMAT = "zoo.component"
# Where each format keeps the `{class_path, init_args}` of what it rebuilds.
SPEC_KEY = {UNIFIED_FORMAT: "model", COMPONENT_FORMAT: "component"}
# The files (names and glob patterns) a download fetches and a push uploads: nothing else in a repo is read.
FOLDER_FILES = (CONFIG_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_SHARDS, TOKENIZER_NAME, CARD_NAME)
# The weight files of either layout: a push deletes those on the Hub it does not upload, so that a sharded
# save never sits beside an older single file (or the reverse).
WEIGHT_FILES = (WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_SHARDS)


def read_config(directory: str | Path, formats: Collection[str] = tuple(SPEC_KEY)) -> dict[str, Any]:
    """`directory/config.json` as a dict, refused unless its `format` is one of `formats` and it holds the
    spec that format rebuilds."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: not a saved zoo model or component")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    kind = config.get("format") if isinstance(config, dict) else None
    if kind not in formats or SPEC_KEY[kind] not in config:
        wanted = " or ".join(f"{f!r} with a {SPEC_KEY[f]!r} entry" for f in formats)
        what = "model" if formats == (UNIFIED_FORMAT,) else "model or component"
        raise ValueError(f"{path} is not a zoo {what} config (expected format {wanted}; got {kind!r})")
    return config
