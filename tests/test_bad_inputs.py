"""The bad-input battery (issue 21): hostile checkpoints and configs, overrides that must hold, stale and
foreign resumes, per-item errors in predict, and errors printed for people. Each test asserts the clear
refusal and that nothing was executed or lost.

One tiny quickstart run (module fixture, about 10 s) gives a real checkpoint; hostile checkpoints are that
checkpoint with its hyper-parameters edited (they still load with `weights_only=True`, as a shared file
would).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import zoo
from zoo.cli import ZooCLI, console_main, main
from zoo.hub import TOKENIZER_KEY
from zoo.trust import UnsafeConfigError

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
PREDICT = str(ROOT / "configs" / "predict.yaml")
SMALL = [
    "--trainer.val_check_interval=2",
    "--trainer.limit_val_batches=1",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--data.init_args.train_size=128",
    "--data.init_args.val_size=16",
    "--model.init_args.sampling.max_new_tokens=4",
]
SUBCOMMANDS = ("fit", "validate", "test", "predict")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 2-step quickstart run; returns its root (runs/quickstart inside a temporary folder)."""
    folder = tmp_path_factory.mktemp("trained")
    root = folder / "runs" / "quickstart"
    main(
        [
            "fit",
            "--config",
            QUICKSTART,
            *SMALL,
            "--trainer.max_steps=2",
            "--trainer.default_root_dir",
            str(root),
        ]
    )
    return root


def checkpoint_of(root: Path) -> Path:
    return root / "latest" / "checkpoints" / "last.ckpt"


def hostile_copy(source: Path, target: Path, edit) -> Path:  # noqa: ANN001 (a function of the checkpoint dict)
    checkpoint = torch.load(source, map_location="cpu", weights_only=True)
    edit(checkpoint)
    torch.save(checkpoint, target)
    torch.load(target, map_location="cpu", weights_only=True)  # still a weights-only file: no pickle needed
    return target


def side_effect_module(folder: Path) -> Path:
    """A module that, if ever imported, leaves a marker file: proof that something was executed."""
    marker = folder / "imported.marker"
    (folder / "zoo_test_side_effect.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('imported')\nclass Model: pass\n"
    )
    return marker


HOSTILE = {
    "this": lambda hp: hp.update(_class_path="this.Zen"),
    "os.system": lambda hp: hp.update(_class_path="os.system", command="touch PWNED"),
    "builtins.eval": lambda hp: hp["model"].update(class_path="builtins.eval"),
    "side effect": lambda hp: hp["model"]["init_args"]["backbone"].update(
        class_path="zoo_test_side_effect.Model"
    ),
    "instantiator": lambda hp: hp.update(_instantiator="os.system"),
}


@pytest.mark.parametrize("subcommand", SUBCOMMANDS)
@pytest.mark.parametrize("attack", sorted(HOSTILE))
def test_a_checkpoint_naming_code_outside_the_zoo_is_refused_before_anything_is_imported(
    trained, tmp_path, monkeypatch, capsys, subcommand, attack
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = side_effect_module(tmp_path)
    hostile = hostile_copy(
        checkpoint_of(trained), tmp_path / "hostile.ckpt", lambda c: HOSTILE[attack](c["hyper_parameters"])
    )
    this_before = "this" in sys.modules
    with pytest.raises(UnsafeConfigError, match="refusing"):
        main([subcommand, "--config", QUICKSTART, *SMALL, f"--ckpt_path={hostile}"])
    assert not marker.exists(), "the side-effect module was imported"
    assert not (tmp_path / "PWNED").exists()
    assert ("this" in sys.modules) == this_before, "`this` was imported"
    assert "Beautiful is better than ugly" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "flag",
    [
        "--model.class_path=this.Zen",
        "--trainer.callbacks+=builtins.eval",
        "--data.class_path=zoo_test_side_effect.Model",
    ],
)
def test_a_class_path_from_the_command_line_outside_the_allow_list_is_refused(
    tmp_path, monkeypatch, capsys, flag
):
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = side_effect_module(tmp_path)
    this_before = "this" in sys.modules
    with pytest.raises(SystemExit):
        main(["fit", "--config", QUICKSTART, flag, "--print_config"])
    assert "not allowed" in capsys.readouterr().err
    assert not marker.exists() and ("this" in sys.modules) == this_before


