"""Dual-path vision encoder for understanding inputs (ERNIE 5.0 report, visual understanding).

ERNIE 5.0 sees an image through two paths: a CNN ("perceptual", local texture and edges) and a ViT
("semantic", global context). Their features are resized to one grid and fused per k x k window by an
attention-based patch merger into context tokens of the backbone's width (DESIGN.md, "Understanding
inputs are context groups"). The merger is a windowed PatchMerger (Renggli et al. 2022): learned queries
attend over the window's CNN and ViT tokens, then a linear layer maps to `out_dim`. The plain 2x2 MLP
merger of Qwen2.5-VL (`x = MLP(norm(x).view(-1, 4C))`) is kept as an ablation (REFERENCES.md 2.5).

Both paths are any timm model named by string, randomly initialised by default; a local weight file
(never a download) can initialise either through timm's own loader, which also adapts a ViT's patch
and position embeddings to the small image size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import timm
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.publishing.component import PretrainedComponent
from zoo.weights import load_weights_file


def _timm_model(name: str, what: str, pretrained: str | None, **overrides: object) -> nn.Module:
    """`timm.create_model(name, **overrides)`, from the local file `pretrained` when given (no download)."""
    if not timm.is_model(name):
        raise ValueError(f"{what}: {name!r} is not a timm model name (see timm.list_models())")
    if pretrained is None:
        return timm.create_model(name, pretrained=False, **overrides)
    path = Path(pretrained)
    if not path.is_file():
        raise FileNotFoundError(
            f"pretrained_{what}: {path} does not exist (expected a local timm weight file, "
            ".safetensors/.pth/.bin, for {name!r}; weights are never downloaded)"
        )
    # `file` in the pretrained cfg makes timm load from disk; its filter functions resample a ViT's
    # position and patch embeddings to the overridden img_size / patch_size and drop a mismatched head.
    return timm.create_model(name, pretrained=True, pretrained_cfg_overlay={"file": str(path)}, **overrides)


def _resize(features: Tensor, side: int) -> Tensor:
    """[B, C, h, w] -> [B, C, side, side]: area pooling to shrink (no aliasing), bilinear to grow."""
    h, w = features.shape[-2:]
    if (h, w) == (side, side):
        return features
    if h >= side and w >= side:
        return F.adaptive_avg_pool2d(features, side)
    return F.interpolate(features, size=(side, side), mode="bilinear", align_corners=False)


def _windows(features: Tensor, window: int) -> Tensor:
    """[B, C, S, S] -> [B, R*R, window*window, C]: each window's cells in row-major order, windows too."""
    b, c, s, _ = features.shape
    r = s // window
    x = features.view(b, c, r, window, r, window).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(b, r * r, window * window, c)


class AttentionMerger(nn.Module):
    """Windowed PatchMerger: `queries` learned queries per window attend over the window's tokens.

    Tokens carry a learned embedding of their path (CNN / ViT) and of their cell inside the window, so
    a query can pick "the ViT token at the top left" as well as "whatever is brightest".
    """

    def __init__(
        self, in_dims: tuple[int, ...], dim: int, heads: int, window: int, queries: int, out_dim: int
    ) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"merger_dim ({dim}) must be divisible by merger_heads ({heads})")
        self.inputs = nn.ModuleList(nn.Linear(c, dim) for c in in_dims)
        self.path_embed = nn.Parameter(torch.zeros(len(in_dims), 1, dim))
        self.cell_embed = nn.Parameter(torch.zeros(window * window, dim))
        self.queries = nn.Parameter(torch.randn(queries, dim) * dim**-0.5)
        self.norm_kv = nn.LayerNorm(dim)
        self.norm_q = nn.LayerNorm(dim)
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm_mlp = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.out = nn.Linear(queries * dim, out_dim)
        nn.init.normal_(self.path_embed, std=0.02)
        nn.init.normal_(self.cell_embed, std=0.02)

    def forward(self, paths: list[Tensor]) -> Tensor:
        """paths: per path [B, W, window*window, C_path] -> [B, W, out_dim]."""
        b, w = paths[0].shape[:2]
        embedded = [
            proj(x) + self.cell_embed + pe
            for proj, x, pe in zip(self.inputs, paths, self.path_embed, strict=True)
        ]
        # [B*W, P*window^2, dim]: each window is its own attention problem.
        tokens = torch.cat(embedded, dim=2).flatten(0, 1)
        q = self.queries.expand(b * w, -1, -1)
        kv = self.norm_kv(tokens)
        q = q + self.attention(self.norm_q(q), kv, kv, need_weights=False)[0]
        q = q + self.mlp(self.norm_mlp(q))
        return self.out(q.reshape(b, w, -1))


