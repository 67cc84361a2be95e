"""Publishing every component as a specification: each component's folder (config, safetensors, card)
reloads to identical outputs, its card says what the Hub needs to know (task, library, data, measured figures
as a model-index), a folder of another kind or with foreign code is refused, a unified model's folder names
the component folders it was built with and loading it pulls them, and a push keeps the README on the Hub
unless told otherwise. Hub traffic goes to a local stand-in on 127.0.0.1 (tests/fake_hub.py), never the
network."""

from __future__ import annotations

import json
import shutil
import sys

import lightning as L
import pytest
import torch
from fake_hub import FakeHub, fake_hub_fixture  # noqa: F401 (the `fake_hub` fixture)
from huggingface_hub import ModelCard, metadata_load
from safetensors.torch import load_file, save_file

import zoo
from zoo.cli import main as cli_main
from zoo.config import to_config
from zoo.hub import from_pretrained, push_to_hub, save_pretrained
from zoo.models.refiner import DiffusionRefiner
from zoo.models.vision import DualPathEncoder
from zoo.publishing.component import PretrainedComponent
from zoo.publishing.transfer import keeps_hub_card
from zoo.tokenizers.audio import AudioCodec
from zoo.tokenizers.visual import VisualTokenizer
from zoo.tokenizers.visual_quantizer import MultiScaleQuantizer
from zoo.trust import UnsafeConfigError


def visual_2d() -> VisualTokenizer:
    quantizer = MultiScaleQuantizer(dim=8, codebook_size=64, scales=(1, 2, 4, 8))
    return VisualTokenizer(image_size=16, channels=(8, 16), quantizer=quantizer)


def visual_3d() -> VisualTokenizer:
    quantizer = MultiScaleQuantizer(dim=8, codebook_size=64, scales=(1, 2, 4, 8))
    return VisualTokenizer(
        image_size=16, channels=(8, 16), quantizer=quantizer, temporal=True, temporal_stride=2
    )


def audio_codec() -> AudioCodec:
    return AudioCodec(channels=4, max_channels=32, latent_dim=16, codebook_sizes=(32, 16, 8), codebook_dim=8)


def vision_encoder() -> DualPathEncoder:
    return DualPathEncoder(out_dim=32, vit_depth=1, vit_dim=32, vit_heads=2, merger_dim=32, merger_heads=2)


def refiner() -> DiffusionRefiner:
    return DiffusionRefiner(image_size=16, block_out_channels=(8, 16), attention_levels=(False, True),
                            norm_num_groups=4)


def seeded(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(7)) * 2 - 1


@torch.no_grad()
def behaviour(component: torch.nn.Module) -> list[torch.Tensor]:
    """What each component does on a fixed input: codes and their decode, features, a seeded refinement."""
    component.eval()
    if isinstance(component, VisualTokenizer):
        pixels = seeded((2, 3, 5, 16, 16) if component.temporal else (2, 3, 16, 16))
        codes = component.encode(pixels)
        return [*codes, component.decode(codes)]
    if isinstance(component, AudioCodec):
        codes = component.encode(seeded((2, 3200)))
        return [codes, component.decode(codes)]
    if isinstance(component, DualPathEncoder):
        return [component(seeded((2, 3, 32, 32)))]
    condition = seeded((1, 3, 8, 8))
    return [component.refine(condition, steps=2, generator=torch.Generator().manual_seed(0))]


COMPONENTS = {
    "visual_2d": (visual_2d, "image-to-image"),
    "visual_3d": (visual_3d, "video-to-video"),
    "audio_codec": (audio_codec, "audio-to-audio"),
    "vision_encoder": (vision_encoder, "image-feature-extraction"),
    "refiner": (refiner, "image-to-image"),
}


@pytest.fixture(scope="module", params=list(COMPONENTS))
def component(request) -> tuple[str, PretrainedComponent]:
    torch.manual_seed(0)
    module = COMPONENTS[request.param][0]().eval()
    behaviour(module)  # k-means codebooks initialise on their first batch, as training's first step does
    return request.param, module


