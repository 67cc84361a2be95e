"""Every strategy overlay composes with every stage's config (issue 17, "every stage shards").

`configs/strategy/*.yaml` set `trainer.strategy` and `model.init_args.parallel`; each stage's task takes
`parallel`, so `zoo fit --config <stage> --config configs/strategy/fsdp.yaml` parses, and the task is built
with the overlay's `Parallelism`. The stages' models are built on the meta device (the parser and every
constructor run; only the weight storage is skipped), so the whole grid takes seconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from test_configs import (
    MetaZooCLI,
    deep_merge,
    load,
    provide_starting_checkpoints,
    provide_weight_files,
)

from zoo.parallel import Parallelism

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
OVERLAYS = sorted((CONFIGS / "strategy").glob("*.yaml"))
# One config per stage task: the visual tokenizer in 2D and 3D, the audio codec, the vision encoder, the
# refiner on a frozen tokenizer (the frozen-module case), unified pretraining, SFT and RL.
STAGES = [
    "tokenizers/visual_2d.yaml",
    "tokenizers/visual_3d.yaml",
    "tokenizers/audio.yaml",
    "vision/encoder_dual.yaml",
    "refiner/shapes.yaml",
    "refiner/tokenizer.yaml",
    "pretrain/shapes_image.yaml",
    "sft/tiny.yaml",
    "rl/grpo.yaml",
]


@pytest.fixture(autouse=True)
def clean_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["zoo"])


def test_the_grid_covers_every_overlay_and_every_stage_task():
    assert [p.stem for p in OVERLAYS] == ["ddp", "fsdp", "fsdp_fp8", "single"]
    tasks = {load(CONFIGS / s)["model"]["class_path"].rsplit(".", 1)[1] for s in STAGES}
    assert tasks == {
        "VisualTokenizerTraining", "AudioTokenizerTask", "VisionEncoderPretraining", "RefinerTraining",
        "UnifiedPretraining", "SupervisedFineTuning", "RLTask",
    }  # fmt: skip


# ddp.yaml and single.yaml set `parallel` through the same key as the FSDP overlays, and fsdp_fp8.yaml through
# the same one as fsdp.yaml: the slow run builds them (make test is near its 15-minute budget).
SLOW_OVERLAYS = ("ddp", "single", "fsdp_fp8")
GRID_OVERLAYS = [pytest.param(p, marks=pytest.mark.slow) if p.stem in SLOW_OVERLAYS else p for p in OVERLAYS]


@pytest.mark.parametrize("overlay", GRID_OVERLAYS, ids=lambda p: p.stem)
@pytest.mark.parametrize("stage", STAGES)
def test_a_strategy_overlay_composes_with_the_stage_config(
    stage: str, overlay: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(tmp_path)
    merged = deep_merge(load(CONFIGS / stage), load(overlay))
    provide_weight_files(merged, tmp_path)
    provide_starting_checkpoints(merged, tmp_path)
    args = ["--config", str(CONFIGS / stage), "--config", str(overlay)]
    args.append(f"--trainer.default_root_dir={tmp_path}")
    cli = MetaZooCLI(args=args, run=False)
    expected = Parallelism(**yaml.safe_load(overlay.read_text())["model"]["init_args"]["parallel"])
    assert cli.model.parallel == expected
    strategy = yaml.safe_load(overlay.read_text())["trainer"]["strategy"]
    if isinstance(strategy, dict):
        assert type(cli.trainer.strategy).__name__ == strategy["class_path"].rsplit(".", 1)[1]