def test_a_yaml_naming_a_module_the_user_did_not_allow_is_refused_and_allowed_once_named(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = side_effect_module(tmp_path)
    config = tmp_path / "callbacks.yaml"
    config.write_text("trainer:\n  callbacks:\n    - class_path: zoo_test_side_effect.Model\n")
    with pytest.raises(SystemExit):
        main(["fit", "--config", QUICKSTART, "--config", str(config), "--print_config"])
    assert "zoo_test_side_effect.Model" in capsys.readouterr().err and not marker.exists()
    # A user's own module is trusted by naming it (the import then happens, as the user asked).
    monkeypatch.setenv("ZOO_ALLOW_IMPORTS", "zoo_test_side_effect")
    with pytest.raises(SystemExit):  # imported now, then refused by type: Model is not a Callback
        main(["fit", "--config", QUICKSTART, "--config", str(config), "--print_config"])
    assert marker.exists()


def test_the_allow_list_refuses_to_trust_jsonargparse_itself(monkeypatch):
    monkeypatch.setenv("ZOO_ALLOW_IMPORTS", "jsonargparse")
    with pytest.raises(UnsafeConfigError, match="jsonargparse"):
        zoo.trust.allowed_imports()


# --- overrides, stale and foreign resumes ---------------------------------------------------------


def test_a_resume_of_a_finished_run_is_refused_with_what_to_change(trained, tmp_path):
    finished = r"at step \d+ and trainer.max_steps is 2.*Raise --trainer.max_steps"
    with pytest.raises(ValueError, match=finished):
        main([
            "fit", "--config", QUICKSTART, *SMALL, "--trainer.max_steps=2",
            f"--trainer.default_root_dir={trained}", f"--ckpt_path={checkpoint_of(trained)}",
        ])  # fmt: skip


def test_a_resume_with_a_changed_model_config_names_the_keys_and_goes_on_only_when_allowed(trained, tmp_path):
    root = tmp_path / "quickstart"  # a copy of the run, so the module's run stays at step 2
    shutil.copytree(trained / "version_0", root / "version_0")
    last = root / "version_0" / "checkpoints" / "last.ckpt"
    hostile_copy(last, last, lambda c: c["zoo_run"].update(run_dir=str(root / "version_0")))
    args = [
        "--config", QUICKSTART, *SMALL, "--trainer.max_steps=3", "--model.init_args.lr=0.0005",
        f"--trainer.default_root_dir={root}", f"--ckpt_path={last}",
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"model.init_args.lr: checkpoint 0.003 -> config 0.0005"):
        ZooCLI(args=["fit", *args], run=True)
    resumed = ZooCLI(args=["fit", *args, "--ckpt_overrides=allow"], run=True)
    assert resumed.trainer.global_step == 3
    assert resumed.run_folder == root / "version_0", "a resume continues in its own run folder"
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 3


def test_a_checkpoint_of_another_run_root_is_refused_unless_allowed(trained, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    args = [
        "fit", "--config", QUICKSTART, *SMALL, "--trainer.max_steps=3",
        f"--trainer.default_root_dir={elsewhere}", f"--ckpt_path={checkpoint_of(trained)}",
        "--trainer.max_steps=3",
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"belongs to the run .*version_0.*--ckpt_overrides=allow"):
        main(args)
    assert not elsewhere.exists() or not any(elsewhere.iterdir()), "nothing written for a refused run"
    cli = ZooCLI(args=[*args, "--ckpt_overrides=allow"], run=True)
    assert cli.run_folder == elsewhere / "version_0" and (elsewhere / "latest").resolve() == cli.run_folder


def test_a_model_that_does_not_fit_the_checkpoint_is_refused_before_its_weights_load(trained, tmp_path):
    expected = r"(?s)does not match the checkpoint's weights.*layers\.3.*n_layers: checkpoint 4 -> config 3"
    with pytest.raises(ValueError, match=expected):
        main([
            "predict", "--config", QUICKSTART, "--config", PREDICT, *SMALL,
            "--model.init_args.model.init_args.backbone.init_args.n_layers=3",
            "--data.init_args.prompts=[a]", f"--ckpt_path={checkpoint_of(trained)}",
            f"--trainer.callbacks.output={tmp_path / 'out.jsonl'}",
        ])  # fmt: skip
    assert not (tmp_path / "out.jsonl").exists()


def test_the_tokenizer_always_comes_from_the_checkpoint_whatever_the_datamodule(trained, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some other text\n\nwith its own tokenizer\n")
    cli = ZooCLI(
        args=[
            "predict", "--config", QUICKSTART, "--config", PREDICT, *SMALL,
            "--data=zoo.datamodules.text.TextFilesDataModule", f"--data.init_args.train_files=[{corpus}]",
            "--data.init_args.vocab={text_size: 512, visual_size: 512, audio_size: 256, audio_levels: 4}",
            "--data.init_args.prompts=[a small]",
            f"--trainer.callbacks.output={tmp_path / 'out.jsonl'}", f"--ckpt_path={checkpoint_of(trained)}",
        ],
        run=True,
    )  # fmt: skip
    saved = torch.load(checkpoint_of(trained), map_location="cpu", weights_only=True)
    assert cli.datamodule.tokenizer.to_json() == saved[TOKENIZER_KEY]
    row = json.loads((tmp_path / "out.jsonl").read_text().splitlines()[0])
    assert row["prompt"] == "a small"


# --- per-item errors and errors for people --------------------------------------------------------


def test_a_prompt_too_long_is_reported_by_itself_and_the_others_are_answered(trained, tmp_path):
    long = "a small red circle at the top left " * 20  # about 140 tokens: with 400 new ones, over 512
    output = tmp_path / "out.jsonl"
    main([
        "predict", "--config", QUICKSTART, "--config", PREDICT, *SMALL,
        "--model.init_args.sampling.max_new_tokens=400", f"--data.init_args.prompts=[a small, '{long}']",
        f"--trainer.callbacks.output={output}", f"--ckpt_path={checkpoint_of(trained)}",
    ])  # fmt: skip
    short, too_long = (json.loads(line) for line in output.read_text().splitlines())
    assert short["prompt"] == "a small" and "text" in short and "error" not in short
    assert "max_seq_len of 512" in too_long["error"] and "max_new_tokens" in too_long["error"]
    assert "ids" not in too_long


def test_a_refusal_is_printed_in_a_few_lines_with_the_traceback_in_a_file(trained, capsys):
    with pytest.raises(SystemExit) as exit_info:
        console_main(["predict", "--config", QUICKSTART, "--ckpt_path=/no/such/last.ckpt"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "zoo predict: error: --ckpt_path /no/such/last.ckpt: no such file or folder"
    log = Path(err[-1].split("full traceback in ")[1].split(";")[0])
    assert "Traceback" in log.read_text() and len(err) <= 3
    with pytest.raises(FileNotFoundError):  # --debug: the traceback, as Python prints it
        console_main(["predict", "--config", QUICKSTART, "--ckpt_path=/no/such/last.ckpt", "--debug"])


def test_data_longer_than_the_model_context_is_refused_before_the_first_step(tmp_path):
    with pytest.raises(ValueError, match=r"data.seq_len=1024 exceeds the backbone's max_seq_len=512"):
        main([
            "fit", "--config", QUICKSTART, *SMALL, "--trainer.max_steps=1", "--data.init_args.seq_len=1024",
            f"--trainer.default_root_dir={tmp_path}",
        ])  # fmt: skip


def test_a_missing_local_model_folder_is_not_reported_as_a_network_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(FileNotFoundError, match=r"runs/tiny-hf: no such local folder"):
        zoo.load_pretrained("runs/tiny-hf", local_files_only=True)


def test_generation_never_samples_text_ids_the_tokenizer_cannot_decode():
    model = zoo.create_model("tiny", n_layers=2).eval()
    offset = model.vocab.text_offset
    model.decode_text_with(12)
    torch.manual_seed(0)
    out = model.generate([[model.vocab.bos_id]] * 8, max_new_tokens=24, temperature=5.0, stop_ids=())
    text = [i for row in out for i in row if i >= offset]
    assert text and max(text) < offset + 12
    model.decode_text_with(None)
    out = model.generate([[model.vocab.bos_id]] * 8, max_new_tokens=24, temperature=5.0, stop_ids=())
    assert max(i for row in out for i in row) >= offset + 12, "without the limit the untrained ids appear"
    with pytest.raises(ValueError, match="tokenizer_size"):
        model.decode_text_with(model.vocab.text_size + 1)
