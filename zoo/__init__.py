"""The zoo: one autoregressive MoE transformer for text, images, video and audio (ERNIE 5.0 recipe).

Public API (timm-style): `create_model`, `list_models`, `load_pretrained` (a saved directory or a hub repo
id, see `zoo.hub`), and `pipeline` (a trained model answering in strings, images and speech, see
`zoo.inference`); LightningModules live in `zoo.tasks`.
"""

from typing import Any

from zoo.hub import load_pretrained
from zoo.registry import create_model, get_preset, list_models
from zoo.version import __version__

# The pipeline needs the datamodules (and so Lightning): imported on first use, so that `import zoo` for
# `create_model` stays as light as it was.
_LAZY = {"Pipeline", "Speech", "pipeline"}

__all__ = [
    "Pipeline", "Speech", "__version__", "create_model", "get_preset", "list_models", "load_pretrained",
    "pipeline",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import zoo.inference

        return getattr(zoo.inference, name)
    raise AttributeError(f"module 'zoo' has no attribute {name!r}")
