"""Visual tokenizer: a conv encoder/decoder around a multi-scale residual quantiser, 2D or causal 3D.

ERNIE 5.0 tokenizes images and videos with a causal 3D CNN tokenizer and a multi-scale residual quantiser
so that the unified model predicts next frames and next scales (NFSP). This file holds the conv part:

- 2D (images [B, 3, H, W]): conv3x3 + residual blocks, stride-2 downsampling to the latent grid, the
  quantiser of `visual_quantizer.py` (VAR, one shared codebook), and a mirrored decoder.
- causal 3D (videos [B, 3, T, H, W]), MAGVIT-v2 (Yu et al. 2024, section 3.1) / Open-MAGVIT2: every
  conv is a Conv3d padded with kT-1 zero frames in front and none behind, so frame t sees frames <= t;
  normalisation is per frame (a GroupNorm over time would leak the future). Time is compressed once, at
  the end of the encoder, by a causal conv of kernel and stride `temporal_stride` over the front-padded
  sequence: T = 1 + s*k frames give 1 + k latent frames and the first frame is never compressed
  (it is encoded like an image). The decoder mirrors this with a depth-to-time expansion.
- inflation (`from_2d` / `inflate`): every 2D kernel goes into the LAST temporal slice of a zero 3D kernel
  and the temporal down/upsampling starts as "take the last frame" / "repeat", so an inflated tokenizer
  at initialisation encodes frame s*j exactly as the 2D one encodes it and decodes it to the same pixels.

The quantiser runs per latent frame with the same spatial scales, so codes are [B, T', s, s] per scale
(T' = 1 for an image) and the unified model's NFSP sees a video as frames of scale pyramids.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.publishing.component import PretrainedComponent
from zoo.tokenizers.precision import full_precision
from zoo.tokenizers.visual_quantizer import MultiScaleQuantizer, QuantizerOutput
from zoo.weights import load_weights_file


class CausalConv3d(nn.Conv3d):
    """Conv3d with kT-1 zero frames padded in front and none behind (spatial 'same' padding)."""

    def __init__(self, cin: int, cout: int, kernel: int, kt: int, stride: int = 1) -> None:
        super().__init__(cin, cout, (kt, kernel, kernel), stride=(1, stride, stride), padding=0)
        self.kt, self.spatial_pad = kt, kernel // 2

    def forward(self, x: Tensor) -> Tensor:
        p = self.spatial_pad
        return super().forward(F.pad(x, (p, p, p, p, self.kt - 1, 0)))


def conv(cin: int, cout: int, kernel: int, kt: int | None, stride: int = 1) -> nn.Module:
    """A 2D conv, or its causal 3D counterpart when `kt` (temporal kernel) is given."""
    if kt is None:
        return nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2)
    return CausalConv3d(cin, cout, kernel, kt if kernel > 1 else 1, stride)


def per_frame(fn, x: Tensor) -> Tensor:  # noqa: ANN001 (any [N, C, H, W] -> [N, C', H', W'] callable)
    """Apply a 2D operation to every frame of [B, C, T, H, W] (identity of layout for 4D input)."""
    if x.dim() == 4:
        return fn(x)
    b, _, t = x.shape[:3]
    y = fn(x.transpose(1, 2).flatten(0, 1))
    return y.unflatten(0, (b, t)).transpose(1, 2)


class FrameGroupNorm(nn.GroupNorm):
    """GroupNorm over each frame separately: causal in time and equal to the 2D norm frame by frame."""

    def forward(self, x: Tensor) -> Tensor:
        return per_frame(super().forward, x)


def norm(channels: int) -> nn.Module:
    return FrameGroupNorm(min(8, channels), channels, eps=1e-6)


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, kt: int | None) -> None:
        super().__init__()
        self.norm1, self.conv1 = norm(cin), conv(cin, cout, 3, kt)
        self.norm2, self.conv2 = norm(cout), conv(cout, cout, 3, kt)
        self.skip = conv(cin, cout, 1, kt) if cin != cout else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        return self.skip(x) + self.conv2(F.silu(self.norm2(h)))


class Upsample(nn.Module):
    """Nearest x2 in space (per frame) then a conv."""

    def __init__(self, channels: int, kt: int | None) -> None:
        super().__init__()
        self.conv = conv(channels, channels, 3, kt)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(per_frame(lambda y: F.interpolate(y, scale_factor=2.0, mode="nearest"), x))


class TemporalDownsample(nn.Module):
    """Causal time compression: pad stride-1 frames in front, conv with kernel = stride = `stride` in time.

    Output frame 0 sees only input frame 0; output frame j >= 1 sees frames s(j-1)+1 .. sj. Initialised to
    copy the last frame of each window (identity on the last temporal slice)."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv3d(channels, channels, (stride, 1, 1), stride=(stride, 1, 1))
        with torch.no_grad():
            self.conv.weight.zero_()
            self.conv.weight[:, :, -1, 0, 0] = torch.eye(channels)
            self.conv.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.pad(x, (0, 0, 0, 0, self.stride - 1, 0)))


