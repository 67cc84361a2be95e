"""Generated visual codes to pixels: the visual tokenizer's decode, then, optionally, the diffusion refiner.

ERNIE 5.0 sharpens what its tokenizer decodes with a diffusion refiner (docs/refiner.md). `decode_visual` is
the one place where that happens, so that every consumer of generated images gets the same pixels:
generation through `zoo.pipeline`, `zoo predict` and the gallery (`zoo.tasks.multimodal_eval`), and
`benchmarks/refined_generation.py`.

    codes --nfsp.decode--> decode [B, 3, h, w] --ImageRefinement.refine--> refined [B, 3, H, W] (H >= h)

`RefinerSettings` is the YAML spelling (a folder or Hub id, steps, seed), loaded into an `ImageRefinement`:
the refiner in eval mode, run without gradients, its noise drawn from a generator seeded at every call, so
that the same codes always refine to the same pixels whatever ran before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from zoo.models.decodable import DecodingModel
    from zoo.models.refiner import DiffusionRefiner

# `zoo.models.refiner` (and so diffusers) is imported only when a refiner is used: the tasks, the pipeline and
# the gallery import this module, and a run without a refiner should not pay for diffusers' import.


class ImageRefinement:
    """A `DiffusionRefiner` applied to decoded generations: eval mode, no gradients, seeded.

    Args:
        refiner: the trained refiner (`DiffusionRefiner.from_pretrained(folder)`, or built with `weights=`).
        steps: sampling steps per refinement (None: the refiner's `num_inference_steps`).
        seed: seeds the refiner's noise afresh at every `refine` call.
    """

    def __init__(self, refiner: DiffusionRefiner, steps: int | None = None, seed: int = 0) -> None:
        from zoo.models.refiner import DiffusionRefiner

        if not isinstance(refiner, DiffusionRefiner):
            raise TypeError(f"ImageRefinement needs a DiffusionRefiner, got {type(refiner).__name__}")
        limit = refiner.noise_scheduler.config.num_train_timesteps
        if steps is not None and not 1 <= steps <= limit:
            raise ValueError(f"ImageRefinement: steps={steps} must be in 1..{limit} (its training timesteps)")
        self.refiner = refiner.eval()
        self.steps, self.seed = steps, seed

    @property
    def size(self) -> int:
        """The side of the refined images."""
        return self.refiner.image_size

    def check_fits(self, decoded_size: int) -> None:
        """Refuse a refiner not trained on decodes of this side (the visual tokenizer's image size)."""
        wanted = self.refiner.condition_size
        if wanted is not None and wanted != decoded_size:
            raise ValueError(
                f"the refiner refines {wanted}x{wanted} decodes (its condition_size) but the visual "
                f"tokenizer decodes {decoded_size}x{decoded_size} images: give a refiner trained on this "
                "tokenizer's decodes"
            )
        if decoded_size > self.size:
            raise ValueError(
                f"the refiner outputs {self.size}x{self.size} images, smaller than the visual tokenizer's "
                f"{decoded_size}x{decoded_size} decodes: give a refiner whose image_size is at least "
                f"{decoded_size}"
            )

    @torch.no_grad()
    def refine(self, pixels: Tensor) -> Tensor:
        """Images `[B, 3, h, w]` or videos `[B, 3, T, h, w]` in [-1, 1] -> the same at `size` x `size`.

        A video is refined frame by frame (the refiner is an image model), each frame with its own noise."""
        if pixels.dim() not in (4, 5) or pixels.shape[1] != 3:
            raise ValueError(
                f"ImageRefinement.refine: expected decoded images [B, 3, h, w] or videos [B, 3, T, h, w], "
                f"got {tuple(pixels.shape)}"
            )
        self.check_fits(pixels.shape[-1])
        refiner = self.refiner.to(pixels.device).eval()
        # A CPU generator (DiffusionRefiner.refine moves the noise): a seed means the same on every device.
        generator = torch.Generator().manual_seed(self.seed)
        if pixels.dim() == 4:
            return refiner.refine(pixels.float(), self.steps, generator)
        b, _, t, h, w = pixels.shape
        frames = pixels.float().permute(0, 2, 1, 3, 4).reshape(b * t, 3, h, w)
        refined = refiner.refine(frames, self.steps, generator)
        return refined.reshape(b, t, 3, self.size, self.size).permute(0, 2, 1, 3, 4)


@dataclass(frozen=True)
class RefinerSettings:
    """Which refiner sharpens generated images, as configuration (`sampling.refiner`, `MultimodalGallery`).

    source: a folder written by `DiffusionRefiner.save_pretrained` (the refiner's fit writes
        `<default_root_dir>/diffusion_refiner/` beside `diffusion_refiner.safetensors`) or a Hub repo id.
    steps: sampling steps (None: the refiner's `num_inference_steps`).
    seed: the refiner's noise seed.
    """

    source: str
    steps: int | None = None
    seed: int = 0

    def load(self, device: str | torch.device = "cpu") -> ImageRefinement:
        """The refiner of `source` (rebuilt through the allow-list, weights loaded strictly)."""
        from zoo.models.refiner import DiffusionRefiner

        refiner = DiffusionRefiner.from_pretrained(self.source, device=device)
        return ImageRefinement(refiner, self.steps, self.seed)


def decode_visual(
    model: DecodingModel, codes: list[Tensor], refinement: ImageRefinement | None = None
) -> Tensor:
    """Pixels of generated codes (per scale `[B, frames, s, s]`): the tokenizer's decode, `[B, 3, h, w]` for
    an image or `[B, 3, T, h, w]` for a video, refined to `refinement.size` when a refinement is given."""
    nfsp = model.nfsp
    if nfsp is None:
        raise ValueError("this model has no visual tokenizer: it cannot decode visual codes")
    if refinement is not None:  # before decoding: a mismatched refiner is refused without wasted work
        refinement.check_fits(nfsp.tokenizer.image_size)
    pixels = nfsp.decode(codes)
    return pixels if refinement is None else refinement.refine(pixels)
