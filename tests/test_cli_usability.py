"""Specifications of a quiet, correct `zoo` command line (issue 20 item 6) and of the recipes shipped inside
the package (item 5): configs found from any directory, no LightningCLI `args` warning, a step progress bar on
step-limited runs, short class names, and `--config` / `--print_config` on the extra commands."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import yaml

from zoo.cli import ZooCLI, main
from zoo.cli.config_paths import packaged_config, packaged_configs, with_packaged_configs

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = REPO / "configs" / "quickstart.yaml"


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory with nothing of the checkout in it."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`zoo ARGV` in process: exit status, stdout, stderr."""
    code = 0
    try:
        main(argv)
    except SystemExit as exit_info:
        code = 0 if exit_info.code is None else exit_info.code
    out, err = capsys.readouterr()
    return code, out, err


# --- configs shipped in the package --------------------------------------------------------------------


def test_the_packaged_configs_are_the_checkout_configs():
    packaged = sorted(p.relative_to(packaged_configs()) for p in packaged_configs().rglob("*.yaml"))
    checkout = sorted(p.relative_to(REPO / "configs") for p in (REPO / "configs").rglob("*.yaml"))
    assert packaged == checkout and Path("quickstart.yaml") in packaged


def test_a_relative_config_missing_here_is_read_from_the_packaged_configs(elsewhere: Path):
    shipped = packaged_configs() / "presets" / "small.yaml"
    assert packaged_config("configs/presets/small.yaml") == shipped
    assert packaged_config("presets/small.yaml") == shipped
    argv = ["fit", "--config", "configs/quickstart.yaml", "--data=configs/data/missing.yaml"]
    assert with_packaged_configs(argv) == [
        "fit", "--config", str(packaged_configs() / "quickstart.yaml"), "--data=configs/data/missing.yaml",
    ]  # fmt: skip


def test_a_config_that_exists_here_or_is_absolute_is_never_replaced(elsewhere: Path):
    local = elsewhere / "configs" / "quickstart.yaml"
    local.parent.mkdir()
    local.write_text("seed_everything: 1\n")
    assert packaged_config("configs/quickstart.yaml") is None
    assert packaged_config(str(elsewhere / "configs" / "predict.yaml")) is None
    assert packaged_config("../configs/quickstart.yaml") is None
    argv = ["--config", "configs/quickstart.yaml"]
    assert with_packaged_configs(argv) == argv


def test_zoo_fit_from_another_directory_uses_the_packaged_quickstart(elsewhere: Path, capsys):
    code, out, err = run(["fit", "--config", "configs/quickstart.yaml", "--print_config"], capsys)
    assert code == 0
    assert yaml.safe_load(out)["model"]["class_path"] == "zoo.tasks.pretrain.UnifiedPretraining"
    assert "using the packaged" in err and "quickstart.yaml" in err


def test_zoo_fit_help_says_where_a_relative_config_is_looked_for(capsys):
    code, out, _ = run(["fit", "--help"], capsys)
    assert code == 0 and "configs shipped" in " ".join(out.split())


# --- no `args` warning -----------------------------------------------------------------------------------


def test_no_lightning_args_warning_whatever_sys_argv_holds(elsewhere: Path, capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["pytest", "-q", "tests/some_test.py"])  # someone else's command line
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ZooCLI(args=["--config", str(QUICKSTART), "--trainer.logger=false"], run=False)
        assert run(["fit", "--config", str(QUICKSTART), "--print_config"], capsys)[0] == 0
    assert not [w for w in caught if "args" in str(w.message) and "LightningCLI" in str(w.message)]
    assert sys.argv == ["pytest", "-q", "tests/some_test.py"], "the caller's sys.argv is given back"


# --- progress bar --------------------------------------------------------------------------------------


def test_a_step_limited_fit_shows_steps_against_max_steps(elsewhere: Path, capsys):
    code, out, _ = run(
        [
            "fit", "--config", str(QUICKSTART), "--trainer.max_steps=3", "--trainer.limit_val_batches=0",
            "--trainer.callbacks=[]", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
            "--data.init_args.train_size=96", "--data.init_args.batch_size=48",  # 2 batches an epoch
        ],
        capsys,
    )  # fmt: skip
    assert code == 0
    assert "step" in out and "3/3" in out, "one bar over the run: steps against max_steps"
    assert "/-2" not in out, "Lightning's epoch count of a step-limited run (max_epochs -1) is not shown"


def test_a_config_that_names_its_own_progress_bar_keeps_it(elsewhere: Path):
    from lightning.pytorch.callbacks import TQDMProgressBar

    cli = ZooCLI(
        args=[
            "--config", str(QUICKSTART), "--trainer.logger=false",
            "--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar",
        ],
        run=False,
    )  # fmt: skip
    assert type(cli.trainer.progress_bar_callback) is TQDMProgressBar


