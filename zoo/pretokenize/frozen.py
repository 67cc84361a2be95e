"""Where the frozen tokenizers `zoo tokenize` runs come from (`FrozenTokenizers` itself, which encodes a batch
exactly as the unified model does, lives in `zoo.datamodules.frozen_tokenizers`: the loader's workers run it
too).

Sources, all read without executing code (the allow-list of `zoo.hub`, weights as safetensors):
- a config file (YAML or JSON) that holds the tokenizer's `{"class_path", "init_args"}` anywhere in it: the
  component alone, the tokenizer's training config or a pretraining config; plus a weights file (or the
  `weights` path the config gives);
- a unified model: an exported folder (`zoo export`, `save_pretrained`) or a `UnifiedPretraining`
  checkpoint, whose own visual tokenizer and audio codec are used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from torch import nn

from zoo.tokenizers.audio import AudioCodec
from zoo.tokenizers.visual import VisualTokenizer


def find_spec(tree: Any, wanted: str) -> dict | None:
    """The first `{"class_path": wanted, ...}` mapping in a config tree (depth first, in file order)."""
    if isinstance(tree, dict):
        if tree.get("class_path") == wanted:
            return tree
        children = tree.values()
    elif isinstance(tree, list):
        children = tree
    else:
        return None
    for child in children:
        found = find_spec(child, wanted)
        if found is not None:
            return found
    return None


def load_component(config_path: str, cls: type[nn.Module], weights: str | None = None) -> nn.Module:
    """The `cls` component a config file describes, with `weights` (a .safetensors file or a folder with
    model.safetensors) loaded strictly when given, else the weights the config names, if any."""
    from zoo.hub import build_from_config

    path = Path(config_path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such config file")
    try:
        tree = yaml.safe_load(path.read_text())  # JSON is YAML
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML or JSON ({error})") from None
    wanted = f"{cls.__module__}.{cls.__qualname__}"
    spec = find_spec(tree, wanted)
    if spec is None:
        raise ValueError(f"{path}: no component with class_path {wanted} in it")
    init_args = dict(spec.get("init_args") or {})
    if weights is not None:
        init_args["weights"] = weights
    elif init_args.get("weights") is None:
        raise ValueError(
            f"{path}: the {cls.__name__} has no weights: give its trained .safetensors file (an untrained "
            "tokenizer makes codes no model can use)"
        )
    module = build_from_config({"class_path": wanted, "init_args": init_args}, where=str(path))
    assert isinstance(module, cls)
    return module


def model_tokenizers(path: str) -> tuple[VisualTokenizer | None, AudioCodec | None]:
    """The visual tokenizer and audio codec of a unified model: an exported folder or a Lightning
    checkpoint of `UnifiedPretraining`."""
    from zoo.hub import from_pretrained, load_lightning_checkpoint

    location = Path(path)
    if location.is_dir() and not (location / "meta.pt").is_file():
        model = from_pretrained(location)
    elif location.exists():
        model, _ = load_lightning_checkpoint(location)
    else:
        raise FileNotFoundError(f"{path}: neither an exported model folder nor a checkpoint")
    if model.visual_tokenizer is None and model.audio_codec is None:
        raise ValueError(
            f"{path}: the model has neither a visual tokenizer nor an audio codec to tokenize with"
        )
    return model.visual_tokenizer, model.audio_codec