class TemporalUpsample(nn.Module):
    """The decoder's inverse: each latent frame becomes `stride` frames (depth to time), then the first
    stride-1 frames are dropped so 1 + k latent frames give 1 + s*k frames. Initialised to repeat."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv3d(channels, channels * stride, 1)
        with torch.no_grad():
            self.conv.weight.zero_()
            for i in range(stride):
                self.conv.weight[i * channels : (i + 1) * channels, :, 0, 0, 0] = torch.eye(channels)
            self.conv.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        b, c, t, h, w = x.shape
        y = self.conv(x).reshape(b, self.stride, c, t, h, w).permute(0, 2, 3, 1, 4, 5)
        return y.reshape(b, c, t * self.stride, h, w)[:, :, self.stride - 1 :]


class VisualTokenizer(PretrainedComponent, nn.Module):
    """Images (2D) or videos (causal 3D) to multi-scale codes of one shared codebook, and back.

    Args:
        image_size: side of the square input images / frames.
        channels: conv widths per resolution; each step after the first halves the resolution, so the
            latent grid side is image_size / 2 ** (len(channels) - 1) and must equal the last scale.
        num_res_blocks: residual blocks per resolution in the encoder (and in the decoder).
        quantizer: the multi-scale residual quantiser (its `dim` is the latent dimension).
        temporal: build the causal 3D version (videos [B, 3, T, H, W]); False: 2D images [B, 3, H, W].
        temporal_stride: frames per latent frame after the first (3D only): T = 1 + stride * k.
        temporal_kernel: temporal extent kT of the causal 3x3 convs (3D only).
        weights: a .safetensors file (or folder with model.safetensors) of a trained tokenizer of this
            configuration, loaded at construction.
    """

    hub_title = "Visual tokenizer"
    hub_tags = ("visual-tokenizer", "multi-scale-vq", "var")
    hub_usage = "codes = model.encode(pixels)  # [B, 3, H, W] or [B, 3, T, H, W] in [-1, 1]; decode(codes)"

    def pipeline_tag(self) -> str:
        return "video-to-video" if self.temporal else "image-to-image"

    def card_facts(self) -> list[str]:
        kind = f"causal 3D (temporal stride {self.temporal_stride})" if self.temporal else "2D"
        return [
            f"- kind: {kind}, input {self.image_size} x {self.image_size}, channels {list(self.channels)}",
            f"- codebook: {self.codebook_size} codes of dimension {self.latent_dim}, "
            f"scales {list(self.scales)}",
        ]

    construction_only = ("weights",)

    def __init__(
        self,
        image_size: int = 32,
        channels: tuple[int, ...] = (32, 64, 64),
        num_res_blocks: int = 1,
        quantizer: MultiScaleQuantizer | None = None,
        temporal: bool = False,
        temporal_stride: int = 1,
        temporal_kernel: int = 3,
        weights: str | None = None,
    ) -> None:
        super().__init__()
        quantizer = quantizer if quantizer is not None else MultiScaleQuantizer()
        channels = tuple(int(c) for c in channels)
        factor = 2 ** (len(channels) - 1)
        if not channels or image_size % factor or image_size // factor != quantizer.scales[-1]:
            raise ValueError(
                f"image_size {image_size} / 2**(len(channels)-1) = {image_size / factor:g} must equal the "
                f"last quantiser scale {quantizer.scales[-1]} (channels={channels})"
            )
        if num_res_blocks < 1:
            raise ValueError(f"num_res_blocks must be >= 1, got {num_res_blocks}")
        if temporal_stride < 1 or temporal_kernel < 1:
            raise ValueError(
                f"temporal_stride and temporal_kernel must be >= 1, got {temporal_stride}, {temporal_kernel}"
            )
        if not temporal and temporal_stride != 1:
            raise ValueError("temporal_stride > 1 needs temporal=True (a 2D tokenizer has no time axis)")
        self.image_size, self.channels, self.temporal = image_size, channels, temporal
        self.temporal_stride, self.temporal_kernel = temporal_stride, temporal_kernel
        self.quantizer = quantizer
        self.scales: tuple[int, ...] = quantizer.scales
        self.codebook_size: int = quantizer.codebook_size
        self.latent_dim: int = quantizer.dim
        kt = temporal_kernel if temporal else None
        d = quantizer.dim

        enc: list[nn.Module] = [conv(3, channels[0], 3, kt)]
        for i, c in enumerate(channels):
            cin = channels[i - 1] if i else channels[0]
            for j in range(num_res_blocks):
                enc.append(ResBlock(cin if j == 0 else c, c, kt))
            if i + 1 < len(channels):
                enc.append(conv(c, c, 3, kt, stride=2))
        enc += [
            ResBlock(channels[-1], channels[-1], kt),
            norm(channels[-1]),
            nn.SiLU(),
            conv(channels[-1], d, 3, kt),
        ]
        self.encoder = nn.Sequential(*enc)

        dec: list[nn.Module] = [conv(d, channels[-1], 3, kt), ResBlock(channels[-1], channels[-1], kt)]
        for i in reversed(range(len(channels))):
            c = channels[i]
            cin = channels[i + 1] if i + 1 < len(channels) else c
            for j in range(num_res_blocks):
                dec.append(ResBlock(cin if j == 0 else c, c, kt))
            if i > 0:
                dec.append(Upsample(c, kt))
        dec += [norm(channels[0]), nn.SiLU(), conv(channels[0], 3, 3, kt)]
        self.decoder = nn.Sequential(*dec)

        strided = temporal and temporal_stride > 1
        self.time_down = TemporalDownsample(d, temporal_stride) if strided else nn.Identity()
        self.time_up = TemporalUpsample(d, temporal_stride) if strided else nn.Identity()
        if weights is not None:
            load_weights_file(self, weights, what="VisualTokenizer weights")

    # --- shapes -------------------------------------------------------------------------------------

    def latent_frames(self, frames: int) -> int:
        """T' for T input frames (raises when T does not fit the stride)."""
        s = self.temporal_stride
        if frames < 1 or (frames - 1) % s:
            raise ValueError(
                f"a video of {frames} frames does not fit temporal_stride {s}: expected 1 + {s} * k frames "
                f"(e.g. {1 + s}, {1 + 2 * s}, {1 + 4 * s})"
            )
        return 1 + (frames - 1) // s

    def check_pixels(self, pixels: Tensor) -> None:
        if not isinstance(pixels, Tensor):
            raise TypeError(f"pixels must be a torch.Tensor, got {type(pixels).__name__}")
        if not pixels.is_floating_point():
            raise TypeError(
                f"pixels must be floating point in [-1, 1] (got {pixels.dtype}); "
                "convert uint8 images with zoo.world.render.to_tensor"
            )
        size = self.image_size
        if self.temporal:
            ok = pixels.dim() == 5 and pixels.shape[1] == 3 and pixels.shape[-2:] == (size, size)
            expected = f"a video [B, 3, T, {size}, {size}] (or an image [B, 3, {size}, {size}])"
        else:
            ok = pixels.dim() == 4 and pixels.shape[1] == 3 and pixels.shape[-2:] == (size, size)
            expected = f"images [B, 3, {size}, {size}] (a 2D tokenizer; videos need temporal=True)"
        if not ok:
            raise ValueError(f"pixels must be {expected}, got {list(pixels.shape)}")
        if self.temporal:
            self.latent_frames(pixels.shape[2])

    # --- encoder / decoder --------------------------------------------------------------------------

    def encode_latent(self, pixels: Tensor) -> Tensor:
        """Continuous latents [B, D, h, w] (2D) or [B, D, T', h, w] (3D), before quantisation. A 3D tokenizer
        takes an image [B, 3, H, W] as a one-frame video."""
        if self.temporal and isinstance(pixels, Tensor) and pixels.dim() == 4:
            pixels = pixels.unsqueeze(2)
        self.check_pixels(pixels)
        return self.time_down(self.encoder(pixels))

    def _fold(self, f: Tensor) -> Tensor:
        """[B, D, T', h, w] -> [B*T', D, h, w]; 2D latents are left as they are (T' = 1)."""
        return f.transpose(1, 2).flatten(0, 1) if f.dim() == 5 else f

    @full_precision
    def quantize(self, f: Tensor) -> tuple[Tensor, list[Tensor], Tensor]:
        """(f_hat with straight-through gradient, codes per scale [B, T', s, s], VQ loss) of latents."""
        b = f.shape[0]
        out: QuantizerOutput = self.quantizer(self._fold(f))
        codes = [c.unflatten(0, (b, -1)) for c in out.codes]
        return self._unfold(out.quantized, b), codes, out.vq_loss

    def _unfold(self, f: Tensor, b: int) -> Tensor:
        return f.unflatten(0, (b, -1)).transpose(1, 2) if self.temporal else f

    def decode_latent(self, f_hat: Tensor) -> Tensor:
        return self.decoder(self.time_up(f_hat))

    def forward(self, pixels: Tensor) -> tuple[Tensor, list[Tensor], Tensor]:
        """Training pass: (reconstruction from all scales, codes per scale, VQ loss)."""
        f_hat, codes, vq_loss = self.quantize(self.encode_latent(pixels))
        return self.decode_latent(f_hat), codes, vq_loss

    # --- the public token interface -----------------------------------------------------------------

    @torch.no_grad()
    @full_precision
    def encode(self, pixels: Tensor) -> list[Tensor]:
        """Codes per scale, long [B, T', s, s] (T' = 1 for an image, 1 + (T-1)/stride for a video)."""
        return self.quantize(self.encode_latent(pixels))[1]

    def _check_codes(self, codes: list[Tensor]) -> tuple[int, int]:
        if not isinstance(codes, (list, tuple)) or not codes:
            raise ValueError(
                f"codes must be a non-empty list of per-scale tensors, got {type(codes).__name__}"
            )
        if any(c.dim() != 4 for c in codes):
            raise ValueError(f"codes must be [B, T', s, s] per scale, got {[list(c.shape) for c in codes]}")
        b, t = codes[0].shape[:2]
        if not self.temporal and t != 1:
            raise ValueError(f"a 2D tokenizer decodes one frame per image (T' = 1), got T' = {t}")
        if any(tuple(c.shape[:2]) != (b, t) for c in codes):
            raise ValueError(f"every scale must have the same [B, T'], got {[list(c.shape) for c in codes]}")
        return b, t

    @full_precision
    def features(self, codes: list[Tensor]) -> Tensor:
        """f_hat from a prefix of scales: [B, D, h, w] (2D) or [B, D, T', h, w] (3D)."""
        b, _ = self._check_codes(codes)
        f_hat = self.quantizer.features([c.flatten(0, 1) for c in codes])
        return self._unfold(f_hat, b)

    @torch.no_grad()
    @full_precision
    def decode(self, codes: list[Tensor]) -> Tensor:
        """Pixels from the codes of any prefix of the scales: [B, 3, H, W] (2D) or [B, 3, T, H, W] (3D)."""
        return self.decode_latent(self.features(codes))

    @torch.no_grad()
    @full_precision
    def scale_inputs(self, codes: list[Tensor]) -> list[Tensor]:
        """VAR teacher forcing for the codes of scales 0..m-1: m tensors [B, T', s_k, s_k, latent_dim], entry
        k the accumulated quantised features of scales < k resized to s_k (entry 0 zeros)."""
        b, _ = self._check_codes(codes)
        inputs = self.quantizer.scale_inputs([c.flatten(0, 1) for c in codes])
        return [x.unflatten(0, (b, -1)) for x in inputs]

    @full_precision
    def scale_readings(self, codes: list[Tensor]) -> list[Tensor]:
        """The inputs of an image or video the model reads but does not predict (understanding): entry k the
        accumulated quantised features of scales <= k resized to s_k, shaped as `scale_inputs`."""
        b, _ = self._check_codes(codes)
        readings = self.quantizer.scale_readings([c.flatten(0, 1) for c in codes])
        return [x.unflatten(0, (b, -1)) for x in readings]

    @torch.no_grad()
    @full_precision
    def next_scale_input(self, codes: list[Tensor]) -> Tensor:
        """For generation scale by scale: the input of scale m given the codes of scales 0..m-1 (m < K),
        [B, T', s_m, s_m, latent_dim]; the same as entry m of `scale_inputs` of a longer prefix."""
        b, _ = self._check_codes(codes)
        return self.quantizer.next_scale_input([c.flatten(0, 1) for c in codes]).unflatten(0, (b, -1))

    # --- inflation ----------------------------------------------------------------------------------

    @torch.no_grad()
    def inflate(self, tokenizer_2d: VisualTokenizer) -> VisualTokenizer:
        """Copy a 2D tokenizer's weights into this 3D one: each 2D kernel into the last temporal slice of a
        zero 3D kernel, everything else (norms, biases, quantiser, codebook) as it is. Returns self."""
        if not self.temporal or tokenizer_2d.temporal:
            raise ValueError("inflate copies a 2D tokenizer (temporal=False) into a 3D one (temporal=True)")
        source = tokenizer_2d.state_dict()
        target = self.state_dict()
        extra = set(source) - set(target)
        if extra:
            raise ValueError(f"the 2D tokenizer has weights this 3D one lacks: {sorted(extra)[:5]}")
        for name, value in source.items():
            dest = target[name]
            if dest.shape == value.shape:
                dest.copy_(value)
            elif dest.dim() == 5 and value.dim() == 4 and dest.shape[:2] + dest.shape[3:] == value.shape:
                dest.zero_()
                dest[:, :, -1] = value
            else:
                raise ValueError(
                    f"{name}: cannot inflate {list(value.shape)} into {list(dest.shape)} "
                    "(are the two tokenizers configured alike?)"
                )
        return self

    @classmethod
    def from_2d(
        cls, tokenizer_2d: VisualTokenizer, temporal_stride: int = 1, temporal_kernel: int = 3
    ) -> VisualTokenizer:
        """A causal 3D tokenizer of the same configuration, inflated from `tokenizer_2d`."""
        q = tokenizer_2d.quantizer
        quantizer = MultiScaleQuantizer(**q.init_args)
        model = cls(
            image_size=tokenizer_2d.image_size,
            channels=tokenizer_2d.channels,
            num_res_blocks=tokenizer_2d.init_args["num_res_blocks"],
            quantizer=quantizer,
            temporal=True,
            temporal_stride=temporal_stride,
            temporal_kernel=temporal_kernel,
        )
        return model.inflate(tokenizer_2d)
