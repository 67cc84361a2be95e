"""zoo/tasks/metrics.py as a specification: the tasks' figures are torchmetrics' PSNR, SSIM and SI-SNR under
the zoo's conventions ([-1, 1] pixels, per-sample means), checked against values worked out by hand; the
learned metrics (rFID, LPIPS) are off unless given local weights, and a missing file is named."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from zoo.tasks.metrics import (
    ImagePSNR,
    ImageSSIM,
    audio_si_snr,
    lpips_metric,
    per_clip_si_snr,
    per_image_psnr,
    rfid_metric,
)


def test_psnr_of_a_known_error_on_minus_one_to_one_pixels_is_that_of_the_zero_one_scale():
    target = torch.zeros(2, 3, 4, 4)
    # An error of 0.2 in [-1, 1] is 0.1 on [0, 1]: MSE 0.01, PSNR 20 dB; an error of 0.02 gives 40 dB.
    prediction = target + torch.tensor([0.2, 0.02]).view(2, 1, 1, 1)
    assert per_image_psnr(prediction, target).tolist() == pytest.approx([20.0, 40.0], abs=1e-3)


def test_image_psnr_is_the_mean_of_per_image_psnr_over_every_batch_not_the_psnr_of_the_pooled_error():
    target = torch.zeros(1, 3, 4, 4)
    metric = ImagePSNR()
    metric.update(target + 0.2, target)  # 20 dB
    metric.update(target + 0.02, target)  # 40 dB, in another batch
    pooled_mse = (0.1**2 + 0.01**2) / 2  # on [0, 1]
    assert float(metric.compute()) == pytest.approx(30.0, abs=1e-3)
    assert float(metric.compute()) != pytest.approx(10 * math.log10(1 / pooled_mse), abs=0.1)


def test_image_psnr_counts_a_clip_as_one_sample_and_clamps_to_the_pixel_range():
    clip = torch.zeros(1, 3, 5, 4, 4)
    metric = ImagePSNR()
    metric.update(clip + 0.2, clip)
    assert float(metric.compute()) == pytest.approx(20.0, abs=1e-3)
    out_of_range = torch.full((1, 3, 4, 4), 1.0)
    assert float(per_image_psnr(out_of_range + 5.0, out_of_range)) == math.inf  # clamped to 1: exact


def test_ssim_of_two_flat_images_is_the_luminance_term_worked_out_by_hand():
    a, b = 0.5, 0.3
    c1 = (0.01 * 2.0) ** 2  # K1 = 0.01, data range 2 ([-1, 1])
    expected = (2 * a * b + c1) / (a * a + b * b + c1)  # no variance: contrast and structure terms are 1
    metric = ImageSSIM(image_size=16)
    metric.update(torch.full((2, 3, 16, 16), b), torch.full((2, 3, 16, 16), a))
    assert float(metric.compute()) == pytest.approx(expected, abs=1e-4)


def test_ssim_is_one_for_identical_images_and_lower_for_a_noisy_copy_of_a_clip_frame_by_frame():
    torch.manual_seed(0)
    clip = torch.rand(2, 3, 3, 8, 8) * 2 - 1
    same, noisy = ImageSSIM(image_size=8), ImageSSIM(image_size=8)
    same.update(clip, clip)
    noisy.update(clip + 0.3 * torch.randn_like(clip), clip)
    assert float(same.compute()) == pytest.approx(1.0, abs=1e-5)
    assert float(noisy.compute()) < 0.9


def test_ssim_refuses_images_too_small_for_any_window():
    with pytest.raises(ValueError, match="side 2"):
        ImageSSIM(image_size=2)


def test_si_snr_of_a_target_plus_orthogonal_noise_is_their_power_ratio_whatever_the_scale():
    t = torch.arange(800) / 800
    target = torch.sin(2 * math.pi * 5 * t)[None]
    noise = 0.1 * torch.cos(2 * math.pi * 5 * t)[None]  # orthogonal to the target, zero mean: 1% power
    assert float(per_clip_si_snr(target + noise, target)) == pytest.approx(20.0, abs=1e-2)
    assert float(per_clip_si_snr(3.0 * (target + noise), target)) == pytest.approx(20.0, abs=1e-2)
    metric = audio_si_snr()
    metric.update(target + noise, target)  # 20 dB
    metric.update(target + 0.01 * torch.cos(2 * math.pi * 5 * t)[None], target)  # 40 dB
    assert float(metric.compute()) == pytest.approx(30.0, abs=1e-2)


def test_rfid_and_lpips_name_the_missing_weight_file_and_download_nothing(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"rFID: no file .*pt_inception\.pth.*FID Inception weights"):
        rfid_metric(tmp_path / "pt_inception.pth")
    expected = tmp_path / "hub" / "checkpoints" / "alexnet-owt-7be5be79.pth"
    with pytest.raises(FileNotFoundError, match=f"LPIPS: no file {expected}"):
        lpips_metric(tmp_path)
    with pytest.raises(ValueError, match="net_type"):
        lpips_metric(tmp_path, net_type="resnet")
    assert not any(tmp_path.iterdir()), "nothing was fetched into the folder"


def test_the_visual_tokenizer_task_has_no_rfid_or_lpips_unless_given_weights_and_names_a_missing_file(
    tmp_path: Path,
):
    from zoo.tasks.visual_tokenizer import VisualTokenizerTraining
    from zoo.tokenizers.visual import VisualTokenizer
    from zoo.tokenizers.visual_quantizer import MultiScaleQuantizer

    def tokenizer() -> VisualTokenizer:
        quantizer = MultiScaleQuantizer(dim=8, codebook_size=16, scales=(1, 2, 4, 8))
        return VisualTokenizer(image_size=16, channels=(8, 16), quantizer=quantizer)

    task = VisualTokenizerTraining(tokenizer())
    assert task.rfid is None and task.lpips is None
    with pytest.raises(FileNotFoundError, match="inception.pth"):
        VisualTokenizerTraining(tokenizer(), rfid_weights=str(tmp_path / "inception.pth"))
    with pytest.raises(FileNotFoundError, match="alexnet-owt"):
        VisualTokenizerTraining(tokenizer(), lpips_torch_home=str(tmp_path))