class MlpMerger(nn.Module):
    """Qwen2.5-VL's merger on the concatenated paths: MLP(LayerNorm(x).view(-1, window^2 * C))."""

    def __init__(self, in_dims: tuple[int, ...], window: int, out_dim: int) -> None:
        super().__init__()
        channels = sum(in_dims)
        self.norm = nn.LayerNorm(channels)
        hidden = window * window * channels
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, out_dim))

    def forward(self, paths: list[Tensor]) -> Tensor:
        x = self.norm(torch.cat(paths, dim=-1))  # [B, W, window^2, sum C]
        return self.mlp(x.flatten(2))


class DualPathEncoder(PretrainedComponent, nn.Module):
    """CNN + ViT image encoder whose output is `grid` context tokens of width `out_dim` per image.

    Args:
        out_dim: width of the output tokens (the backbone's `dim`).
        image_size: side of the square input images, in pixels.
        cnn: timm model name of the CNN path (built with `features_only=True`); None disables the path.
        cnn_out_index: which feature stage of the CNN is used (timm `out_indices`); e.g. for resnet10t on
            32x32 images, 1 is 64 channels at 8x8 and 2 is 128 channels at 4x4.
        vit: timm model name of the ViT path (its `forward_features` tokens, prefix tokens dropped);
            None disables the path. At least one of `cnn` and `vit` must be set.
        vit_patch_size: patch size given to the ViT (timm resamples the patch embedding).
        vit_depth: number of ViT blocks (None: the named model's own).
        vit_dim: ViT width (None: the named model's own).
        vit_heads: ViT attention heads (None: the named model's own).
        grid_size: side of the common grid both paths are resized to; a multiple of `window`.
        window: merger window side; the encoder emits (grid_size / window)^2 tokens.
        merger: "attention" (learned queries over the window's CNN and ViT tokens) or "mlp" (the plain
            Qwen2.5-VL merger over the concatenated window, the ablation).
        merger_dim: width of the attention merger.
        merger_heads: heads of the attention merger.
        merger_queries: learned queries per window; their outputs are concatenated before projection.
        pretrained_cnn: local timm weight file for the CNN (random init when None; never downloaded).
        pretrained_vit: local timm weight file for the ViT (random init when None; never downloaded).
        weights: a safetensors file (or folder with model.safetensors) of this whole encoder, e.g. the
            one `zoo.tasks.vision_encoder` writes; loaded at the end of construction.
    """

    hub_title = "Vision encoder"
    hub_tags = ("vision-encoder", "dual-path")
    hub_usage = "tokens = model(pixels)  # [B, 3, S, S] in [-1, 1] -> [B, model.num_tokens, model.out_dim]"
    hub_pipeline_tag = "image-feature-extraction"

    def card_facts(self) -> list[str]:
        args = self.init_args
        return [
            f"- paths: CNN {args['cnn']}, ViT {args['vit']}; {args['merger']} merger",
            f"- input {self.image_size} x {self.image_size}; "
            f"{self.num_tokens} tokens of width {self.out_dim}",
        ]

    construction_only = ("weights", "pretrained_cnn", "pretrained_vit")

    def __init__(
        self,
        out_dim: int = 128,
        image_size: int = 32,
        cnn: str | None = "resnet10t",
        cnn_out_index: int = 1,
        vit: str | None = "vit_tiny_patch16_224",
        vit_patch_size: int = 4,
        vit_depth: int | None = 4,
        vit_dim: int | None = 96,
        vit_heads: int | None = 3,
        grid_size: int = 8,
        window: int = 2,
        merger: Literal["attention", "mlp"] = "attention",
        merger_dim: int = 128,
        merger_heads: int = 4,
        merger_queries: int = 1,
        pretrained_cnn: str | None = None,
        pretrained_vit: str | None = None,
        weights: str | None = None,
    ) -> None:
        super().__init__()
        if cnn is None and vit is None:
            raise ValueError("DualPathEncoder needs at least one path: set `cnn`, `vit` or both")
        for name, value in (
            ("out_dim", out_dim),
            ("image_size", image_size),
            ("grid_size", grid_size),
            ("window", window),
            ("merger_queries", merger_queries),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if grid_size % window:
            raise ValueError(f"grid_size ({grid_size}) must be a multiple of window ({window})")
        if merger not in ("attention", "mlp"):
            raise ValueError(f"merger must be 'attention' or 'mlp', got {merger!r}")
        self.out_dim, self.image_size = out_dim, image_size
        self.grid_size, self.window = grid_size, window
        in_dims: list[int] = []
        self.cnn_path: nn.Module | None = None
        if cnn is not None:
            self.cnn_path = _timm_model(
                cnn, "cnn", pretrained_cnn, features_only=True, out_indices=(cnn_out_index,)
            )
            in_dims.append(self.cnn_path.feature_info.channels()[-1])
        self.vit_path: nn.Module | None = None
        if vit is not None:
            overrides = dict(
                img_size=image_size,
                patch_size=vit_patch_size,
                depth=vit_depth,
                embed_dim=vit_dim,
                num_heads=vit_heads,
                num_classes=0,
            )
            # timm prunes None-valued overrides, so None keeps the named model's own setting.
            self.vit_path = _timm_model(vit, "vit", pretrained_vit, **overrides)
            in_dims.append(self.vit_path.num_features)
        self.in_dims = tuple(in_dims)
        if merger == "attention":
            self.patch_merger: nn.Module = AttentionMerger(
                self.in_dims, merger_dim, merger_heads, window, merger_queries, out_dim
            )
        else:
            self.patch_merger = MlpMerger(self.in_dims, window, out_dim)
        if weights is not None:
            load_weights_file(self, weights, what="DualPathEncoder weights")

    @property
    def grid(self) -> tuple[int, int]:
        """(rows, cols) of the output tokens, which are in row-major order."""
        side = self.grid_size // self.window
        return (side, side)

    @property
    def num_tokens(self) -> int:
        rows, cols = self.grid
        return rows * cols

    def check_pixels(self, pixels: Tensor) -> None:
        """Refuse anything but float [B, 3, image_size, image_size]."""
        expected = f"float pixels [B, 3, {self.image_size}, {self.image_size}] in [-1, 1]"
        if not isinstance(pixels, Tensor):
            raise TypeError(f"DualPathEncoder expects {expected}, got {type(pixels).__name__}")
        if not pixels.is_floating_point():
            raise TypeError(f"DualPathEncoder expects {expected}, got dtype {pixels.dtype}")
        side = self.image_size
        if pixels.dim() != 4 or pixels.shape[1] != 3 or tuple(pixels.shape[2:]) != (side, side):
            raise ValueError(f"DualPathEncoder expects {expected}, got shape {list(pixels.shape)}")

    def _vit_features(self, pixels: Tensor) -> Tensor:
        x = self.vit_path.forward_features(pixels)
        if x.dim() == 4:  # a hierarchical model (e.g. Swin) already gives a map; timm's Swin is NHWC
            return x if getattr(self.vit_path, "output_fmt", "NCHW") == "NCHW" else x.permute(0, 3, 1, 2)
        x = x[:, getattr(self.vit_path, "num_prefix_tokens", 0) :]
        side = int(round(x.shape[1] ** 0.5))
        if side * side != x.shape[1]:
            raise ValueError(f"the ViT path gave {x.shape[1]} patch tokens, not a square grid")
        return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], side, side)

    def path_features(self, pixels: Tensor) -> list[Tensor]:
        """Per enabled path (CNN first), features on the common grid: [B, C_path, grid_size, grid_size]."""
        self.check_pixels(pixels)
        maps = []
        if self.cnn_path is not None:
            maps.append(_resize(self.cnn_path(pixels)[-1], self.grid_size))
        if self.vit_path is not None:
            maps.append(_resize(self._vit_features(pixels), self.grid_size))
        return maps

    def forward(self, pixels: Tensor) -> Tensor:
        """pixels [B, 3, H, W] in [-1, 1] -> context tokens [B, N, out_dim], N = rows * cols of `grid`."""
        paths = [_windows(m, self.window) for m in self.path_features(pixels)]
        return self.patch_merger(paths)
