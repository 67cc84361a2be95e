"""Publishing as a specification: a saved model reloads to identical outputs, an elastic sub-model exports
smaller and still generates, tampered files and foreign classes are refused with clear errors, and the push
reaches a hub API (a local stand-in on 127.0.0.1, never the network)."""

from __future__ import annotations

import json
import sys

import lightning as L
import pytest
import torch
from fake_hub import FakeHub, fake_hub_fixture  # noqa: F401 (the `fake_hub` fixture)

import zoo
from zoo.batch import IGNORE_INDEX, GroupBatch, Modality
from zoo.cli import main as cli_main
from zoo.hub import (
    UnsafeConfigError,
    build_from_config,
    from_pretrained,
    load_tokenizer,
    push_to_hub,
    save_pretrained,
)
from zoo.models.elastic import ElasticConfig
from zoo.tokenizers.text import TextTokenizer

TINY = dict(
    dim=32, n_layers=3, n_heads=2, n_kv_heads=1, n_experts=8, expert_hidden=16, top_k=2, max_seq_len=64
)


def tiny_model(**overrides) -> zoo.models.unified.UnifiedModel:
    torch.manual_seed(0)
    return zoo.create_model("tiny", **{**TINY, **overrides}).eval()


def text_batch(model, length: int = 12) -> GroupBatch:
    g = torch.Generator().manual_seed(3)
    r = model.vocab.text_range()
    ids = torch.randint(r.start, r.stop, (2, length), generator=g)
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE_INDEX)], dim=1)
    return GroupBatch(
        input_ids=ids,
        modality=torch.full_like(ids, int(Modality.TEXT)),
        group_id=torch.arange(length).expand(2, length).clone(),
        doc_id=torch.zeros_like(ids),
        positions=torch.arange(length).view(1, 1, length).expand(3, 2, length).clone(),
        targets={"text": targets},
    )


@torch.no_grad()
def outputs(model, batch, elastic=None) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    out = model(batch, elastic=elastic)
    greedy = model.generate([[model.vocab.bos_id, 20, 30]], max_new_tokens=6, top_k=1, elastic=elastic)
    return out.loss, out.backbone.hidden, greedy


