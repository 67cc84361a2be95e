"""Media datamodules for the tokenizer, encoder and refiner stages (DESIGN.md, "Training stages" 1).

`ShapesMediaDataModule` renders ShapesWorld scenes on the fly as images, videos or spoken captions;
`ManifestMediaDataModule` reads real files listed in jsonl manifests. Both yield dicts of tensors:
{"pixels": [B, 3, H, W] or [B, 3, T, H, W] in [-1, 1]} or {"audio": [B, N] zero-padded, "audio_lengths":
[B]}, plus "index": [B] (the scene index, or the manifest line). They know media and batching, never model
internals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from zoo.world.scenes import SPLITS, Scene, ShapesWorld, stable_seed

Kind = Literal["image", "video", "speech"]


def collate_media(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack pixels; zero-pad audio to the longest clip and record the true lengths; list texts."""
    batch: dict[str, Any] = {"index": torch.tensor([int(it["index"]) for it in items], dtype=torch.long)}
    if "pixels" in items[0]:
        shapes = {tuple(it["pixels"].shape) for it in items}
        if len(shapes) > 1:
            raise ValueError(
                f"cannot batch pixels of different shapes {sorted(shapes)}; set `size` (and `frames`)"
            )
        batch["pixels"] = torch.stack([it["pixels"] for it in items])
    if "audio" in items[0]:
        lengths = torch.tensor([it["audio"].shape[0] for it in items], dtype=torch.long)
        audio = torch.zeros(len(items), int(lengths.max()), dtype=torch.float32)
        for i, it in enumerate(items):
            audio[i, : it["audio"].shape[0]] = it["audio"]
        batch["audio"], batch["audio_lengths"] = audio, lengths
    if "text" in items[0]:
        batch["text"] = [it["text"] for it in items]
    return batch


@dataclass(frozen=True)
class _ShapesRenderer:
    """What a worker needs to render a sample (picklable, without the datamodule)."""

    world: ShapesWorld
    kind: str
    size: int
    frames: int
    sample_rate: int
    seed: int

    def __call__(self, index: int, split: str) -> dict[str, Tensor]:
        from zoo.world import render

        scene = self.world.scene(index, split)
        if self.kind == "image":
            return {"pixels": render.to_tensor(render.render_image(scene, self.size))}
        if self.kind == "video":
            return {"pixels": render.to_tensor(render.render_video(scene, self.frames, self.size))}
        from zoo.world.speech import render_speech

        seed = stable_seed("shapes-speech", self.seed, split, index)
        wave = render_speech(self.world.caption(scene), seed=seed, sample_rate=self.sample_rate)
        return {"audio": torch.from_numpy(wave)}


class _ShapesMediaDataset(Dataset):
    def __init__(self, render: _ShapesRenderer, split: str, n: int) -> None:
        self.render, self.split, self.n = render, split, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.render(index, self.split), "index": index}