def test_each_component_saves_and_loads_back_to_the_same_outputs_on_a_fixed_input(component, tmp_path):
    name, module = component
    folder = module.save_pretrained(tmp_path / name)
    assert {p.name for p in folder.iterdir()} == {"config.json", "model.safetensors", "README.md"}
    loaded = type(module).from_pretrained(folder)
    assert type(loaded) is type(module) and not loaded.training
    assert to_config(loaded) == to_config(module)
    for expected, got in zip(behaviour(module), behaviour(loaded), strict=True):
        assert torch.equal(expected, got)
    anything = PretrainedComponent.from_pretrained(folder)  # the base class loads any component
    assert type(anything) is type(module)


def test_each_card_states_task_library_data_and_figures_as_metadata_the_hub_parses(component, tmp_path):
    name, module = component
    folder = module.save_pretrained(
        tmp_path / name, datasets=["shapes-world"], metrics={"val/psnr": 21.5, "test/loss": 0.25},
        license="apache-2.0", repo_id=f"me/zoo-{name}",
    )
    card = ModelCard.load(folder / "README.md")
    assert card.data.pipeline_tag == COMPONENTS[name][1]
    assert card.data.library_name == "zoo" and card.data.datasets == ["shapes-world"]
    assert card.data.license == "apache-2.0"
    results = {r.metric_name: r for r in card.data.eval_results}
    assert results["val/psnr"].metric_value == 21.5 and results["val/psnr"].metric_type == "psnr"
    assert results["val/psnr"].dataset_split == "validation" and results["test/loss"].dataset_split == "test"
    assert results["test/loss"].task_type == COMPONENTS[name][1]
    assert results["test/loss"].dataset_name == "shapes-world"
    raw = metadata_load(folder / "README.md")
    assert raw["model-index"][0]["name"] == f"zoo-{name}"
    assert f'{type(module).__name__}.from_pretrained("me/zoo-{name}")' in card.text
    assert f"{module.num_parameters():,}" in card.text


def test_figures_without_the_dataset_they_were_measured_on_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"val/psnr.*dataset"):
        visual_2d().save_pretrained(tmp_path, metrics={"val/psnr": 20.0})


def test_a_folder_of_another_component_kind_is_refused_by_name(tmp_path):
    visual_2d().save_pretrained(tmp_path / "vt")
    with pytest.raises(UnsafeConfigError, match=r"describes a VisualTokenizer, not a AudioCodec"):
        AudioCodec.from_pretrained(tmp_path / "vt")
    with pytest.raises(ValueError, match="not a zoo model config"):
        from_pretrained(tmp_path / "vt")  # a component folder is not a unified model's


@pytest.mark.parametrize(
    "class_path", ["os.system", "builtins.eval", "zoo.batch.GroupBatch", "zoo_evil.Model"]
)
def test_a_component_config_naming_foreign_code_is_refused_without_importing_it(tmp_path, class_path):
    visual_2d().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["component"]["init_args"]["quantizer"] = {"class_path": class_path, "init_args": {}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    top = class_path.split(".")[0]
    imported_before = top in sys.modules
    with pytest.raises(UnsafeConfigError, match=class_path.replace(".", r"\.")):
        VisualTokenizer.from_pretrained(tmp_path)
    assert (top in sys.modules) == imported_before


def test_component_weights_missing_a_tensor_are_refused_naming_the_file_and_the_tensor(tmp_path):
    audio_codec().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = next(iter(tensors))
    del tensors[name]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"(?s)model\.safetensors.*{name.replace('.', r'[.]')}"):
        AudioCodec.from_pretrained(tmp_path)


# --- the unified model and its component folders --------------------------------------------------


def unified_with_components() -> zoo.models.unified.UnifiedModel:
    torch.manual_seed(0)
    return zoo.create_model(
        "tiny", dim=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, expert_hidden=16, top_k=2,
        max_seq_len=64, text_size=300, visual_size=64, audio_size=32, audio_levels=3,
        visual_tokenizer=visual_2d(), audio_codec=audio_codec(),
    ).eval()


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    left, right = a.state_dict(), b.state_dict()
    assert left.keys() == right.keys()
    for key, value in left.items():
        assert torch.equal(value, right[key]), key


