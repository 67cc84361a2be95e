"""The zoo: one autoregressive MoE transformer for text, images, video and audio (ERNIE 5.0 recipe).

Public API (timm-style): `create_model`, `list_models`, `load_pretrained` (a saved directory or a hub repo
id, see `zoo.hub`); LightningModules live in `zoo.tasks`.
"""

__version__ = "0.1.0"

from zoo.hub import load_pretrained  # noqa: E402  (zoo.hub reads __version__)
from zoo.registry import create_model, get_preset, list_models  # noqa: E402

__all__ = ["create_model", "get_preset", "list_models", "load_pretrained"]
