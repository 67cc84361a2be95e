"""Specifications of the command line and of every YAML under configs/ (DESIGN.md, LightningCLI lessons).

Every config is built through `zoo.cli.ZooCLI`, so a renamed argument, a wrong type or a preset that
drifted from `zoo.registry` fails here rather than at the start of a training run.
"""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from zoo.cli import ZooCLI, main
from zoo.config import to_config
from zoo.hub import build_from_config
from zoo.init_from import adapt_state
from zoo.registry import get_preset, list_models
from zoo.tasks.pretrain import UnifiedPretraining
from zoo.tokenizers.vocab import UnifiedVocab
from zoo.weights import save_weights_file

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
QUICKSTART = CONFIGS / "quickstart.yaml"
ALL_YAML = sorted([*CONFIGS.rglob("*.yaml"), *CONFIGS.rglob("*.yml")])
PRESET_YAML = sorted((CONFIGS / "presets").glob("*.yaml"))

# Models above this many parameters are built on the meta device only (`base`, ~1e9, takes ~40 s to
# initialise for real on CPU; on meta ~1 s).
REAL_BUILD_LIMIT = 1e8
# Constructor arguments that UnifiedTransformer also keeps as attributes of the same name.
BACKBONE_ATTRIBUTES = ("dim", "n_layers", "n_heads", "n_kv_heads", "n_experts", "top_k", "max_seq_len")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def is_full_config(config: dict) -> bool:
    """A full config names both the task and the datamodule; anything else is an overlay."""
    return all(isinstance(config.get(k), dict) and "class_path" in config[k] for k in ("model", "data"))


def overlay_base(path: Path) -> Path:
    """The config an overlay goes on: the quickstart, unless its header names another (`# overlay on: X`)."""
    for line in path.read_text().splitlines():
        if line.startswith("# overlay on:"):
            return REPO / line.split(":", 1)[1].strip()
    return QUICKSTART


def cli_args(path: Path) -> list[str]:
    """Full configs alone; overlays composed on top of their base, as their headers say to use them."""
    return (
        ["--config", str(path)]
        if is_full_config(load(path))
        else ["--config", str(overlay_base(path)), "--config", str(path)]
    )


class MetaZooCLI(ZooCLI):
    """ZooCLI that instantiates every class under `torch.device("meta")`.

    This is the cheapest honest way to check a big preset: the config goes through the very same
    parser (types, unknown keys, class_path resolution, overlay merging) and every constructor really
    runs (shape and argument checks included); only the weight storage is skipped. Parsing without
    instantiating would miss constructor-time errors such as `n_heads` not dividing `dim`.
    """

    def instantiate_classes(self) -> None:
        with torch.device("meta"):
            super().instantiate_classes()


def count_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.fixture(autouse=True)
def clean_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when given `args` while sys.argv holds pytest's own options."""
    monkeypatch.setattr("sys.argv", ["zoo"])


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run from tmp_path so that loggers, checkpoint folders or saved configs never land in the repo."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def deep_merge(base: dict, overlay: dict) -> dict:
    """What composing two YAML configs gives (mappings merge, anything else is replaced)."""
    out = dict(base)
    for key, value in overlay.items():
        previous = out.get(key)
        if isinstance(value, dict) and isinstance(previous, dict):
            # A changed class_path starts a fresh component (jsonargparse drops init_args that no longer fit).
            same = "class_path" not in value or value["class_path"] == previous.get("class_path")
            out[key] = deep_merge(previous, value) if same else value
        else:
            out[key] = value
    return out


def provide_weight_files(node: object, run_dir: Path) -> None:
    """Stage configs load weights an earlier stage wrote (`weights: runs/.../visual_tokenizer.safetensors`).
    Build each such component untrained, exactly as configured, and write its weights where the config
    expects them (relative to the run directory), so the config builds as it would after that stage."""
    if isinstance(node, list):
        for value in node:
            provide_weight_files(value, run_dir)
    if not isinstance(node, dict):
        return
    init_args = node.get("init_args")
    if "class_path" in node and isinstance(init_args, dict) and isinstance(init_args.get("weights"), str):
        target = run_dir / init_args["weights"]
        if not target.exists():
            spec = {"class_path": node["class_path"], "init_args": {**init_args, "weights": None}}
            save_weights_file(build_from_config(spec), target)
    for value in node.values():
        provide_weight_files(value, run_dir)


def provide_whisper_folders(node: object, run_dir: Path) -> None:
    """Configs with a Whisper teacher load a local Whisper folder the user downloaded (a placeholder path).
    Write a tiny random Whisper there (relative to the run directory), so the config builds as it would
    once the folder is in place; without the `transformers` extra the config cannot build, so skip."""
    if isinstance(node, list):
        for value in node:
            provide_whisper_folders(value, run_dir)
    if not isinstance(node, dict):
        return
    init_args = node.get("init_args")
    if str(node.get("class_path", "")).endswith(".WhisperTeacher") and isinstance(init_args, dict):
        pytest.importorskip("transformers", reason="a Whisper teacher needs the `whisper` extra")
        from whisper_helpers import save_tiny_whisper

        target = run_dir / init_args["path"]
        if not target.exists():
            save_tiny_whisper(target)
    for value in node.values():
        provide_whisper_folders(value, run_dir)