def test_a_unified_folder_names_its_component_folders_and_loading_pulls_them(tmp_path):
    model = unified_with_components()
    model.nfsp.tokenizer.save_pretrained(tmp_path / "stage1" / "visual_tokenizer")
    model.ncp.codec.save_pretrained(tmp_path / "stage2" / "audio_codec")
    components = {
        "visual_tokenizer": tmp_path / "stage1" / "visual_tokenizer",
        "audio_codec": tmp_path / "stage2" / "audio_codec",
    }
    folder = save_pretrained(model, tmp_path / "unified", components=components)
    config = json.loads((folder / "config.json").read_text())
    assert config["components"] == {
        "visual_tokenizer": "../stage1/visual_tokenizer", "audio_codec": "../stage2/audio_codec"
    }
    stored = load_file(folder / "model.safetensors")
    assert not any(k.startswith(("nfsp.tokenizer.", "ncp.codec.")) for k in stored), "named, not copied"
    assert any(k.startswith("nfsp.") for k in stored), "the model's own NFSP head stays in its weights"
    assert "../stage1/visual_tokenizer" in (folder / "README.md").read_text()
    # The folders move together: the relative references still hold.
    shutil.copytree(tmp_path, tmp_path.parent / f"{tmp_path.name}-moved")
    loaded = from_pretrained(tmp_path.parent / f"{tmp_path.name}-moved" / "unified")
    assert_same_state(loaded, model)
    assert ModelCard.load(folder / "README.md").data.pipeline_tag == "any-to-any"


def test_a_component_folder_that_differs_from_the_model_is_refused_when_saving_and_when_loading(tmp_path):
    model = unified_with_components()
    other = visual_2d()  # the same configuration, other weights
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match=r"visual_tokenizer.*differs .* at tensor"):
        save_pretrained(model, tmp_path / "unified", components={"visual_tokenizer": tmp_path / "other"})
    model.nfsp.tokenizer.save_pretrained(tmp_path / "vt")
    save_pretrained(model, tmp_path / "unified", components={"visual_tokenizer": tmp_path / "vt"})
    smaller = VisualTokenizer(image_size=16, channels=(8, 16),
                              quantizer=MultiScaleQuantizer(dim=8, codebook_size=32, scales=(1, 2, 4, 8)))
    smaller.save_pretrained(tmp_path / "vt")  # replaced by another configuration after the export
    with pytest.raises(ValueError, match=r"visual_tokenizer.*another configuration.*codebook_size"):
        from_pretrained(tmp_path / "unified")


def test_a_missing_component_folder_is_reported_naming_the_component_and_the_place(tmp_path):
    model = unified_with_components()
    model.ncp.codec.save_pretrained(tmp_path / "codec")
    save_pretrained(model, tmp_path / "unified", components={"audio_codec": tmp_path / "codec"})
    shutil.rmtree(tmp_path / "codec")
    with pytest.raises(FileNotFoundError, match=r"component 'audio_codec' names the folder '\.\./codec'"):
        from_pretrained(tmp_path / "unified")


def test_a_model_without_the_component_cannot_name_one(tmp_path):
    model = zoo.create_model("tiny", dim=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4,
                             expert_hidden=16, top_k=2, max_seq_len=64)
    visual_2d().save_pretrained(tmp_path / "vt")
    with pytest.raises(ValueError, match="'visual_tokenizer': this model was built without one"):
        save_pretrained(model, tmp_path / "unified", components={"visual_tokenizer": tmp_path / "vt"})


# --- the Hub -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("on_hub", "overwrite", "keep"),
    [(False, False, False), (False, True, False), (True, False, True), (True, True, False)],
)
def test_a_push_keeps_the_hubs_card_only_when_there_is_one_and_nobody_asked_to_replace_it(
    on_hub, overwrite, keep
):
    assert keeps_hub_card(on_hub, overwrite) is keep


