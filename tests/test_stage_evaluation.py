"""`zoo validate` and `zoo test` run for every training stage, from its shipped config shrunk to a few
samples: each LightningModule evaluates its datamodule's val and test splits and logs the same figures under
`val/` and `test/` (torchmetrics objects, zoo/tasks/metrics.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from zoo.cli.lightning_cli import ZooCLI

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
QUIET = [
    "--trainer.logger=false", "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false",
    "--trainer.limit_val_batches=1", "--trainer.limit_test_batches=1",
]  # fmt: skip
SMALL = ["--data.init_args.val_size=4", "--data.init_args.batch_size=4"]
SMALL_MEDIA = [*SMALL, "--data.init_args.num_workers=0"]

# config, flags that shrink it, the figures its task logs per split
STAGES = {
    "pretrain": ("quickstart.yaml", SMALL, ["loss"]),
    "visual_2d": ("tokenizers/visual_2d.yaml", SMALL_MEDIA, ["psnr", "ssim", "psnr_scales_1", "perplexity"]),
    "visual_3d": ("tokenizers/visual_3d.yaml", SMALL_MEDIA, ["psnr", "ssim", "perplexity"]),
    "audio": ("tokenizers/audio.yaml", SMALL_MEDIA, ["si_snr", "mel_loss", "usage_level1"]),
    "vision_encoder": ("vision/encoder_dual.yaml", SMALL_MEDIA, ["scene_exact", "attribute_loss"]),
    "refiner": (
        "refiner/shapes.yaml",
        [*SMALL_MEDIA, "--model.init_args.val_steps=2", "--model.init_args.num_samples=2"],
        ["psnr_refined", "psnr_gain_db", "ssim_refined", "loss"],
    ),
    "rl": (
        "rl/grpo.yaml",
        [
            "--data.init_args.heldout_size=4", "--data.init_args.val_batch_size=4",
            "--model.init_args.scoring.val_max_new_tokens=4",
        ],
        ["accuracy", "reward", "accuracy_sampled"],
    ),  # fmt: skip
}


@pytest.fixture(autouse=True)
def clean_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["zoo"])


# Pretraining and the 2D tokenizer run by default; the other stages (the same LightningCLI path, their own
# test_step) are slow tests, to keep `make test` under 15 minutes.
FAST_STAGES = ("pretrain", "visual_2d")


@pytest.mark.parametrize(
    "stage", [s if s in FAST_STAGES else pytest.param(s, marks=pytest.mark.slow) for s in STAGES]
)
def test_zoo_validate_and_zoo_test_log_the_same_figures_under_val_and_test(
    stage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(tmp_path)
    config, flags, figures = STAGES[stage]
    logged = {}
    for subcommand, split in (("validate", "val"), ("test", "test")):
        args = [subcommand, "--config", str(CONFIGS / config), *QUIET, *flags,
                f"--trainer.default_root_dir={tmp_path / 'run'}"]  # fmt: skip
        cli = ZooCLI(args=args)
        metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
        missing = [f for f in figures if f"{split}/{f}" not in metrics]
        assert not missing, f"{stage} {subcommand}: {missing} not logged; logged {sorted(metrics)}"
        logged[split] = {f: metrics[f"{split}/{f}"] for f in figures}
        assert all(math.isfinite(v) or v == math.inf for v in logged[split].values()), logged[split]
    # The splits are different data (ShapesWorld's test scenes hold out colour-shape pairs), figures alike.
    assert set(logged["val"]) == set(logged["test"])


def test_a_manifest_datamodule_tests_on_its_test_manifest_and_names_the_missing_one(tmp_path: Path):
    import json

    from zoo.datamodules.media_data import ManifestMediaDataModule
    from zoo.media import save_png
    from zoo.world.render import render_image
    from zoo.world.scenes import ShapesWorld

    world = ShapesWorld(seed=0)
    for split in ("train", "test"):
        lines = []
        for i in range(2):
            scene = world.scene(i, split)
            save_png(render_image(scene, 16), tmp_path / f"{split}{i}.png")
            lines.append(json.dumps({"image": f"{split}{i}.png", "text": world.caption(scene)}))
        (tmp_path / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    data = ManifestMediaDataModule(str(tmp_path / "train.jsonl"), size=16, batch_size=2,
                                   test_manifest=str(tmp_path / "test.jsonl"))  # fmt: skip
    data.setup("test")
    batch = next(iter(data.test_dataloader()))
    assert batch["text"] == [world.caption(world.scene(i, "test")) for i in range(2)]
    without = ManifestMediaDataModule(str(tmp_path / "train.jsonl"), size=16)
    with pytest.raises(ValueError, match="no test split: give data.init_args.test_manifest"):
        without.setup("test")