def provide_starting_checkpoints(merged: dict, run_dir: Path) -> None:
    """Stage configs start from an earlier stage's checkpoint (`init_from: runs/.../last.ckpt`: the RL stages
    of configs/rl/stages/). Write an untrained checkpoint of the configured model there (relative to the run
    directory), so the config builds as it would after the earlier stage."""
    init_args = (merged.get("model") or {}).get("init_args") or {}
    start = init_args.get("init_from")
    if not isinstance(start, str) or (run_dir / start).exists():
        return
    model = build_from_config(init_args["model"])
    target = run_dir / start
    target.parent.mkdir(parents=True, exist_ok=True)
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "hyper_parameters": {"model": to_config(model)}}, target)


# --- every YAML builds ------------------------------------------------------------------------------


def test_configs_directory_holds_the_quickstart_and_the_presets():
    assert QUICKSTART in ALL_YAML and is_full_config(load(QUICKSTART))
    assert PRESET_YAML, "no preset YAML found under configs/presets"


def meta_cli(path: Path, run_dir: Path) -> tuple[list[str], MetaZooCLI]:
    """The config's command line and its task built on the meta device, with the weight files and starting
    checkpoints it reads put in place under `run_dir` (untrained, as configured)."""
    args = [*cli_args(path), f"--trainer.default_root_dir={run_dir}"]
    merged: dict = {}
    for flag, used in zip(args, args[1:], strict=False):
        if flag == "--config":
            merged = deep_merge(merged, load(Path(used)))
    provide_weight_files(merged, run_dir)
    provide_whisper_folders(merged, run_dir)
    provide_starting_checkpoints(merged, run_dir)
    return args, MetaZooCLI(args=args, run=False)


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_config_builds_its_task_and_datamodule_through_the_cli(
    path: Path, in_tmp: Path
):
    args, meta = meta_cli(path, in_tmp)
    n_params = count_parameters(meta.model)
    built = [meta]
    if n_params <= REAL_BUILD_LIMIT:
        start = time.perf_counter()
        built.append(ZooCLI(args=args, run=False))
        assert time.perf_counter() - start < 20, (
            f"{path.name}: building {n_params:.3g} parameters is too slow"
        )
        assert count_parameters(built[-1].model) == n_params
    for cli in built:
        assert isinstance(cli.model, L.LightningModule)
        assert isinstance(cli.datamodule, L.LightningDataModule)
        if isinstance(cli.model, UnifiedPretraining):
            # UnifiedPretraining.setup refuses a mismatch at fit time; catch it here instead.
            assert cli.datamodule.vocab == cli.model.model.vocab, f"{path.name}: data and model vocab differ"
    if path.parent.name == "presets":
        # The overlay really reached the constructors (an overlay changing a class_path drops init_args).
        preset = get_preset(path.stem)
        parsed = meta.config["model.init_args.model.init_args.backbone.init_args"].as_dict()
        assert {k: parsed[k] for k in preset.backbone} == preset.backbone
        backbone = meta.model.model.backbone
        for name in (k for k in BACKBONE_ATTRIBUTES if k in preset.backbone):
            assert getattr(backbone, name) == preset.backbone[name], f"{path.name}: built {name} differs"
        assert meta.model.model.vocab == UnifiedVocab(**preset.vocab)


# Configs whose model starts from `make demo`'s unified model (directly or through a stage that did), as their
# headers say. `init_from` is strict, so each must be the demo's architecture tensor for tensor, role-token
# rows aside: a stage config left behind when the demo changed fails here, not at the start of a run.
FROM_DEMO = ["sft/shapes.yaml", "sft/tiny.yaml", "rl/grpo_shapes.yaml", *(f"rl/stages/{p.name}" for p in
             sorted((CONFIGS / "rl" / "stages").glob("*.yaml")))]  # fmt: skip


@pytest.mark.parametrize("name", FROM_DEMO)
def test_configs_started_from_the_demo_model_have_its_architecture(name: str, in_tmp: Path):
    demo = meta_cli(CONFIGS / "demo" / "multimodal.yaml", in_tmp)[1].model.model
    _, meta = meta_cli(CONFIGS / name, in_tmp)
    model = meta.model.model
    state, _ = adapt_state(demo.state_dict(), demo.vocab, model.vocab, "the demo model")
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    assert shapes == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert model.vocab.chat == ("sft/" in name or "stages/" in name)


# --- presets in YAML equal the registry -------------------------------------------------------------


