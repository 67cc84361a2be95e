"""`init_from` (issue 18 item 2): every stage starts from the last. A Lightning checkpoint, an exported folder
and a hub id (here from the local hub cache, offline) load the same weights strictly; what does not fit is
named; a vocabulary without role tokens grows by them, its own rows kept; pretraining, SFT and RL share the
loader.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch

from zoo.config import to_config
from zoo.hub import TOKENIZER_KEY, save_pretrained
from zoo.init_from import load_starting_weights
from zoo.models.backbone import UnifiedTransformer
from zoo.models.unified import UnifiedModel
from zoo.tasks.pretrain import UnifiedPretraining
from zoo.tasks.sft import SupervisedFineTuning
from zoo.tokenizers.text import TextTokenizer
from zoo.tokenizers.vocab import CHAT_TOKENS, UnifiedVocab

PLAIN = UnifiedVocab(text_size=300, visual_size=16, audio_size=16, audio_levels=2)
CHAT = UnifiedVocab(text_size=300, visual_size=16, audio_size=16, audio_levels=2, chat=True)


def tiny(vocab: UnifiedVocab = PLAIN, seed: int = 0, dim: int = 32, tie: bool = False) -> UnifiedModel:
    torch.manual_seed(seed)
    backbone = UnifiedTransformer(
        dim=dim, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, expert_hidden=16, top_k=2, max_seq_len=64
    )
    return UnifiedModel(backbone, vocab, mtp_depth=1, tie_embeddings=tie)


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer.train(["1+2=3", "4+5=9", "12+30=42"] * 10, vocab_size=262)


def write_checkpoint(model: UnifiedModel, tokenizer: TextTokenizer, path: Path) -> Path:
    """What a `UnifiedPretraining` fit writes: the task's state dict, its hyper-parameters, the tokenizer."""
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    hyper = {"model": to_config(model)}
    torch.save({"state_dict": state, "hyper_parameters": hyper, TOKENIZER_KEY: tokenizer.to_json()}, path)
    return path


