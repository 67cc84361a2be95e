"""Named presets of the unified model, timm-style: `create_model(name, **overrides)`, `list_models()`.

A preset is the constructor arguments of the backbone, the vocabulary and the model, plus metadata.
`configs/presets/*.yaml` spell the same presets out for LightningCLI (a test keeps the two equal).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields

import torch

from zoo.models.backbone import UnifiedTransformer
from zoo.models.unified import UnifiedModel
from zoo.tokenizers.vocab import UnifiedVocab


@dataclass(frozen=True)
class Preset:
    """backbone / vocab / model: constructor arguments; meta_only: too large to build except on `meta`."""

    name: str
    description: str
    backbone: dict[str, object]
    vocab: dict[str, int] = field(default_factory=dict)
    model: dict[str, object] = field(default_factory=dict)
    meta_only: bool = False


_PRESETS: dict[str, Preset] = {}


def register_preset(preset: Preset) -> Preset:
    """Add a preset; a second preset of the same name is refused rather than silently replacing the first."""
    if preset.name in _PRESETS:
        raise ValueError(f"a model preset named {preset.name!r} is already registered")
    _PRESETS[preset.name] = preset
    return preset


def get_preset(name: str) -> Preset:
    try:
        return _PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; available: {', '.join(list_models())}") from None


def list_models() -> list[str]:
    return sorted(_PRESETS)


def _split_overrides(overrides: dict[str, object]) -> tuple[dict, dict, dict]:
    backbone_keys = set(inspect.signature(UnifiedTransformer).parameters)
    model_keys = set(inspect.signature(UnifiedModel).parameters) - {"backbone", "vocab"}
    vocab_keys = {f.name for f in fields(UnifiedVocab)}
    parts: tuple[dict, dict, dict] = ({}, {}, {})
    for key, value in overrides.items():
        for part, keys in zip(parts, (backbone_keys, vocab_keys, model_keys), strict=True):
            if key in keys:
                part[key] = value
                break
        else:
            valid = sorted(backbone_keys | vocab_keys | model_keys)
            raise TypeError(f"unknown override {key!r}; valid: {', '.join(valid)}")
    return parts


def create_model(name: str, device: str | torch.device | None = None, **overrides: object) -> UnifiedModel:
    """Build a preset: `create_model("tiny", n_layers=2)`, `create_model("ernie5-paper", device="meta")`.

    Overrides go to the backbone, the vocabulary or the model, whichever takes that argument.
    """
    preset = get_preset(name)
    if preset.meta_only and str(device) != "meta":
        raise ValueError(
            f"{name!r} has about a trillion parameters: build it with device='meta' to inspect it"
        )
    backbone_over, vocab_over, model_over = _split_overrides(overrides)
    with torch.device(device) if device is not None else _nullcontext():
        backbone = UnifiedTransformer(**{**preset.backbone, **backbone_over})
        vocab = UnifiedVocab(**{**preset.vocab, **vocab_over})
        return UnifiedModel(backbone, vocab, **{**preset.model, **model_over})


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


register_preset(
    Preset(
        "tiny",
        "Trains on 2 CPU cores in minutes (the quickstart).",
        backbone=dict(
            dim=128,
            n_layers=4,
            n_heads=4,
            n_kv_heads=2,
            n_dense_layers=1,
            n_experts=16,
            n_shared_experts=1,
            expert_hidden=64,
            top_k=4,
            max_seq_len=512,
        ),
        vocab=dict(text_size=512, visual_size=512, audio_size=256, audio_levels=4),
        model=dict(mtp_depth=1, mtp_loss_weight=0.3),
    )
)
register_preset(
    Preset(
        "small",
        "A single-GPU research model.",
        backbone=dict(
            dim=384,
            n_layers=8,
            n_heads=6,
            n_kv_heads=2,
            n_dense_layers=1,
            n_experts=32,
            n_shared_experts=1,
            expert_hidden=192,
            top_k=4,
            max_seq_len=2048,
        ),
        vocab=dict(text_size=16384, visual_size=4096, audio_size=1024, audio_levels=8),
        model=dict(mtp_depth=1, mtp_loss_weight=0.3),
    )
)
register_preset(
    Preset(
        "base",
        "A multi-GPU model (FSDP2).",
        backbone=dict(
            dim=768,
            n_layers=16,
            n_heads=12,
            n_kv_heads=4,
            n_dense_layers=2,
            n_experts=64,
            n_shared_experts=2,
            expert_hidden=384,
            top_k=6,
            max_seq_len=4096,
            score_func="sigmoid",
            route_scale=2.5,
        ),
        vocab=dict(text_size=32768, visual_size=16384, audio_size=2048, audio_levels=8),
        model=dict(mtp_depth=1, mtp_loss_weight=0.3),
    )
)
register_preset(
    Preset(
        "ernie5-paper",
        "Paper scale (about 1e12 parameters, under 3% active): build on the meta device to count sizes.",
        backbone=dict(
            dim=7168,
            n_layers=64,
            n_heads=64,
            n_kv_heads=8,
            head_dim=128,
            n_dense_layers=3,
            n_experts=512,
            n_shared_experts=1,
            expert_hidden=1536,
            top_k=8,
            max_seq_len=131072,
            score_func="sigmoid",
            route_scale=2.5,
        ),
        vocab=dict(text_size=131072, visual_size=65536, audio_size=4096, audio_levels=8),
        model=dict(mtp_depth=1, mtp_loss_weight=0.1),
        meta_only=True,
    )
)
