"""The zoo: one autoregressive MoE transformer for text, images, video and audio (ERNIE 5.0 recipe).

Public API (timm-style): `create_model`, `list_models`, `load_pretrained` (a saved directory or a hub repo
id, see `zoo.hub`), and `pipeline` (a trained model answering in strings, images and speech, see
`zoo.inference`); LightningModules live in `zoo.tasks`.
"""

from zoo.hub import load_pretrained
from zoo.inference import Pipeline, Speech, pipeline
from zoo.registry import create_model, get_preset, list_models
from zoo.version import __version__

__all__ = [
    "Pipeline",
    "Speech",
    "__version__",
    "create_model",
    "get_preset",
    "list_models",
    "load_pretrained",
    "pipeline",
]