def test_a_second_push_keeps_the_card_on_the_hub_unless_overwrite_card(fake_hub):
    codec = audio_codec()
    codec.push_to_hub("me/codec", endpoint=fake_hub, token="hf_test", datasets=["a"], metrics={"val/x": 1.0})
    first = FakeHub.repos["me/codec"]["README.md"]
    codec.push_to_hub("me/codec", endpoint=fake_hub, token="hf_test", datasets=["b"], metrics={"val/x": 2.0})
    assert FakeHub.repos["me/codec"]["README.md"] == first, "an existing card is not overwritten"
    codec.push_to_hub(
        "me/codec", endpoint=fake_hub, token="hf_test", datasets=["b"], metrics={"val/x": 2.0},
        overwrite_card=True,
    )
    replaced = FakeHub.repos["me/codec"]["README.md"]
    assert b"- b" in replaced and replaced != first
    assert set(FakeHub.repos["me/codec"]) == {"config.json", "model.safetensors", "README.md"}


def test_a_unified_model_pushed_with_hub_components_is_pulled_with_them(fake_hub, tmp_path, capsys):
    model = unified_with_components()
    model.nfsp.tokenizer.push_to_hub("me/vt", endpoint=fake_hub, token="hf_test")
    model.ncp.codec.push_to_hub("me/codec", endpoint=fake_hub, token="hf_test")
    components = {"visual_tokenizer": "me/vt", "audio_codec": "me/codec"}
    push_to_hub(model, "me/unified", endpoint=fake_hub, token="hf_test", components=components)
    assert json.loads(FakeHub.repos["me/unified"]["config.json"])["components"] == components
    card = FakeHub.repos["me/unified"]["README.md"].decode()
    assert "[me/vt](https://huggingface.co/me/vt)" in card
    cli_main(["pull", "--repo_id", "me/unified", "--out", str(tmp_path / "pulled"), "--endpoint", fake_hub])
    out = capsys.readouterr().out
    assert "pulled me/unified" in out and "visual_tokenizer: pulled me/vt" in out
    assert_same_state(from_pretrained(tmp_path / "pulled", endpoint=fake_hub), model)


def test_a_pushed_unified_model_cannot_point_at_local_component_folders(fake_hub, tmp_path):
    model = unified_with_components()
    model.nfsp.tokenizer.save_pretrained(tmp_path / "vt")
    with pytest.raises(ValueError, match=r"'visual_tokenizer'.*local folder.*hub id"):
        components = {"visual_tokenizer": str(tmp_path / "vt")}
        push_to_hub(model, "me/unified", endpoint=fake_hub, components=components)


def test_cli_pull_of_a_component_checks_that_it_loads(fake_hub, tmp_path, capsys):
    encoder = vision_encoder()
    encoder.push_to_hub("me/encoder", endpoint=fake_hub, token="hf_test")
    cli_main(["pull", "--repo_id", "me/encoder", "--out", str(tmp_path / "enc"), "--endpoint", fake_hub])
    assert "(DualPathEncoder, " in capsys.readouterr().out
    loaded = DualPathEncoder.from_pretrained(tmp_path / "enc")
    for a, b in zip(behaviour(encoder), behaviour(loaded), strict=True):
        assert torch.equal(a, b)


# --- checkpoints of the component tasks ---------------------------------------------------------------


