"""Next-Frame-and-Scale Prediction (NFSP): the visual embedder and head of the unified model (ERNIE 5.0, 3.2).

An image is a one-frame video; every latent frame is a list of VAR scales, coarse to fine, one group per
scale. With the frozen multi-scale tokenizer's codes `r_1..r_K` of a frame (one shared codebook), the
input of scale k is VAR's teacher-forcing feature: the accumulated, upsampled quantised features of the
scales before k, resized to scale k (`VisualTokenizer.scale_inputs`), projected to the backbone width,
plus a learned scale embedding (scale 0's feature is zero, so its embedding is the start vector). The
outputs at scale k's positions predict scale k's codes in parallel:

    L_NFSP = mean over predicted visual positions of CE(W_head h_i, r_i)

An image or video the model only reads (understanding: image to caption, a user's picture in a chat) is not
teacher-forced: scale k's input is the accumulated features of scales <= k (`VisualTokenizer.scale_readings`),
so its finest scale carries the whole reconstruction; teacher forcing would hide the last scale's codes.

The model owns the tokenizer (frozen, always in eval mode) so that pixels in a batch become codes here,
once per step, and generated codes decode back to pixels without another object to carry around.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.batch import GroupBatch, VisualItem, VisualPayload
from zoo.models.heads import HeadOutput
from zoo.tokenizers.visual import VisualTokenizer


@dataclass
class VisualCodes:
    """Every visual token of a batch in token order (item, frame, scale, row, col).

    tokens: `[Nv]` code ids. features: `[Nv, C]` teacher-forcing inputs (see module docstring).
    """

    tokens: Tensor
    features: Tensor


def flatten_scales(per_scale: list[Tensor]) -> Tensor:
    """Per-scale `[N, T', s, s, *rest]` -> `[N, T' * sum(s^2), *rest]` in (frame, scale, row, col) order."""
    return torch.cat([x.flatten(2, 3) for x in per_scale], dim=2).flatten(1, 2)


def unflatten_scales(flat: Tensor, scales: tuple[int, ...], frames: int) -> list[Tensor]:
    """Inverse of `flatten_scales` for code ids: `[N, T' * sum(s^2)]` -> per scale `[N, T', s, s]`."""
    n = flat.shape[0]
    per_frame = flat.view(n, frames, -1).split([s * s for s in scales], dim=2)
    return [x.reshape(n, frames, s, s) for x, s in zip(per_frame, scales, strict=True)]


class NFSP(nn.Module):
    """Visual embedder + NFSP head around a frozen `VisualTokenizer`.

    Args:
        tokenizer: the trained multi-scale tokenizer (2D, or causal 3D for video); kept frozen.
        dim: backbone width.
        loss_weight: weight of the NFSP loss in the model's total.
    """

    def __init__(self, tokenizer: VisualTokenizer, dim: int, loss_weight: float = 1.0) -> None:
        super().__init__()
        self.tokenizer = tokenizer.requires_grad_(False).eval()
        self.scales = tuple(tokenizer.scales)
        self.proj = nn.Linear(tokenizer.latent_dim, dim, bias=False)
        self.scale_embed = nn.Embedding(len(self.scales), dim)
        self.head = nn.Linear(dim, tokenizer.codebook_size, bias=False)
        self.loss_weight = loss_weight
        for weight in (self.proj.weight, self.scale_embed.weight, self.head.weight):
            nn.init.normal_(weight, std=0.02)

    def train(self, mode: bool = True) -> NFSP:
        super().train(mode)
        self.tokenizer.eval()  # its EMA codebooks must not drift while the backbone trains
        return self

    @property
    def tokens_per_frame(self) -> int:
        return sum(s * s for s in self.scales)

    # -- batch side -------------------------------------------------------------------------------
    def check_layout(self, payload: VisualPayload) -> None:
        scales = tuple(payload.scales)
        if scales != self.scales:
            raise ValueError(
                f"the batch lays out visual scales {scales} but the visual tokenizer has {self.scales}: "
                "set the datamodule's layout.visual_scales to the tokenizer's scales"
            )

    @torch.no_grad()
    def encode(self, payload: VisualPayload) -> VisualCodes:
        """Tokenize a batch's images and videos and lay their tokens out in the batch's token order."""
        self.check_layout(payload)
        items = payload.items.tolist()
        encoded: dict[int, tuple[Tensor, Tensor, Tensor | None]] = {}
        given = ((VisualItem.IMAGE, payload.image_pixels), (VisualItem.VIDEO, payload.video_pixels))
        for kind, pixels in given:
            if pixels is None:
                continue
            if kind == VisualItem.VIDEO and not self.tokenizer.temporal:
                raise ValueError("the batch holds videos but the visual tokenizer is 2D: use a causal 3D one")
            if kind == VisualItem.IMAGE and self.tokenizer.temporal:
                pixels = pixels.unsqueeze(2)  # an image is a one-frame video (never temporally compressed)
            codes = self.tokenizer.encode(pixels)
            read = any(k == kind and whole for k, _, _, _, whole in items)
            encoded[kind] = (
                flatten_scales(codes),
                flatten_scales(self.tokenizer.scale_inputs(codes)),
                flatten_scales(self.tokenizer.scale_readings(codes)) if read else None,
            )
        tokens, features = [], []
        for kind, index, _, frames, whole in items:
            if kind == VisualItem.CODES:  # codes given by the data (pre-tokenized, or generated and fed back)
                flat = payload.codes[index : index + frames * self.tokens_per_frame]
                per_scale = unflatten_scales(flat[None], self.scales, frames)
                inputs = self.tokenizer.scale_readings if whole else self.tokenizer.scale_inputs
                item_tokens = flat
                item_features = flatten_scales(inputs(per_scale))[0]
            else:
                item_codes, teacher_forced, readings = encoded[kind]
                item_tokens = item_codes[index]
                item_features = (readings if whole else teacher_forced)[index]
            if item_tokens.shape[0] != frames * self.tokens_per_frame:
                raise ValueError(
                    f"visual item {index} encodes to {item_tokens.shape[0]} tokens but the batch reserved "
                    f"{frames * self.tokens_per_frame} ({frames} latent frames): check the temporal stride"
                )
            tokens.append(item_tokens)
            features.append(item_features)
        return VisualCodes(torch.cat(tokens), torch.cat(features).to(self.proj.weight.dtype))

    def embed(self, x: Tensor, payload: VisualPayload, codes: VisualCodes) -> Tensor:
        """Write the visual positions of `x` `[B, L, D]` (out of place)."""
        slot = payload.slot
        where = slot >= 0
        values = self.embed_features(codes.features[slot[where]], payload.scale[where])
        return x.masked_scatter(where[..., None], values.to(x.dtype))

    def embed_features(self, features: Tensor, scale: Tensor) -> Tensor:
        """`[..., C]` teacher-forcing features at scale indices `[...]` -> `[..., D]` inputs."""
        return self.proj(features.to(self.proj.weight.dtype)) + self.scale_embed(scale)

    def forward(self, hidden: Tensor, batch: GroupBatch, codes: VisualCodes) -> HeadOutput:
        """Cross-entropy of the codes at the predicted visual positions."""
        target_slot = batch.targets["visual"]
        picked = target_slot >= 0
        if not bool(picked.any()):
            zero = hidden.sum() * 0.0
            return HeadOutput(zero, {"visual/tokens": zero.detach()})
        logits = self.head(hidden[picked]).float()
        targets = codes.tokens[target_slot[picked]]
        ce = F.cross_entropy(logits, targets)
        accuracy = (logits.argmax(-1) == targets).float().mean()
        metrics = {
            "visual/nfsp_loss": ce.detach(),
            "visual/accuracy": accuracy.detach(),
            "visual/tokens": picked.sum().float(),
        }
        return HeadOutput(self.loss_weight * ce, metrics)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.head(hidden)

    @torch.no_grad()
    def decode(self, codes: list[Tensor]) -> Tensor:
        """Codes per scale `[B, T', s, s]` (any prefix of the scales) -> pixels in [-1, 1]: `[B, 3, H, W]`
        for one frame, `[B, 3, T, H, W]` for a video."""
        pixels = self.tokenizer.decode(codes).clamp(-1, 1)
        if pixels.dim() == 5 and pixels.shape[2] == 1:
            pixels = pixels[:, :, 0]
        return pixels
