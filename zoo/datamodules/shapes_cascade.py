"""ShapesWorld pairs for the refiner cascade (issue 3 item 5): each scene rendered at the target resolution
and natively at the tokenizer's resolution, so the refiner trains on decodes of what the unified model's codes
describe (docs/refiner.md)."""

from __future__ import annotations

from dataclasses import dataclass

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from zoo.world.scenes import SPLITS, ShapesWorld


@dataclass(frozen=True)
class _CascadeRender:
    """Picklable renderer of one scene at both resolutions (for dataloader workers)."""

    world: ShapesWorld
    size: int
    condition_size: int
    split: str
    n: int

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Tensor | int]:
        from zoo.world.render import render_image, to_tensor

        scene = self.world.scene(index, self.split)
        return {
            "pixels": to_tensor(render_image(scene, self.size)),
            "condition_pixels": to_tensor(render_image(scene, self.condition_size)),
            "index": index,
        }


class ShapesCascadeDataModule(L.LightningDataModule):
    """ShapesWorld images at `size` ("pixels", the refiner's target) together with the same scene rendered
    natively at `condition_size` ("condition_pixels", what the degradation sees instead of a down-sampled
    target).

    Why: ShapesWorld draws hard-edged shapes, so an area-downsampled 64x64 render is a soft-edged image that
    the 32x32 tokenizer never saw in training (it reconstructs such images at ~24 dB instead of ~35 dB);
    the codes that the unified model learns and generates are those of native 32x32 renders. Training the
    refiner on decodes of native renders is training it on what it will refine.

    Args:
        size: side of the target images.
        condition_size: side of the native low-resolution render given to the degradation.
        train_size: training scenes per epoch ("train" split, shuffled per epoch).
        val_size: validation scenes ("val" split).
        batch_size: images per batch.
        seed: ShapesWorld seed (same scenes as `ShapesMediaDataModule` with this seed) and shuffling seed.
        num_workers: dataloader workers.
    """

    def __init__(
        self,
        size: int = 64,
        condition_size: int = 32,
        train_size: int = 8192,
        val_size: int = 256,
        batch_size: int = 16,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if condition_size > size:
            raise ValueError(
                f"ShapesCascadeDataModule: condition_size={condition_size} must be <= size={size} "
                "(the condition is the low-resolution render)"
            )
        for name, value in (("train_size", train_size), ("val_size", val_size), ("batch_size", batch_size)):
            if value < 1:
                raise ValueError(f"ShapesCascadeDataModule: {name} must be >= 1, got {value}")
        self.size, self.condition_size = size, condition_size
        self.train_size, self.val_size, self.batch_size = train_size, val_size, batch_size
        self.seed, self.num_workers = seed, num_workers
        self.world = ShapesWorld(seed=seed)

    def dataset(self, split: str) -> Dataset:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        n = self.train_size if split == "train" else self.val_size
        return _CascadeRender(self.world, self.size, self.condition_size, split, n)

    def _loader(self, split: str) -> DataLoader:
        shuffle = split == "train"
        return DataLoader(
            self.dataset(split),
            batch_size=self.batch_size,
            shuffle=shuffle,
            generator=torch.Generator().manual_seed(self.seed) if shuffle else None,
            num_workers=self.num_workers,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        """`val_size` scenes of ShapesWorld's test split (held-out colour-shape pairs)."""
        return self._loader("test")


# --- the task ----------------------------------------------------------------------------------------
