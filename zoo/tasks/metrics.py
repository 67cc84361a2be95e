"""The tasks' evaluation metrics, from torchmetrics: PSNR, SSIM, SI-SNR, means; given weights, rFID and LPIPS.

Every figure a task reports over a validation or test split is a torchmetrics object held as a module
attribute (in an `nn.ModuleDict`, one per split and figure) and logged as the object
(`self.log(name, metric)`), so Lightning computes it once per epoch over every batch of every rank: the
states are summed across processes before `compute`, and the figure is the mean over all samples, not a mean
of per-batch or per-rank means.

Conventions, the zoo's since its first tokenizer: pixels lie in [-1, 1] (data range 2, so a PSNR equals the
usual one on [0, 1] images); PSNR is computed per image, then averaged over images; videos [B, C, T, H, W]
count each clip as one sample for PSNR and each frame as one image for SSIM.

Learned metrics need weights the zoo never downloads (machines may be offline, and a metric's network must
be the one its figures are quoted with). They are off by default; asked for, they need a local file:
- rFID: torchmetrics' `FrechetInceptionDistance` with `feature_extractor_weights_path` (the FID Inception
  weights, `pt_inception-2015-12-05-6726825d.pth`); needs the `torch-fidelity` package (the `fid` extra).
- LPIPS: torchmetrics' `LearnedPerceptualImagePatchSimilarity` builds torchvision's AlexNet / VGG / SqueezeNet
  and the LPIPS heads, fetched from the internet on first use into torch hub's cache (`TORCH_HOME`); it takes
  no path, so `lpips_metric` wants a torch hub folder that already holds them and points `TORCH_HOME` there
  only while building.
A missing file is a `FileNotFoundError` naming it and what was expected, before anything is built.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from torch import Tensor, nn
from torchmetrics import MeanMetric, Metric
from torchmetrics.audio import ScaleInvariantSignalNoiseRatio
from torchmetrics.functional.audio import scale_invariant_signal_noise_ratio
from torchmetrics.functional.image import peak_signal_noise_ratio
from torchmetrics.image import PeakSignalNoiseRatio, StructuralSimilarityIndexMeasure

PIXEL_RANGE = (-1.0, 1.0)
EVAL_SPLITS = ("val", "test")


def per_image_psnr(prediction: Tensor, target: Tensor) -> Tensor:
    """PSNR in dB of each sample of [B, ...] pixels in [-1, 1] (both clamped to the range)."""
    dims = tuple(range(1, target.dim()))
    return peak_signal_noise_ratio(
        prediction.float(), target.float(), data_range=PIXEL_RANGE, dim=dims, reduction="none"
    )


def per_clip_si_snr(estimate: Tensor, target: Tensor) -> Tensor:
    """Scale-invariant SNR in dB of each row of [B, N] waveforms (zero-mean, Le Roux et al. 2019)."""
    return scale_invariant_signal_noise_ratio(estimate.float(), target.float())


class ImagePSNR(PeakSignalNoiseRatio):
    """PSNR of [-1, 1] pixels per sample (images [B, 3, H, W], clips [B, 3, T, H, W]), mean over samples."""

    def __init__(self) -> None:
        # `dim` is fixed at construction, so samples are flattened first and the PSNR taken over dim 1.
        super().__init__(data_range=PIXEL_RANGE, dim=1, reduction="elementwise_mean")

    def update(self, preds: Tensor, target: Tensor) -> None:
        super().update(preds.float().flatten(1), target.float().flatten(1))


class ImageSSIM(StructuralSimilarityIndexMeasure):
    """SSIM of [-1, 1] pixels (Wang et al. 2004: Gaussian window 11, sigma 1.5), averaged over images; a clip
    counts each frame. Images smaller than the window use the largest odd window that fits (and a sigma
    scaled with it), since torchmetrics refuses a window larger than the image.

    Args:
        image_size: the side of the images (to size the window).
    """

    def __init__(self, image_size: int) -> None:
        kernel = min(11, image_size if image_size % 2 else image_size - 1)
        if kernel < 3:
            raise ValueError(f"ImageSSIM: images of side {image_size} are too small for SSIM (at least 3)")
        super().__init__(data_range=PIXEL_RANGE, kernel_size=kernel, sigma=1.5 * kernel / 11)

    def update(self, preds: Tensor, target: Tensor) -> None:
        if target.dim() == 5:  # [B, C, T, H, W] -> frames [B * T, C, H, W]
            preds, target = (v.transpose(1, 2).flatten(0, 1) for v in (preds, target))
        super().update(preds.float().clamp(*PIXEL_RANGE), target.float().clamp(*PIXEL_RANGE))


def split_metrics(names: list[str] | tuple[str, ...], make: Callable[[], Metric]) -> nn.ModuleDict:
    """One metric per evaluation split and name, keyed `f"{split}__{name}"` (the logged name is
    `f"{split}/{name}"`; a ModuleDict key cannot hold "."); `make()` builds each."""
    return nn.ModuleDict({f"{split}__{name}": make() for split in EVAL_SPLITS for name in names})


def audio_si_snr() -> ScaleInvariantSignalNoiseRatio:
    """SI-SNR in dB of [B, N] waveforms, averaged over clips."""
    return ScaleInvariantSignalNoiseRatio()


def mean() -> MeanMetric:
    """A (sample-weighted) mean over a whole split."""
    return MeanMetric()


def _require_file(path: str | Path, what: str, expected: str) -> Path:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{what}: no file {path} ({expected}); the zoo never downloads metric weights: give a local copy"
        )
    return path


def rfid_metric(feature_extractor_weights_path: str | Path, feature: int = 2048) -> Metric:
    """Reconstruction FID (`FrechetInceptionDistance`, real = targets, fake = reconstructions) with the FID
    Inception network read from a local file. Images go in as [-1, 1] floats (`normalize=True` after
    `(x + 1) / 2`: call `update_pair`)."""
    path = _require_file(
        feature_extractor_weights_path,
        "rFID",
        "the FID Inception weights torch-fidelity uses, pt_inception-2015-12-05-6726825d.pth",
    )
    from torchmetrics.image.fid import FrechetInceptionDistance

    return FrechetInceptionDistance(
        feature=feature, normalize=True, feature_extractor_weights_path=str(path)
    )


@contextmanager
def _torch_home(folder: Path):  # noqa: ANN202 (a context manager)
    previous = os.environ.get("TORCH_HOME")
    os.environ["TORCH_HOME"] = str(folder)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TORCH_HOME", None)
        else:
            os.environ["TORCH_HOME"] = previous


LPIPS_BACKBONE_FILES = {
    "alex": "alexnet-owt-7be5be79.pth",
    "vgg": "vgg16-397923af.pth",
    "squeeze": "squeezenet1_1-b8a52dc0.pth",
}


def lpips_metric(torch_home: str | Path, net_type: str = "alex") -> Metric:
    """LPIPS (`LearnedPerceptualImagePatchSimilarity`, [-1, 1] inputs) built offline from a torch hub folder
    that already holds torchvision's backbone weights (`<torch_home>/hub/checkpoints/<file>`)."""
    if net_type not in LPIPS_BACKBONE_FILES:
        raise ValueError(f"LPIPS net_type must be one of {sorted(LPIPS_BACKBONE_FILES)}, got {net_type!r}")
    folder = Path(torch_home)
    _require_file(
        folder / "hub" / "checkpoints" / LPIPS_BACKBONE_FILES[net_type],
        "LPIPS",
        f"torchvision's {net_type} weights in a torch hub folder, given as torch_home",
    )
    from torchmetrics.image.lpip import LearnedPerceptualImagePatchSimilarity

    with _torch_home(folder):
        return LearnedPerceptualImagePatchSimilarity(net_type=net_type, normalize=False)


def update_rfid(metric: Metric, reconstruction: Tensor, target: Tensor) -> None:
    """Feed one batch of [-1, 1] images to an rFID metric: targets as real, reconstructions as fake."""
    metric.update(((target.float() + 1) / 2).clamp(0, 1), real=True)
    metric.update(((reconstruction.float() + 1) / 2).clamp(0, 1), real=False)


__all__ = [
    "EVAL_SPLITS",
    "ImagePSNR",
    "ImageSSIM",
    "audio_si_snr",
    "lpips_metric",
    "mean",
    "per_clip_si_snr",
    "per_image_psnr",
    "rfid_metric",
    "split_metrics",
    "update_rfid",
]