class ShapesMediaDataModule(L.LightningDataModule):
    """ShapesWorld scenes rendered as images, videos or speech, on the fly.

    Train scenes are indices 0 .. train_size-1 of the "train" split (shuffled per epoch), validation
    scenes 0 .. val_size-1 of "val", test scenes 0 .. val_size-1 of "test" (held-out colour-shape pairs).
    `scene(index, split)` gives a batch element's Scene back from its "index".

    Args:
        kind: "image" -> {"pixels": [B, 3, size, size]}, "video" -> {"pixels": [B, 3, frames, size, size]},
            "speech" -> {"audio": [B, N], "audio_lengths": [B]} (the scene's caption, spoken).
        size: image side in pixels.
        frames: frames per video.
        train_size: training scenes per epoch.
        val_size: validation (and test) scenes.
        batch_size: samples per batch.
        seed: the world's seed (held-out pairs, scenes, speech variation) and the shuffling seed.
        min_objects: fewest objects per scene.
        max_objects: most objects per scene.
        num_workers: dataloader workers.
        include_motion: draw moving objects (and say their motion in speech); None means True for
            "video" only.
        heldout_fraction: share of colour-shape pairs held out of training (see ShapesWorld).
        sample_rate: audio samples per second for "speech".
    """

    def __init__(
        self,
        kind: Kind = "image",
        size: int = 32,
        frames: int = 5,
        train_size: int = 4096,
        val_size: int = 256,
        batch_size: int = 32,
        seed: int = 0,
        min_objects: int = 1,
        max_objects: int = 3,
        num_workers: int = 0,
        include_motion: bool | None = None,
        heldout_fraction: float = 0.15,
        sample_rate: int = 16000,
    ) -> None:
        super().__init__()
        if kind not in ("image", "video", "speech"):
            raise ValueError(f"kind must be one of 'image', 'video', 'speech', got {kind!r}")
        for name, value, low in (
            ("size", size, 12),
            ("frames", frames, 1),
            ("train_size", train_size, 1),
            ("val_size", val_size, 1),
            ("batch_size", batch_size, 1),
            ("num_workers", num_workers, 0),
            ("sample_rate", sample_rate, 1000),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        self.kind, self.size, self.frames = kind, size, frames
        self.train_size, self.val_size, self.batch_size = train_size, val_size, batch_size
        self.seed, self.num_workers, self.sample_rate = seed, num_workers, sample_rate
        motion = kind == "video" if include_motion is None else include_motion
        self.world = world = ShapesWorld(
            seed=seed,
            min_objects=min_objects,
            max_objects=max_objects,
            heldout_fraction=heldout_fraction,
            include_motion=motion,
        )
        self._renderer = _ShapesRenderer(world, kind, size, frames, sample_rate, seed)

    def scene(self, index: int, split: str = "train") -> Scene:
        """The Scene behind a batch element ("index") of `split` ("train", "val" or "test")."""
        return self.world.scene(index, split)

    def caption(self, index: int, split: str = "train") -> str:
        """The scene's caption (naming motion when the world has it)."""
        return self.world.caption(self.scene(index, split))

    def render(self, index: int, split: str = "train") -> dict[str, Tensor]:
        """One sample without "index": {"pixels": ...} or {"audio": ...}."""
        return self._renderer(index, split)

    def dataset(self, split: str) -> Dataset:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return _ShapesMediaDataset(
            self._renderer, split, self.train_size if split == "train" else self.val_size
        )

    def _loader(self, split: str) -> DataLoader:
        shuffle = split == "train"
        generator = torch.Generator().manual_seed(self.seed) if shuffle else None
        return DataLoader(
            self.dataset(split),
            batch_size=self.batch_size,
            shuffle=shuffle,
            generator=generator,
            num_workers=self.num_workers,
            collate_fn=collate_media,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("val")


@dataclass(frozen=True)
class _ManifestLoader:
    """What a worker needs to load a manifest sample (picklable, without the datamodule)."""

    kind: str
    size: int | None
    frames: int | None
    sample_rate: int

    def __call__(self, sample: dict) -> dict[str, Any]:
        from zoo.media import load_audio, load_image, load_video

        if self.kind == "image":
            item: dict[str, Any] = {"pixels": load_image(sample["image"], self.size)}
        elif self.kind == "video":
            item = {"pixels": load_video(sample["video"], self.frames, self.size)}
        else:
            item = {"audio": load_audio(sample["audio"], self.sample_rate)}
        return {**item, "text": sample.get("text", "")}


class _ManifestDataset(Dataset):
    def __init__(self, load: _ManifestLoader, samples: list[dict]) -> None:
        self.load, self.samples = load, samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.load(self.samples[index]), "index": index}


class ManifestMediaDataModule(L.LightningDataModule):
    """Real images, videos or audio listed in jsonl manifests (see `zoo.datamodules.manifests.read_manifest`).

    Every line of a manifest must be of `kind`. Batches are {"pixels": ...} or {"audio": ...,
    "audio_lengths": ...} as from `ShapesMediaDataModule`, plus "index" (the sample's position in its
    manifest) and "text" (a list of the lines' texts, "" where a line has none).

    Args:
        train_manifest: jsonl file of training samples.
        val_manifest: jsonl file of validation samples; None validates on the training manifest.
        kind: "image", "video" or "audio" ("speech" is accepted as "audio").
        size: image side after resizing; None keeps files at their own size (they must then agree).
        frames: frames per video (longer videos are cut with a warning, shorter ones refused).
        sample_rate: audio is resampled to this rate.
        batch_size: samples per batch.
        num_workers: dataloader workers.
        seed: shuffling seed.
        test_manifest: jsonl file of test samples (`zoo test`); None: the module has no test split.
    """

    def __init__(
        self,
        train_manifest: str,
        val_manifest: str | None = None,
        kind: Literal["image", "video", "audio", "speech"] = "image",
        size: int | None = 32,
        frames: int | None = 5,
        sample_rate: int = 16000,
        batch_size: int = 32,
        num_workers: int = 0,
        seed: int = 0,
        test_manifest: str | None = None,
    ) -> None:
        super().__init__()
        if kind not in ("image", "video", "audio", "speech"):
            raise ValueError(f"kind must be one of 'image', 'video', 'audio', got {kind!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.kind = "audio" if kind == "speech" else kind
        self.train_manifest, self.val_manifest = train_manifest, val_manifest
        self.test_manifest = test_manifest
        self.size, self.frames, self.sample_rate = size, frames, sample_rate
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self._samples: dict[str, list[dict]] = {}
        self._loader_fn = _ManifestLoader(self.kind, size, frames, sample_rate)

    def samples(self, split: str) -> list[dict]:
        """The manifest lines of "train", "val" or "test" (read and checked once)."""
        from zoo.datamodules.manifests import read_manifest
        from zoo.media import MediaError

        if split not in self._samples:
            path = self.val_manifest if split != "train" and self.val_manifest else self.train_manifest
            if split == "test":
                if self.test_manifest is None:
                    raise ValueError(
                        "ManifestMediaDataModule has no test split: give data.init_args.test_manifest "
                        "(a jsonl manifest of test samples) to run `zoo test`"
                    )
                path = self.test_manifest
            samples = read_manifest(path)
            wrong = [s for s in samples if s["kind"] != self.kind]
            if wrong:
                raise MediaError(
                    f"{path}:{wrong[0]['line']}: expected a {self.kind!r} sample, got {wrong[0]['kind']!r}"
                )
            self._samples[split] = samples
        return self._samples[split]

    def load(self, sample: dict) -> dict[str, Any]:
        """One manifest sample's tensors and text."""
        return self._loader_fn(sample)

    def setup(self, stage: str | None = None) -> None:
        if stage == "test":
            self.samples("test")
            return
        self.samples("train")
        self.samples("val")

    def _loader(self, split: str) -> DataLoader:
        shuffle = split == "train"
        generator = torch.Generator().manual_seed(self.seed) if shuffle else None
        return DataLoader(
            _ManifestDataset(self._loader_fn, self.samples(split)),
            batch_size=self.batch_size,
            shuffle=shuffle,
            generator=generator,
            num_workers=self.num_workers,
            collate_fn=collate_media,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("val")