@pytest.mark.parametrize("path", PRESET_YAML, ids=lambda p: p.stem)
def test_preset_yaml_spells_out_the_registry_preset_of_the_same_name(path: Path):
    preset = get_preset(path.stem)
    config = load(path)
    unified = config["model"]["init_args"]["model"]
    assert unified["class_path"] == "zoo.models.unified.UnifiedModel"
    args = dict(unified["init_args"])
    backbone, vocab = args.pop("backbone"), args.pop("vocab")
    assert backbone["class_path"] == "zoo.models.backbone.UnifiedTransformer"
    assert backbone["init_args"] == preset.backbone
    assert vocab == preset.vocab
    assert config["data"]["init_args"]["vocab"] == preset.vocab
    assert args == preset.model


def test_every_buildable_registry_preset_has_a_yaml():
    names = {p.stem for p in PRESET_YAML}
    missing = [n for n in list_models() if not get_preset(n).meta_only and n not in names]
    assert not missing, f"presets without configs/presets/NAME.yaml: {missing}"


# --- bad configs are refused with the field and the expected type ----------------------------------


def refuse(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        ZooCLI(args=["--config", str(QUICKSTART), *args], run=False)
    assert exit_info.value.code not in (0, None)
    return capsys.readouterr().err


def test_a_wrongly_typed_command_line_value_names_the_field_and_the_expected_type(capsys, in_tmp):
    err = refuse(["--model.init_args.lr=fast"], capsys)
    assert '"lr"' in err and "float" in err and "fast" in err


def test_a_wrongly_typed_yaml_value_names_the_field_and_the_expected_type(capsys, in_tmp: Path):
    bad = in_tmp / "bad.yaml"
    bad.write_text(
        "model:\n  init_args:\n    model:\n      init_args:\n        backbone:\n"
        "          init_args:\n            n_layers: four\n"
    )
    err = refuse(["--config", str(bad)], capsys)
    assert '"n_layers"' in err and "int" in err and "four" in err


def test_a_wrongly_typed_vocab_field_of_the_data_is_refused(capsys, in_tmp):
    err = refuse(["--data.init_args.vocab.text_size=big"], capsys)
    assert "vocab.text_size" in err and "int" in err


def test_an_unknown_key_is_refused_by_name(capsys, in_tmp: Path):
    err = refuse(["--model.init_args.lrr=0.1"], capsys)
    assert "lrr" in err
    bad = in_tmp / "unknown.yaml"
    bad.write_text(
        "model:\n  init_args:\n    model:\n      init_args:\n        backbone:\n"
        "          init_args:\n            n_layerz: 4\n"
    )
    err = refuse(["--config", str(bad)], capsys)
    assert "n_layerz" in err


# --- help, print_config, models ---------------------------------------------------------------------


def test_zoo_help_lists_the_lightning_and_the_extra_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("fit", "validate", "test", "predict", "train-tokenizer", "models"):
        assert command in out


def test_zoo_fit_help_shows_the_trainer_model_and_data_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--trainer.max_steps" in out and "--model" in out and "--data" in out


def print_config(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args, "--print_config"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_print_config_output_round_trips_to_the_same_task(capsys, in_tmp: Path):
    printed = print_config(["--config", str(QUICKSTART)], capsys)
    config = yaml.safe_load(printed)
    assert config["model"]["class_path"] == "zoo.tasks.pretrain.UnifiedPretraining"
    saved = in_tmp / "printed.yaml"
    saved.write_text(printed)
    # Fixed point through the `fit` subcommand: printing the printed config changes nothing.
    assert print_config(["--config", str(saved)], capsys) == printed
    # Without a subcommand (run=False) the arguments of Trainer.fit itself are not options: drop them.
    for fit_only in ("ckpt_path", "weights_only"):
        config.pop(fit_only, None)
    saved.write_text(yaml.safe_dump(config))
    reloaded = ZooCLI(args=["--config", str(saved)], run=False)
    original = ZooCLI(args=["--config", str(QUICKSTART)], run=False)
    assert type(reloaded.model) is type(original.model) is UnifiedPretraining
    assert type(reloaded.datamodule) is type(original.datamodule)
    assert reloaded.config["model"] == original.config["model"]
    assert reloaded.config["data"] == original.config["data"]
    for name in BACKBONE_ATTRIBUTES:
        assert getattr(reloaded.model.model.backbone, name) == getattr(original.model.model.backbone, name)
    assert reloaded.model.model.vocab == original.model.model.vocab
    assert reloaded.model.lr == original.model.lr


def test_zoo_models_lists_every_preset(capsys):
    main(["models"])
    out = capsys.readouterr().out
    listed = {line.split()[0] for line in out.splitlines()[1:] if line.strip()}
    assert listed == set(list_models())


def test_zoo_models_refuses_arguments():
    with pytest.raises(SystemExit, match="no arguments"):
        main(["models", "tiny"])