def test_a_saved_model_reloads_with_identical_config_and_outputs(tmp_path):
    model = tiny_model(tie_embeddings=True)
    save_pretrained(model, tmp_path, TextTokenizer.byte_level(), datasets=["shapes-world"])
    loaded = from_pretrained(tmp_path)
    assert zoo.config.to_config(loaded) == zoo.config.to_config(model)
    assert json.loads((tmp_path / "config.json").read_text())["model"] == zoo.config.to_config(model)
    assert loaded.text_head.output.weight is loaded.text_embed.weight, "tied weights must stay tied"
    batch = text_batch(model)
    for a, b in zip(outputs(model, batch), outputs(loaded, batch), strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert load_tokenizer(tmp_path).to_json() == TextTokenizer.byte_level().to_json()


def test_the_timm_style_entry_point_loads_a_saved_directory(tmp_path):
    save_pretrained(tiny_model(), tmp_path)
    assert isinstance(zoo.load_pretrained(str(tmp_path)), zoo.models.unified.UnifiedModel)
    assert load_tokenizer(tmp_path) is None


def test_the_model_card_states_parameters_data_metrics_usage_and_library(tmp_path):
    model = tiny_model()
    save_pretrained(model, tmp_path, datasets=["shapes-world"], metrics={"val/loss": 2.25}, repo_id="me/tiny")
    card = (tmp_path / "README.md").read_text()
    assert "library_name: zoo" in card
    assert f"{model.num_parameters():,}" in card and f"{model.num_parameters(active=True):,}" in card
    assert "shapes-world" in card and "val/loss | 2.25" in card
    assert 'zoo.load_pretrained("me/tiny")' in card
    assert "- mixture-of-experts" in card


def test_an_extracted_sub_model_is_smaller_on_disk_loads_and_generates_like_the_elastic_model(tmp_path):
    model = tiny_model()
    b = model.backbone
    elastic = ElasticConfig.from_fractions(b.n_layers, b.n_experts, b.top_k, depth=0.5, width=0.5, topk=0.5)
    save_pretrained(model, tmp_path / "full")
    save_pretrained(model.extract(elastic), tmp_path / "small")
    full_size = (tmp_path / "full" / "model.safetensors").stat().st_size
    small_size = (tmp_path / "small" / "model.safetensors").stat().st_size
    assert small_size < 0.8 * full_size
    small = from_pretrained(tmp_path / "small")
    assert small.num_parameters() < model.num_parameters()
    batch = text_batch(model)
    expected_loss, expected_hidden, expected_ids = outputs(model, batch, elastic)
    loss, hidden, ids = outputs(small, batch)
    torch.testing.assert_close(hidden, expected_hidden, rtol=1e-4, atol=1e-5)
    assert ids == expected_ids and len(ids[0]) > 0


def test_a_tampered_shape_is_refused_naming_the_file_and_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    save_pretrained(tiny_model(), tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors["text_embed.weight"] = tensors["text_embed.weight"][:, :16].contiguous()
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"(?s)model\.safetensors.*size mismatch for text_embed\.weight"):
        from_pretrained(tmp_path)


def test_a_config_that_does_not_fit_the_weights_is_refused(tmp_path):
    save_pretrained(tiny_model(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model"]["init_args"]["backbone"]["init_args"]["n_layers"] = 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"(?s)model\.safetensors.*Missing key.*backbone\.layers\.3"):
        from_pretrained(tmp_path)


def test_a_truncated_weights_file_is_refused_naming_the_file(tmp_path):
    save_pretrained(tiny_model(), tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize("change", ["extra", "missing"])
def test_extra_or_missing_tensors_are_refused_naming_them(tmp_path, change):
    from safetensors.torch import load_file, save_file

    save_pretrained(tiny_model(), tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    if change == "extra":
        tensors["backdoor.weight"] = torch.zeros(2)
    else:
        del tensors["text_embed.weight"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match="backdoor.weight" if change == "extra" else "text_embed.weight"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "class_path",
    [
        "os.system",
        "builtins.eval",
        "subprocess.Popen",
        "torch.nn.Linear",
        "zoo.cli.argparse.ArgumentParser",  # reachable from a zoo module, yet not a zoo class
        "zoo.hub.HfApi",
        "zoo.batch.GroupBatch",  # a zoo class, but not a Configurable component
        "zoo_evil.Model",
    ],
)
def test_a_config_naming_anything_but_a_zoo_component_is_refused_without_importing_it(tmp_path, class_path):
    save_pretrained(tiny_model(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model"]["init_args"]["backbone"] = {"class_path": class_path, "init_args": {"command": "true"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    top = class_path.split(".")[0]
    imported_before = top in sys.modules
    with pytest.raises(UnsafeConfigError, match=class_path.replace(".", r"\.")):
        from_pretrained(tmp_path)
    assert (top in sys.modules) == imported_before


def test_unknown_constructor_arguments_are_refused_by_name():
    config = zoo.config.to_config(tiny_model())
    config["init_args"]["backbone"]["init_args"]["exec_this"] = "print(1)"
    with pytest.raises(ValueError, match="exec_this"):
        build_from_config(config)


def test_push_creates_the_repo_and_uploads_config_weights_card_and_tokenizer(fake_hub, tmp_path):
    model = tiny_model()
    url = push_to_hub(
        model, "me/zoo-tiny", TextTokenizer.byte_level(), token="hf_test", private=True, endpoint=fake_hub
    )
    assert url.startswith(f"{fake_hub}/me/zoo-tiny/commit/")
    paths = [path for path, _ in FakeHub.requests]
    assert paths[0] == "/api/repos/create" and paths[-1] == "/api/models/me/zoo-tiny/commit/main"
    assert FakeHub.requests[0][1]["authorization"] == "Bearer hf_test"
    files = FakeHub.repos["me/zoo-tiny"]
    assert set(files) == {"config.json", "model.safetensors", "README.md", "tokenizer.json"}
    # What arrived is a loadable model: write it out and load it back.
    for name, data in FakeHub.repos["me/zoo-tiny"].items():
        (tmp_path / name).write_bytes(data)
    batch = text_batch(model)
    assert torch.equal(outputs(from_pretrained(tmp_path), batch)[0], outputs(model, batch)[0])
    assert "library_name: zoo" in FakeHub.repos["me/zoo-tiny"]["README.md"].decode()


def test_cli_pull_downloads_a_pushed_model_that_loads(fake_hub, tmp_path, capsys):
    model = tiny_model()
    push_to_hub(model, "me/zoo-tiny", TextTokenizer.byte_level(), endpoint=fake_hub, token="hf_test")
    cli_main(["pull", "--repo_id", "me/zoo-tiny", "--out", str(tmp_path / "pulled"), "--endpoint", fake_hub])
    assert "pulled me/zoo-tiny" in capsys.readouterr().out
    batch = text_batch(model)
    assert torch.equal(outputs(from_pretrained(tmp_path / "pulled"), batch)[0], outputs(model, batch)[0])


def test_push_asks_for_a_private_repo_when_told(fake_hub):
    seen = {}
    original = FakeHub.reply

    def spy(self, payload, status=200, headers=None):
        if self.path == "/api/repos/create":
            seen.update(payload)
        original(self, payload, status, headers)

    FakeHub.reply = spy
    try:
        push_to_hub(tiny_model(), "me/secret", private=True, endpoint=fake_hub, token="hf_test")
    finally:
        FakeHub.reply = original
    assert seen.get("visibility") == "private" or seen.get("private") is True


def test_cli_export_turns_a_lightning_checkpoint_into_loadable_full_and_extracted_models(tmp_path, capsys):
    from zoo.datamodules.shapes_data import ShapesDataModule
    from zoo.tasks.pretrain import UnifiedPretraining

    model = tiny_model().train()
    task = UnifiedPretraining(model, lr=3e-3, warmup_steps=1)
    data = ShapesDataModule(
        vocab=model.vocab, train_size=32, val_size=16, batch_size=8, seq_len=64, tokenizer_size=300
    )
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    L.Trainer(
        accelerator="cpu", max_steps=2, default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[checkpoint],
    ).fit(task, datamodule=data)
    ckpt = str(tmp_path / "ckpt" / "last.ckpt")

    cli_main(["export", "--checkpoint", ckpt, "--out", str(tmp_path / "full")])
    cli_main(["extract", "--checkpoint", ckpt, "--out", str(tmp_path / "small"), "--depth", "0.5",
              "--width", "0.5"])
    assert "extracting depth 2/3, experts 4/8" in capsys.readouterr().out
    full = from_pretrained(tmp_path / "full")
    for name, value in task.model.state_dict().items():
        assert torch.equal(full.state_dict()[name], value), name
    small = from_pretrained(tmp_path / "small")
    assert small.backbone.n_layers == 2 and small.backbone.n_experts == 4
    size = (tmp_path / "small" / "model.safetensors").stat().st_size
    assert size < (tmp_path / "full" / "model.safetensors").stat().st_size
    assert len(small.generate([[small.vocab.bos_id]], max_new_tokens=4)[0]) > 0
    tokenizer = load_tokenizer(tmp_path / "small")
    assert tokenizer is not None and tokenizer.to_json() == data.tokenizer.to_json()


def test_cli_export_refuses_a_truncated_checkpoint_naming_it(tmp_path):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"PK\x03\x04 not really a checkpoint")
    with pytest.raises(ValueError, match="bad.ckpt"):
        cli_main(["export", "--checkpoint", str(bad), "--out", str(tmp_path / "out")])


def test_a_missing_directory_or_config_is_reported_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model": {}}')
    with pytest.raises(ValueError, match="not a zoo model config"):
        from_pretrained(tmp_path)
