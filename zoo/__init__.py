"""The zoo: one autoregressive MoE transformer for text, images, video and audio (ERNIE 5.0 recipe).

Public API (timm-style): `create_model`, `list_models`; LightningModules live in `zoo.tasks`.
"""

from zoo.registry import create_model, get_preset, list_models

__all__ = ["create_model", "get_preset", "list_models"]
__version__ = "0.1.0"