def write_hub_cache(folder: Path, cache: Path, repo_id: str) -> None:
    """The layout huggingface_hub's cache has after a download of `repo_id` (refs/main -> a snapshot)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    storage = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, storage / "snapshots" / commit)
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(commit)


def same_weights(a: UnifiedModel, b: UnifiedModel) -> bool:
    left, right = a.state_dict(), b.state_dict()
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def test_a_checkpoint_an_export_and_a_hub_id_load_the_same_weights_and_tokenizer(
    tmp_path, tokenizer, monkeypatch
):
    source = tiny(seed=1)
    checkpoint = write_checkpoint(source, tokenizer, tmp_path / "pretrain.ckpt")
    export = save_pretrained(source, tmp_path / "export", tokenizer)
    write_hub_cache(export, tmp_path / "hub", "zoo-tests/tiny")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for where in (str(checkpoint), str(export), "zoo-tests/tiny"):
        model = tiny(seed=2)
        assert not same_weights(model, source)
        started = load_starting_weights(model, where)
        assert same_weights(model, source), where
        assert started.fresh == () and started.loaded == len(source.state_dict())
        assert started.tokenizer is not None and started.tokenizer.to_json() == tokenizer.to_json(), where


def test_what_does_not_fit_is_named_missing_unexpected_or_of_another_shape(tmp_path, tokenizer):
    checkpoint = write_checkpoint(tiny(), tokenizer, tmp_path / "pretrain.ckpt")
    shape = r"44 of another shape: backbone.layers.0.attention.k_norm.weight \[16\] \(the model's: \[24\]\)"
    with pytest.raises(ValueError, match=shape):
        load_starting_weights(tiny(dim=48), str(checkpoint))
    no_mtp = tiny()
    no_mtp_source = UnifiedModel(no_mtp.backbone, PLAIN, mtp_depth=0)
    with pytest.raises(ValueError, match=r"missing: text_head\.mtp\.0\."):
        load_starting_weights(tiny(), str(write_checkpoint(no_mtp_source, tokenizer, tmp_path / "a.ckpt")))
    with pytest.raises(ValueError, match=r"unexpected: text_head\.mtp\.0\."):
        load_starting_weights(no_mtp_source, str(checkpoint))
    with pytest.raises(ValueError, match="no such file or folder"):
        load_starting_weights(tiny(), str(tmp_path / "weights.bin"))
    other = UnifiedVocab(text_size=400, visual_size=16, audio_size=16, audio_levels=2, chat=True)
    with pytest.raises(ValueError, match="only role tokens may be added"):
        load_starting_weights(tiny(other), str(checkpoint))


@pytest.mark.parametrize("tie", [False, True])
def test_a_vocabulary_without_role_tokens_grows_by_them_and_keeps_every_row_it_had(
    tmp_path, tokenizer, tie, caplog
):
    source = tiny(PLAIN, seed=1, tie=tie)
    path = save_pretrained(source, tmp_path / "export", tokenizer)
    model = tiny(CHAT, seed=2, tie=tie)
    with caplog.at_level(logging.WARNING, logger="zoo.init_from"):
        started = load_starting_weights(model, str(path))
    roles = slice(PLAIN.num_special, CHAT.text_offset)
    assert started.fresh == ("text_embed.weight[10:13]", "text_head.output.weight[10:13]")
    assert "fresh rows" in caplog.text and all(t in caplog.text for t in CHAT_TOKENS), "fresh rows are logged"
    for key in ("text_embed.weight", "text_head.output.weight"):
        old, new = source.state_dict()[key], model.state_dict()[key]
        assert torch.equal(new[: PLAIN.num_special], old[: PLAIN.num_special]), "the specials keep their ids"
        assert torch.equal(new[CHAT.text_offset :], old[PLAIN.text_offset :]), "text rows move up by three"
        mean = old[PLAIN.text_offset : PLAIN.visual_offset].mean(0)
        assert torch.allclose(new[roles], mean.expand(len(CHAT_TOKENS), -1)), "role rows: the mean text row"
    # Every other tensor is the source's own.
    rest = [k for k in source.state_dict() if k not in ("text_embed.weight", "text_head.output.weight")]
    assert all(torch.equal(source.state_dict()[k], model.state_dict()[k]) for k in rest)
    assert model.vocab.special("<|assistant|>") == PLAIN.num_special + 2
    with pytest.raises(ValueError, match="only role tokens may be added"):
        load_starting_weights(tiny(PLAIN), str(save_pretrained(model, tmp_path / "chat", tokenizer)))


def test_pretraining_sft_and_rl_start_from_the_same_loader(tmp_path, tokenizer):
    from zoo.rl.task import RLTask

    source = tiny(PLAIN, seed=1)
    checkpoint = str(write_checkpoint(source, tokenizer, tmp_path / "pretrain.ckpt"))
    continued = UnifiedPretraining(tiny(PLAIN, seed=3), init_from=checkpoint)
    assert same_weights(continued.model, source)
    assert continued.init_tokenizer.to_json() == tokenizer.to_json()
    sft = SupervisedFineTuning(tiny(CHAT, seed=3), init_from=checkpoint)
    wq = sft.model.backbone.layers[0].attention.wq.weight
    assert torch.equal(wq, source.backbone.layers[0].attention.wq.weight)
    rl = RLTask(tiny(PLAIN, seed=3), init_from=checkpoint)
    assert same_weights(rl.model, source) and rl.init_tokenizer.to_json() == tokenizer.to_json()


@pytest.mark.parametrize("kind", ["checkpoint", "export", "grown vocabulary"])
@pytest.mark.parametrize("inside", [True, False], ids=["zoo fit's deferred build", "a deferred model"])
def test_a_model_built_on_meta_starts_from_the_weights_a_plain_model_loads(tmp_path, tokenizer, kind, inside):
    """FSDP2's meta init (zoo fit under parallel.fsdp builds the task inside `deferred_init`; in Python, a
    model built deferred is handed to the task): the source is read deferred too, nothing is loaded before
    `materialize`, and the materialised weights are those a plain model loads from the same source."""
    from zoo.meta_init import deferred_init, deferred_plan, is_deferred, materialize

    source = tiny(PLAIN, seed=1)
    if kind == "checkpoint":
        where, vocab = str(write_checkpoint(source, tokenizer, tmp_path / "pretrain.ckpt")), PLAIN
    else:
        where = str(save_pretrained(source, tmp_path / "export", tokenizer))
        vocab = CHAT if kind == "grown vocabulary" else PLAIN
    plain = tiny(vocab, seed=2)
    load_starting_weights(plain, where)
    with deferred_init():
        model = tiny(vocab, seed=2)
        if inside:
            load_starting_weights(model, where)
    if not inside:
        load_starting_weights(model, where)
    assert is_deferred(model) and all(p.is_meta for p in model.parameters()), "nothing loaded yet"
    materialize(model, deferred_plan(model))
    assert same_weights(model, plain)
