"""Multi-scale residual quantiser with one shared codebook (VAR, Tian et al. 2024, section 3.2 / `quant.py`).

A latent map f [N, D, h, w] is quantised coarse to fine: for each scale side s (e.g. 1, 2, 4, 8)

    r_s   = area-downsample(f - f_hat) to s x s          # what the coarser scales left over
    z_s   = nearest codebook entry of each vector of r_s   (ONE codebook for every scale)
    f_hat = f_hat + phi_s(upsample(z_s) to h x w)          # phi: 0.5 x + 0.5 conv3x3(x), VAR's quant_resi

so any prefix of scales decodes to a coarser image, and the codes of scale k are what an autoregressive
model predicts from the accumulated features of scales < k (`scale_inputs`, VAR's `idxBl_to_var_input`).

The codebook is vector-quantize-pytorch's EMA `Codebook` (k-means-style data init, dead-code expiry). It
is updated ONCE per training step from the vectors of all scales together rather than once per scale as
its `HierarchicalVQ` does: the 1x1 scale alone has only B vectors, far fewer than codes, so per-scale
updates (and a k-means init on the first, 1x1, call) collapse the shared codebook onto a few entries.
Gradients follow VAR: the encoder gets the decoder's gradient straight through (f + (f_hat - f).detach()),
phi is trained by the per-scale VQ loss, the codebook by EMA only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from vector_quantize_pytorch.vector_quantize_pytorch import Codebook, kmeans

from zoo.config import Configurable


@dataclass
class QuantizerOutput:
    """What one quantiser pass returns.

    quantized: f_hat with the straight-through gradient to f, [N, D, h, w].
    codes: per scale long codes [N, s, s].
    vq_loss: VAR's loss, averaged over scales: |f_hat - f.detach()|^2 after each scale (trains phi) plus the
        commitment beta * |f_hat.detach() - f|^2 after the last scale (or after each, `commitment`).
    """

    quantized: Tensor
    codes: list[Tensor]
    vq_loss: Tensor


class Phi(nn.Module):
    """VAR's residual refinement of an upsampled scale: (1 - ratio) x + ratio conv3x3(x)."""

    def __init__(self, dim: int, ratio: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(dim, dim, 3, padding=1)
        self.ratio = ratio

    def forward(self, x: Tensor) -> Tensor:
        return x.lerp(self.conv(x), self.ratio)


class MultiScaleQuantizer(Configurable, nn.Module):
    """VAR-style multi-scale residual vector quantiser over one shared EMA codebook.

    Args:
        dim: channels D of the latent map (and of every code vector).
        codebook_size: entries of the one codebook shared by all scales.
        scales: side of each scale, strictly increasing; the last is the latent grid side.
        beta: weight of the commitment term of the VQ loss (VAR: 0.25).
        decay: EMA decay of the codebook statistics.
        threshold_ema_dead_code: an entry whose EMA hit count falls below this is replaced by a random
            vector of the current batch (dead-code expiry; 0 turns it off).
        kmeans_init: initialise the codebook by k-means on the first training batch's vectors of all
            scales (otherwise from random batch vectors through dead-code expiry).
        kmeans_iters: k-means iterations of that initialisation.
        phi_ratio: VAR's quant_resi, how much of the 3x3 conv refinement is mixed in (0: no phi).
        num_phi: distinct phi convs, shared by nearest "tick" across the scales (VAR uses 4).
        upsample: how a scale's codes are resized to the latent grid.
        commitment: "final" commits the encoder to the quantised latent of all scales only; "every_scale"
            (VAR's code) also to the coarse partial sums, which pulls f towards a blurred map: at the tiny
            ShapesWorld preset it ended 2.0 dB lower (20.6 vs 22.6 dB, docs/visual_tokenizer.md).
    """

    def __init__(
        self,
        dim: int = 16,
        codebook_size: int = 1024,
        scales: tuple[int, ...] = (1, 2, 4, 8),
        beta: float = 0.25,
        decay: float = 0.95,
        threshold_ema_dead_code: float = 1.0,
        kmeans_init: bool = True,
        kmeans_iters: int = 10,
        phi_ratio: float = 0.5,
        num_phi: int = 4,
        upsample: Literal["bicubic", "bilinear", "nearest"] = "bicubic",
        commitment: Literal["final", "every_scale"] = "final",
    ) -> None:
        super().__init__()
        scales = tuple(int(s) for s in scales)
        if (
            not scales
            or any(s < 1 for s in scales)
            or any(a >= b for a, b in zip(scales, scales[1:], strict=False))
        ):
            raise ValueError(f"scales must be positive and strictly increasing, got {scales}")
        if codebook_size < 2 or dim < 1:
            raise ValueError(f"need codebook_size >= 2 and dim >= 1, got {codebook_size} and {dim}")
        if not 0.0 <= phi_ratio <= 1.0:
            raise ValueError(f"phi_ratio must be in [0, 1], got {phi_ratio}")
        self.dim, self.codebook_size, self.scales = dim, codebook_size, scales
        self.beta, self.kmeans_iters, self.upsample = beta, kmeans_iters, upsample
        if commitment not in ("final", "every_scale"):
            raise ValueError(f"commitment must be 'final' or 'every_scale', got {commitment!r}")
        self.commitment = commitment
        # kmeans_init=False here: the library would initialise on the first call, i.e. from the 1x1 scale.
        self.codebook = Codebook(
            dim=dim,
            codebook_size=codebook_size,
            kmeans_init=False,
            decay=decay,
            threshold_ema_dead_code=threshold_ema_dead_code,
        )
        self.register_buffer("initted", torch.tensor(not kmeans_init))
        self.phis = nn.ModuleList(
            [Phi(dim, phi_ratio) for _ in range(max(1, num_phi))] if phi_ratio > 0 else []
        )

    @property
    def embedding(self) -> Tensor:
        """The codebook, [codebook_size, D]."""
        return self.codebook.embed[0]

    def _phi(self, k: int, x: Tensor) -> Tensor:
        if not self.phis:
            return x
        # VAR's shared phi: the conv whose tick (evenly spaced in [0, 1]) is nearest to k / (K - 1).
        tick = k / max(len(self.scales) - 1, 1)
        return self.phis[round(tick * (len(self.phis) - 1))](x)

    def _up(self, k: int, z: Tensor, size: int) -> Tensor:
        """Scale k's code vectors [N, D, s, s] on the latent grid, refined by phi."""
        if z.shape[-1] != size:
            align = None if self.upsample == "nearest" else False
            z = F.interpolate(z, size=(size, size), mode=self.upsample, align_corners=align)
        return self._phi(k, z)

    def lookup(self, codes: Tensor) -> Tensor:
        """Code vectors of long codes [N, s, s] as [N, D, s, s]."""
        if codes.dtype != torch.long:
            raise TypeError(f"codes must be torch.long, got {codes.dtype}")
        if codes.numel() and (codes.min() < 0 or codes.max() >= self.codebook_size):
            raise ValueError(f"codes must lie in [0, {self.codebook_size}), got {codes.min()}..{codes.max()}")
        return F.embedding(codes, self.embedding).permute(0, 3, 1, 2)

    def _check_latent(self, f: Tensor) -> None:
        if f.dim() != 4 or f.shape[1] != self.dim or f.shape[-1] != f.shape[-2] != self.scales[-1]:
            expected = f"[N, {self.dim}, {self.scales[-1]}, {self.scales[-1]}]"
            raise ValueError(f"latent map must be {expected}, got {list(f.shape)}")

    @torch.no_grad()
    def _kmeans_init(self, f: Tensor) -> None:
        """k-means over the residual vectors of every scale, the codebook being all zeros meanwhile."""
        size, rest, samples = f.shape[-1], f.detach().float(), []
        for k, s in enumerate(self.scales):
            r = F.interpolate(rest, size=(s, s), mode="area")
            samples.append(r.permute(0, 2, 3, 1).reshape(-1, self.dim))
            rest = rest - self._up(k, r, size)
        data = torch.cat(samples)[None]
        embed, bins = kmeans(data, self.codebook_size, self.kmeans_iters)
        cb = self.codebook
        cb.embed.copy_(embed)
        cb.embed_avg.copy_(embed * bins[..., None])
        cb.cluster_size.copy_(bins.float())
        self.initted.fill_(True)

    def forward(self, f: Tensor) -> QuantizerOutput:
        """Quantise f [N, D, h, w] scale by scale (codebook EMA / expiry updated once when training)."""
        self._check_latent(f)
        if self.training and not bool(self.initted):
            self._kmeans_init(f)
        size = f.shape[-1]
        f_detached = f.detach().float()
        rest = f_detached.clone()
        f_hat = torch.zeros_like(f_detached)
        codes, vectors, loss = [], [], f.new_zeros(())
        for k, s in enumerate(self.scales):
            r = F.interpolate(rest, size=(s, s), mode="area")
            flat = r.permute(0, 2, 3, 1).reshape(1, -1, self.dim)
            _, index, _ = self.codebook(flat, update_usage=False)
            index = index.reshape(r.shape[0], s, s)
            h = self._up(k, self.lookup(index), size)
            f_hat = f_hat + h
            rest = rest - h.detach()
            loss = loss + F.mse_loss(f_hat, f_detached)  # trains phi (the codebook follows by EMA)
            if self.commitment == "every_scale" or k == len(self.scales) - 1:
                loss = loss + self.beta * F.mse_loss(f_hat.detach(), f)
            codes.append(index)
            vectors.append((flat[0], index.reshape(-1)))
        if self.training:
            # One EMA step and one dead-code expiry over all scales' vectors (see the module docstring).
            flat = torch.cat([v for v, _ in vectors])
            index = torch.cat([i for _, i in vectors])
            self.codebook.update_indices(flat[None], index[None])
        quantized = f + (f_hat - f).detach()
        return QuantizerOutput(quantized, codes, loss / len(self.scales))

    def features(self, codes: list[Tensor]) -> Tensor:
        """f_hat [N, D, h, w] from the codes of a prefix of the scales (zeros-free: prefix length >= 1)."""
        self.check_codes(codes)
        size = self.scales[-1]
        f_hat = None
        for k, index in enumerate(codes):
            h = self._up(k, self.lookup(index), size)
            f_hat = h if f_hat is None else f_hat + h
        return f_hat

    def scale_inputs(self, codes: list[Tensor]) -> list[Tensor]:
        """VAR teacher forcing: entry k is f_hat of scales < k, area-resized to s_k x s_k, as [N, s_k, s_k, D]
        (entry 0 is zeros). The codes of the last given scale are not needed and not used."""
        self.check_codes(codes)
        size, n = self.scales[-1], codes[0].shape[0]
        f_hat = self.embedding.new_zeros(n, self.dim, size, size)
        inputs = []
        for k in range(len(codes)):
            s = self.scales[k]
            inputs.append(F.interpolate(f_hat, size=(s, s), mode="area").permute(0, 2, 3, 1))
            if k + 1 < len(codes):
                f_hat = f_hat + self._up(k, self.lookup(codes[k]), size)
        return inputs

    def scale_readings(self, codes: list[Tensor]) -> list[Tensor]:
        """Understanding: entry k is f_hat of scales <= k, area-resized to s_k x s_k, as [N, s_k, s_k, D].

        An image the model only reads (no code of it is predicted) needs no teacher forcing: each scale's
        positions carry what the image looks like through that scale, so the finest scale holds the whole
        reconstruction. `scale_inputs` never uses the last scale's codes, which would hide every detail
        finer than the second-to-last scale from a caption written about the image."""
        self.check_codes(codes)
        size = self.scales[-1]
        f_hat = self.embedding.new_zeros(codes[0].shape[0], self.dim, size, size)
        readings = []
        for k, index in enumerate(codes):
            f_hat = f_hat + self._up(k, self.lookup(index), size)
            s = self.scales[k]
            readings.append(F.interpolate(f_hat, size=(s, s), mode="area").permute(0, 2, 3, 1))
        return readings

    def next_scale_input(self, codes: list[Tensor]) -> Tensor:
        """Generation: f_hat of the m given scales area-resized to scale m, [N, s_m, s_m, D] (VAR's
        `get_next_autoregressive_input`); equals `scale_inputs` entry m of any longer prefix."""
        self.check_codes(codes)
        if len(codes) >= len(self.scales):
            raise ValueError(f"all {len(self.scales)} scales are given: there is no next scale")
        s = self.scales[len(codes)]
        return F.interpolate(self.features(codes), size=(s, s), mode="area").permute(0, 2, 3, 1)

    def check_codes(self, codes: list[Tensor]) -> None:
        if not isinstance(codes, (list, tuple)) or not 1 <= len(codes) <= len(self.scales):
            got = len(codes) if isinstance(codes, (list, tuple)) else type(codes).__name__
            raise ValueError(f"codes must be a list of 1..{len(self.scales)} scales (a prefix), got {got}")
        n = codes[0].shape[0]
        for k, index in enumerate(codes):
            s = self.scales[k]
            if index.dim() != 3 or tuple(index.shape[1:]) != (s, s) or index.shape[0] != n:
                raise ValueError(f"codes of scale {k} must be [{n}, {s}, {s}], got {list(index.shape)}")


def usage_statistics(codes: Tensor, codebook_size: int) -> tuple[float, float]:
    """(fraction of the codebook used, perplexity) of a tensor of codes."""
    counts = torch.bincount(codes.reshape(-1), minlength=codebook_size).float()
    p = counts / counts.sum().clamp_min(1)
    entropy = -(p * p.clamp_min(1e-12).log()).sum()
    return float((counts > 0).float().mean()), float(math.exp(float(entropy)))