# --- short class names ---------------------------------------------------------------------------------


def test_short_class_names_name_the_zoo_classes(elsewhere: Path, capsys):
    code, out, _ = run(["fit", "--model.help", "UnifiedPretraining"], capsys)
    assert code == 0 and "--model.model" in out and "--model.lr" in out
    code, out, _ = run(["fit", "--data.help", "ShapesMultimodalDataModule"], capsys)
    assert code == 0 and "--data.vocab" in out
    code, out, _ = run(
        ["fit", "--config", str(QUICKSTART), "--model", "UnifiedPretraining", "--data", "ShapesDataModule",
         "--print_config"],
        capsys,
    )  # fmt: skip
    assert code == 0
    printed = yaml.safe_load(out)
    assert printed["model"]["class_path"] == "zoo.tasks.pretrain.UnifiedPretraining"
    assert printed["data"]["class_path"] == "zoo.datamodules.shapes_data.ShapesDataModule"


def test_a_short_name_in_a_yaml_file_resolves_too(elsewhere: Path, capsys):
    config = yaml.safe_load(QUICKSTART.read_text())
    config["model"]["init_args"]["elastic"]["class_path"] = "ElasticSampler"
    config["data"]["class_path"] = "ShapesDataModule"
    (elsewhere / "short.yaml").write_text(yaml.safe_dump(config))
    code, out, _ = run(["fit", "--config", "short.yaml", "--print_config"], capsys)
    assert code == 0
    printed = yaml.safe_load(out)
    assert printed["model"]["init_args"]["elastic"]["class_path"] == "zoo.models.elastic.ElasticSampler"


def test_a_short_name_outside_the_zoo_is_still_refused(elsewhere: Path, capsys):
    code, _, err = run(["fit", "--config", str(QUICKSTART), "--trainer.callbacks+=Popen"], capsys)
    assert code != 0 and "Popen" in err


# --- --config and --print_config on the extra commands ----------------------------------------------------

EXTRA = {
    "export": ["--checkpoint", "last.ckpt", "--out", "exported", "--depth", "0.5"],
    "push": ["--checkpoint", "last.ckpt", "--repo_id", "user/zoo-tiny", "--private"],
    "pull": ["--repo_id", "user/zoo-tiny", "--out", "pulled"],
    "tokenize": ["pairs.jsonl", "shards-{0..3}.tar", "--out", "codes", "--video_start", "centre"],
    "generate": ["exported", "a small red", "--max-new-tokens", "5", "--temperature", "0"],
    "chat": ["exported", "--seed", "3"],
    "serve": ["exported", "--port", "8123"],
    "eval": ["exported", "--tasks", "arithmetic", "--limit", "0.5"],
    "train-tokenizer": ["--files", "a.txt", "b.txt", "--vocab_size", "300"],
}


@pytest.mark.parametrize("command", sorted(EXTRA))
def test_an_extra_command_prints_its_options_as_a_config_that_reads_back(command, elsewhere: Path, capsys):
    code, printed, _ = run([command, *EXTRA[command], "--print_config"], capsys)
    assert code == 0, f"zoo {command} --print_config"
    options = yaml.safe_load(printed)
    flags = [a for a in EXTRA[command] if a.startswith("--")]
    assert all(flag[2:].replace("-", "_") in options for flag in flags)
    (elsewhere / "options.yaml").write_text(printed)
    code, again, _ = run([command, "--config", "options.yaml", "--print_config"], capsys)
    assert code == 0 and yaml.safe_load(again) == options, "the printed config is a fixed point"


def test_an_extra_command_runs_from_a_config_file_and_later_flags_win(elsewhere: Path, capsys):
    corpus = elsewhere / "corpus.txt"
    corpus.write_text("\n".join(f"a small red circle number {i} at the top left" for i in range(50)))
    (elsewhere / "tokenizer.yaml").write_text(
        f"files: [{corpus}]\nvocab_size: 300\nmin_frequency: 2\nout: from_config.json\n"
    )
    code, _, _ = run(["train-tokenizer", "--config", "tokenizer.yaml", "--out", "from_flag.json"], capsys)
    assert code == 0
    assert (elsewhere / "from_flag.json").is_file() and not (elsewhere / "from_config.json").exists()


@pytest.mark.parametrize("command", ["ablate", "analyze"])
def test_the_commands_whose_config_is_a_training_config_say_so_in_help(command, capsys):
    code, out, _ = run([command, "--help"], capsys)
    assert code == 0 and "--print_config" in " ".join(out.split())