def test_a_component_task_writes_its_folder_and_zoo_export_and_push_publish_its_checkpoint(
    tmp_path, capsys, fake_hub
):
    from zoo.datamodules.media_data import ShapesMediaDataModule
    from zoo.tasks.visual_tokenizer import VisualTokenizerTraining

    torch.manual_seed(0)
    task = VisualTokenizerTraining(visual_2d(), lr=3e-3, warmup_steps=1)
    data = ShapesMediaDataModule(kind="image", size=16, train_size=16, val_size=8, batch_size=8)
    L.Trainer(
        accelerator="cpu", max_steps=2, default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1, val_check_interval=2,
        check_val_every_n_epoch=None,
    ).fit(task, datamodule=data)
    hook_folder = tmp_path / "visual_tokenizer"  # beside visual_tokenizer.safetensors
    card = ModelCard.load(hook_folder / "README.md")
    assert card.data.datasets == ["ShapesMediaDataModule"]
    assert any(r.metric_name == "val/psnr" for r in card.data.eval_results)
    checkpoint = next(tmp_path.rglob("*.ckpt"))
    cli_main(["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "exported"),
              "--datasets", "shapes-world", "--metrics", "val/psnr=19.5"])
    assert "(VisualTokenizer, " in capsys.readouterr().out
    exported = VisualTokenizer.from_pretrained(tmp_path / "exported")
    assert_same_state(exported, task.tokenizer)
    assert_same_state(VisualTokenizer.from_pretrained(hook_folder), task.tokenizer)
    results = ModelCard.load(tmp_path / "exported" / "README.md").data.eval_results
    assert [(r.metric_name, r.metric_value) for r in results] == [("val/psnr", 19.5)]

    hub = ["--endpoint", fake_hub, "--token", "hf_test"]
    cli_main(["push", "--checkpoint", str(checkpoint), "--repo_id", "me/vt", *hub, "--datasets", "shapes"])
    cli_main(["push", "--folder", str(tmp_path / "exported"), "--repo_id", "me/vt-export", *hub])
    assert "pushed me/vt-export" in capsys.readouterr().out
    for repo in ("me/vt", "me/vt-export"):
        assert set(FakeHub.repos[repo]) == {"config.json", "model.safetensors", "README.md"}
        cli_main(["pull", "--repo_id", repo, "--out", str(tmp_path / repo), "--endpoint", fake_hub])
        assert_same_state(VisualTokenizer.from_pretrained(tmp_path / repo), task.tokenizer)


def test_zoo_push_of_a_unified_folder_refuses_component_folders_the_hub_cannot_reach(tmp_path, fake_hub):
    model = unified_with_components()
    model.nfsp.tokenizer.save_pretrained(tmp_path / "vt")
    save_pretrained(model, tmp_path / "unified", components={"visual_tokenizer": tmp_path / "vt"})
    with pytest.raises(SystemExit, match=r"visual_tokenizer.*local folders"):
        cli_main(["push", "--folder", str(tmp_path / "unified"), "--repo_id", "me/u", "--endpoint", fake_hub])
    assert "me/u" not in FakeHub.repos


def test_zoo_export_of_a_unified_checkpoint_names_the_component_folders_its_weights_came_from(
    tmp_path, capsys
):
    """A LightningCLI run keeps the YAML's `weights` paths in the task's hyper-parameters (the checkpoint
    here holds what such a run writes: the task's spec with `_instantiator`, and the state dict)."""
    model = unified_with_components()
    weights = tmp_path / "runs" / "visual_tokenizer.safetensors"
    tokenizer_folder = model.nfsp.tokenizer.save_pretrained(weights.with_suffix(""))
    zoo.weights.save_weights_file(model.nfsp.tokenizer, weights)
    spec = to_config(model)
    spec["init_args"]["visual_tokenizer"]["init_args"]["weights"] = str(weights)
    checkpoint = tmp_path / "unified.ckpt"
    torch.save(
        {
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "hyper_parameters": {
                "_class_path": "zoo.tasks.pretrain.UnifiedPretraining",
                "_instantiator": "lightning.pytorch.cli.instantiate_module",
                "model": spec,
            },
        },
        checkpoint,
    )
    cli_main(["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "out")])
    assert "visual_tokenizer: named, not stored" in capsys.readouterr().out
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["components"] == {"visual_tokenizer": "../runs/visual_tokenizer"}
    assert tokenizer_folder == tmp_path / "runs" / "visual_tokenizer"
    assert_same_state(from_pretrained(tmp_path / "out"), model)
    cli_main(["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "whole"), "--whole"])
    assert json.loads((tmp_path / "whole" / "config.json").read_text())["components"] == {}
    assert_same_state(from_pretrained(tmp_path / "whole"), model)


def test_zoo_push_of_a_folder_refuses_card_flags_it_would_otherwise_ignore(tmp_path):
    visual_2d().save_pretrained(tmp_path / "vt")
    with pytest.raises(SystemExit, match=r"--folder uploads the folder as it is; \['--metrics'\]"):
        cli_main(["push", "--folder", str(tmp_path / "vt"), "--repo_id", "me/vt", "--metrics", "val/psnr=1"])
