"""`zoo fit` with configs/sft/*.yaml (issue 18 items 1 and 2): SFT on arithmetic started from a pretraining
checkpoint without role tokens (the vocabulary grows, the checkpoint's tokenizer is the one trained with), and
SFT on ShapesWorld instructions in every modality, each a few steps through the real command.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from test_configs import provide_weight_files

from zoo.cli import main
from zoo.config import to_config
from zoo.hub import TOKENIZER_KEY, build_from_config, checkpoint_tokenizer_json
from zoo.tokenizers.text import TextTokenizer

ROOT = Path(__file__).resolve().parent.parent
SFT = ROOT / "configs" / "sft"
QUICK = ["--trainer.max_steps=3", "--trainer.val_check_interval=3", "--trainer.limit_val_batches=1",
         "--trainer.enable_progress_bar=false"]  # fmt: skip


@pytest.fixture(autouse=True)
def clean_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["zoo"])  # LightningCLI warns about pytest's own options otherwise


def pretraining_checkpoint(config: Path, path: Path) -> TextTokenizer:
    """A checkpoint of the config's architecture trained without role tokens (`chat: false`), as
    `UnifiedPretraining` writes one, with its tokenizer."""
    spec = yaml.safe_load(config.read_text())["model"]["init_args"]["model"]
    spec["init_args"]["vocab"] = {**spec["init_args"]["vocab"], "chat": False}
    torch.manual_seed(0)
    model = build_from_config(spec)
    tokenizer = TextTokenizer.train(["12+7=19,19-3=16", "3-5=-2", "1+2=3"] * 20, vocab_size=300)
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    hyper = {"model": to_config(model)}
    torch.save({"state_dict": state, "hyper_parameters": hyper, TOKENIZER_KEY: tokenizer.to_json()}, path)
    return tokenizer


def test_zoo_fit_sft_arithmetic_from_a_pretraining_checkpoint_without_role_tokens(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.chdir(tmp_path)
    config = SFT / "arithmetic.yaml"
    tokenizer = pretraining_checkpoint(config, tmp_path / "pretrain.ckpt")
    with caplog.at_level("WARNING", logger="zoo.init_from"):
        main(["fit", "--config", str(config), *QUICK, "--data.init_args.batch_size=8",
              f"--model.init_args.init_from={tmp_path / 'pretrain.ckpt'}"])  # fmt: skip
    assert "fresh rows" in caplog.text, "the role rows init_from added are logged"
    checkpoint = tmp_path / "runs" / "sft_arithmetic" / "latest" / "checkpoints" / "last.ckpt"
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert saved["global_step"] == 3
    assert checkpoint_tokenizer_json(saved) == tokenizer.to_json(), "SFT trains with the starting tokenizer"


def test_zoo_fit_sft_shapes_in_every_modality(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = SFT / "shapes.yaml"
    provide_weight_files(yaml.safe_load(config.read_text()), tmp_path)  # stages 1 and 2's tokenizers
    main(["fit", "--config", str(config), *QUICK, "--data.init_args.batch_size=4"])
    checkpoint = tmp_path / "runs" / "sft_shapes" / "latest" / "checkpoints" / "last.ckpt"
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert saved["global_step"] == 3
    assert saved["hyper_parameters"]["model"]["init_args"]["vocab"]["chat"] is True
