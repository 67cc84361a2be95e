"""Sharded weights as a specification (issue 17, "large checkpoints"): past `max_shard_size` a saved folder
holds `model-0000k-of-0000N.safetensors` shards and `model.safetensors.index.json` instead of one file, for
the unified model and for every component; loading reads either layout strictly, tied weights included; a
shard or an index that does not match is refused naming the file and the tensors; a hub id downloads the
index and its shards; saving or pushing again in the other layout leaves no stale weight files behind."""

from __future__ import annotations

import json

import pytest
import torch
from fake_hub import FakeHub, fake_hub_fixture  # noqa: F401 (the `fake_hub` fixture)
from safetensors.torch import load_file, save_file
from test_hub import outputs, text_batch, tiny_model
from test_publishing import assert_same_state, audio_codec, unified_with_components, visual_2d

from zoo.hub import from_pretrained, push_to_hub, save_pretrained
from zoo.tokenizers.audio import AudioCodec
from zoo.tokenizers.visual import VisualTokenizer
from zoo.weights import load_weights_file

INDEX = "model.safetensors.index.json"


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def weight_files(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("model"))


def test_a_model_past_max_shard_size_saves_as_shards_with_an_index_and_reloads_identically(tmp_path):
    model = tiny_model(tie_embeddings=True)
    limit = weight_bytes(model) // 4
    save_pretrained(model, tmp_path, max_shard_size=limit)
    files = weight_files(tmp_path)
    shards = [f for f in files if f != INDEX]
    assert INDEX in files and "model.safetensors" not in files
    assert len(shards) >= 4 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / INDEX).read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    for shard in shards:  # a shard passes the limit only when it is one tensor larger than the limit
        stored = load_file(tmp_path / shard)
        assert (tmp_path / shard).stat().st_size <= limit + 4096 or len(stored) == 1, shard
    assert "text_head.output.weight" not in index["weight_map"], "a tied tensor is stored once"

    loaded = from_pretrained(tmp_path)
    assert loaded.text_head.output.weight is loaded.text_embed.weight, "tied weights must stay tied"
    assert_same_state(loaded, model)
    batch = text_batch(model)
    for a, b in zip(outputs(model, batch), outputs(loaded, batch), strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_a_model_under_max_shard_size_is_one_file_and_saving_again_replaces_the_other_layout(tmp_path):
    model = tiny_model()
    save_pretrained(model, tmp_path, max_shard_size=weight_bytes(model) // 3)
    assert INDEX in weight_files(tmp_path)
    save_pretrained(model, tmp_path)  # default 5GB: one file, as before; the shards go
    assert weight_files(tmp_path) == ["model.safetensors"]
    save_pretrained(model, tmp_path, max_shard_size=weight_bytes(model) // 3)
    assert "model.safetensors" not in weight_files(tmp_path)
    assert_same_state(from_pretrained(tmp_path), model)


def sharded(tmp_path, parts: int = 3) -> tuple[torch.nn.Module, dict]:
    model = tiny_model()
    save_pretrained(model, tmp_path, max_shard_size=weight_bytes(model) // parts)
    return model, json.loads((tmp_path / INDEX).read_text())


def test_a_shard_missing_a_tensor_of_its_index_is_refused_naming_the_shard_and_the_tensor(tmp_path):
    _, index = sharded(tmp_path)
    name, shard = next(iter(index["weight_map"].items()))
    tensors = load_file(tmp_path / shard)
    del tensors[name]
    save_file(tensors, tmp_path / shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"(?s){shard}.*{name.replace('.', '[.]')}"):
        from_pretrained(tmp_path)


def test_a_tensor_missing_from_both_shard_and_index_is_refused_naming_it(tmp_path):
    _, index = sharded(tmp_path)
    shard = index["weight_map"].pop("text_embed.weight")
    tensors = load_file(tmp_path / shard)
    del tensors["text_embed.weight"]
    save_file(tensors, tmp_path / shard, metadata={"format": "pt"})
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"(?s)index\.json.*Missing key.*text_embed\.weight"):
        from_pretrained(tmp_path)


def test_an_extra_tensor_in_a_shard_and_its_index_is_refused_naming_it(tmp_path):
    _, index = sharded(tmp_path)
    shard = index["weight_map"]["text_embed.weight"]
    tensors = load_file(tmp_path / shard)
    tensors["backdoor.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / shard, metadata={"format": "pt"})
    index["weight_map"]["backdoor.weight"] = shard
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"(?s){shard}.*Unexpected key.*backdoor\.weight"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize("name", ["../elsewhere.safetensors", "/tmp/x.safetensors", "model.bin"])
def test_an_index_naming_anything_but_a_shard_file_of_the_folder_is_refused(tmp_path, name):
    _, index = sharded(tmp_path)
    index["weight_map"]["text_embed.weight"] = name
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"index\.json names {name!r}"):
        from_pretrained(tmp_path)


def test_a_missing_shard_and_a_folder_with_both_layouts_are_refused_naming_the_files(tmp_path):
    _, index = sharded(tmp_path / "a")
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / "a" / shard).unlink()
    with pytest.raises(FileNotFoundError, match=rf"names {shard}, which is missing"):
        from_pretrained(tmp_path / "a")
    sharded(tmp_path / "b")
    save_file({"x": torch.zeros(1)}, tmp_path / "b" / "model.safetensors")
    with pytest.raises(ValueError, match="holds both model.safetensors and model.safetensors.index.json"):
        from_pretrained(tmp_path / "b")


def test_a_component_past_max_shard_size_saves_as_shards_and_loads_by_from_pretrained_and_weights(tmp_path):
    codec = audio_codec()
    codec.save_pretrained(tmp_path / "codec", max_shard_size=weight_bytes(codec) // 3)
    files = weight_files(tmp_path / "codec")
    assert INDEX in files and "model.safetensors" not in files
    assert_same_state(AudioCodec.from_pretrained(tmp_path / "codec"), codec)
    fresh = audio_codec()
    torch.nn.init.zeros_(next(fresh.parameters()))
    load_weights_file(fresh, tmp_path / "codec", what="AudioCodec weights")  # a component's `weights` folder
    assert_same_state(fresh, codec)


def test_a_sharded_unified_folder_that_names_its_components_loads_them_from_their_folders(tmp_path):
    model = unified_with_components()
    tokenizer = model.nfsp.tokenizer
    tokenizer.save_pretrained(tmp_path / "vt", max_shard_size=weight_bytes(tokenizer) // 2)
    model.ncp.codec.save_pretrained(tmp_path / "codec")
    components = {"visual_tokenizer": tmp_path / "vt", "audio_codec": tmp_path / "codec"}
    folder = save_pretrained(
        model, tmp_path / "unified", components=components, max_shard_size=weight_bytes(model) // 4
    )
    index = json.loads((folder / INDEX).read_text())
    assert not any(k.startswith(("nfsp.tokenizer.", "ncp.codec.")) for k in index["weight_map"]), "named"
    assert_same_state(from_pretrained(folder), model)


def test_a_sharded_push_uploads_index_and_shards_and_a_hub_id_loads_them(fake_hub, tmp_path):
    model = tiny_model()
    push_to_hub(model, "me/big", endpoint=fake_hub, token="hf_test", max_shard_size=weight_bytes(model) // 3)
    files = FakeHub.repos["me/big"]
    shards = sorted(n for n in files if n.startswith("model-"))
    assert INDEX in files and "model.safetensors" not in files and len(shards) >= 3
    loaded = from_pretrained("me/big", endpoint=fake_hub, cache_dir=tmp_path / "cache")
    assert_same_state(loaded, model)
    # Pushing the small layout again deletes the shards and the index on the Hub in the same commit.
    push_to_hub(model, "me/big", endpoint=fake_hub, token="hf_test")
    assert sorted(n for n in FakeHub.repos["me/big"] if n.startswith("model")) == ["model.safetensors"]


def test_a_component_pushed_in_shards_is_pulled_by_its_hub_id(fake_hub, tmp_path):
    tokenizer = visual_2d()
    tokenizer.push_to_hub(
        "me/vt", endpoint=fake_hub, token="hf_test", max_shard_size=weight_bytes(tokenizer) // 2
    )
    assert INDEX in FakeHub.repos["me/vt"]
    loaded = VisualTokenizer.from_pretrained("me/vt", endpoint=fake_hub, cache_dir=tmp_path / "cache")
    assert_same_state(loaded, tokenizer)
