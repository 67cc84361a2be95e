"""Code shards into `UnifiedPretraining` as a specification (issue 14, item 3): `CodeShardSource` is a source
of `PairedDataModule` like the raw ones, and for the same samples the documents of the code shards equal
the documents of the raw media they were made from, epoch by epoch (the same task, caption dropping and
BPE-dropout draws, layout and targets), down to the codes the model's own tokenizers produce from those
media; raw and code sources mix in one datamodule; shards of other tokenizers are refused, naming both
fingerprints; a short fit on code shards runs without the tokenizers' encoders ever running.

Real files throughout (tests/code_shard_helpers.py): media, tar shards, `zoo tokenize`'s output.
"""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from batch_helpers import batch_tensors
from code_shard_helpers import (
    SCALES,
    STRIDE,
    VOCAB,
    Corpus,
    TokenizerFiles,
    unified_model,
    write_corpus,
    write_text_tokenizer,
    write_tokenizers,
)

from zoo.batch import GroupBatch
from zoo.cli import main
from zoo.datamodules.bad_samples import SAMPLE_ERRORS, BadSample, BadSamplePolicy
from zoo.datamodules.code_records import CodeRecord
from zoo.datamodules.code_shards import CodeShardSource, check_record, model_fingerprints
from zoo.datamodules.media_samples import PairedSample
from zoo.datamodules.paired import PairedDataModule
from zoo.datamodules.paired_documents import DocumentMaker, TaskWeights
from zoo.datamodules.sequence import MediaLayout, SequenceBuilder
from zoo.datamodules.shards import TarSamples, read_index
from zoo.datamodules.sources import ManifestSource, PairedSource, TarSource
from zoo.models.unified import UnifiedModel
from zoo.tasks.pretrain import UnifiedPretraining
from zoo.tokenizers.text import TextTokenizer

TASKS = TaskWeights(caption=0.5)  # every task of every medium
LENIENT = BadSamplePolicy(max_bad_fraction=1.0, min_samples=1)
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> TokenizerFiles:
    return write_tokenizers(tmp_path_factory.mktemp("tokenizers"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def codes(files: TokenizerFiles, corpus: Corpus, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("codes")
    inputs = [str(corpus.manifest), *map(str, corpus.shards)]
    main(["tokenize", *inputs, "--out", str(out), *files.args(), "--lines_per_shard", "5", "--quiet"])
    return out


@pytest.fixture(scope="module")
def model(files: TokenizerFiles) -> UnifiedModel:
    return unified_model(files).eval()


@pytest.fixture(scope="module")
def text_tokenizer(codes: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """One BPE tokenizer JSON for both paths: the same tokenizer is what makes the same caption ids."""
    texts = [CodeRecord.from_sample(s).text for url in shard_urls(codes) for s in TarSamples().read(url, 0)]
    return str(write_text_tokenizer(tmp_path_factory.mktemp("text") / "tokenizer.json", texts))


def layout_of(model: UnifiedModel) -> MediaLayout:
    layout = MediaLayout.of(model)
    assert layout.visual_scales == SCALES and layout.temporal_stride == STRIDE
    return layout


def shard_urls(out: Path) -> list[str]:
    return [s.url for s in read_index(out / "index.json")]


def attached(dm: PairedDataModule, model: UnifiedModel, root: Path) -> PairedDataModule:
    """`dm` as `zoo fit` sees it: with a trainer whose module holds `model` (sizes, layout, fingerprints)."""
    trainer = L.Trainer(accelerator="cpu", default_root_dir=root, **QUIET)
    trainer.strategy.connect(UnifiedPretraining(model))
    dm.trainer = trainer
    dm.setup("fit")
    return dm


def paired(sources: list[PairedSource], tokenizer: str, **kw: object) -> PairedDataModule:
    kw = {"vocab": VOCAB, "tokenizer": tokenizer, "val_fraction": 0.0, "seq_len": 512, "batch_size": 2,
          "uncond_prob": 0.3, "bpe_dropout": 0.2, **kw}  # fmt: skip
    return PairedDataModule(sources, **kw)


def by_identity(dm: PairedDataModule, epoch: int) -> dict[str, tuple]:
    """identity -> (draw, document) of every good training sample of `dm` in `epoch`, read in file order
    through the datamodule's own map."""
    made, stream, documents = {}, dm.datasets["train"], dm.text_map("train")
    for number, shard in enumerate(stream.shards):
        for offset, sample in enumerate(islice(stream.format.read(shard.url, shard.start), shard.samples)):
            sample.update(__index__=stream.starts[number] + offset, __epoch__=epoch)
            try:
                _, media, drawn = documents.draw(sample)
                made[media.identity] = (drawn, documents(sample))
            except SAMPLE_ERRORS:
                continue  # a bad raw sample: zoo tokenize wrote no record of it
    return made


def assert_same_batches(a: GroupBatch, b: GroupBatch, model: UnifiedModel) -> None:
    """Same layout, texts and targets; the model's own tokenizers give the same codes from both."""
    for name in ("input_ids", "modality", "group_id", "doc_id", "positions"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.targets.keys() == b.targets.keys()
    assert all(torch.equal(a.targets[k], b.targets[k]) for k in a.targets)
    for key in ("visual", "audio", "audio_end"):
        assert (key in a.targets) == (key in b.targets), key
        assert key not in a.targets or torch.equal(a.targets[key], b.targets[key]), key
    with torch.no_grad():
        raw, coded = model.encode_media(a), model.encode_media(b)
    if raw.visual is not None:
        assert torch.equal(raw.visual.tokens, coded.visual.tokens)  # the model's own tokenizer
        # The inputs built from those codes agree to float rounding: NFSP computes them per item for given
        # codes and batched for pixels, and a batched conv rounds differently.
        torch.testing.assert_close(raw.visual.features, coded.visual.features, atol=1e-5, rtol=1e-4)
    assert (raw.audio is None) == (coded.audio is None)
    assert raw.audio is None or torch.equal(raw.audio, coded.audio)


# --- the same documents -----------------------------------------------------------------------------


def test_a_manifest_read_raw_and_from_its_code_shards_gives_the_same_batches_epoch_by_epoch(
    files, corpus, model, text_tokenizer, tmp_path
):
    media = corpus.manifest.parent / "media"
    lines = [
        {"image": str(media / "a.png"), "caption": "a red square"},
        {"audio": str(media / "s.wav"), "text": "hello there"},
        {"image": str(media / "b.jpg"), "caption": "a photo"},
        {"video": str(media / "v.mp4"), "caption": "it moves"},
        {"audio": str(media / "t.flac"), "caption": "a tone"},
        {"image": str(media / "c.png"), "caption": "grey"},
    ]
    manifest = tmp_path / "pairs.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "codes"
    main(["tokenize", str(manifest), "--out", str(out), *files.args(), "--quiet"])

    raw = attached(paired([ManifestSource([str(manifest)], tasks=TASKS)], text_tokenizer), model, tmp_path)
    coded = attached(paired([CodeShardSource([str(out / "index.json")], tasks=TASKS)], text_tokenizer),
                     model, tmp_path)  # fmt: skip
    plain = attached(paired([ManifestSource([str(manifest)], tasks=TASKS)], text_tokenizer, bpe_dropout=0.0),
                     model, tmp_path)  # fmt: skip
    tasks, dropped = set(), False
    for epoch in range(3):
        loaders = [dm.train_dataloader() for dm in (raw, coded, plain)]
        for loader in loaders:
            loader.sampler.set_epoch(epoch)
        a, b, c = (list(loader) for loader in loaders)
        assert len(a) == len(b) == len(lines) // 2
        for x, y in zip(a, b, strict=True):
            assert_same_batches(x, y, model)
        dropped |= any(not torch.equal(x.input_ids, z.input_ids) for x, z in zip(a, c, strict=True))
        draws = {k: drawn for k, (drawn, _) in by_identity(raw, epoch).items()}
        assert draws == {k: drawn for k, (drawn, _) in by_identity(coded, epoch).items()}
        assert len(draws) == len(lines)
        tasks |= {drawn.task for drawn in draws.values()}
    assert raw.bad_samples == coded.bad_samples == 0
    assert coded.sources[0].expected == model_fingerprints(model)  # checked against the model
    assert dropped, "BPE-dropout changed no caption"
    assert tasks >= {"text_to_image", "image_to_text", "text_to_audio", "audio_to_text"}


def test_interleaved_documents_read_raw_and_from_their_code_shards_give_the_same_batches(
    files, corpus, model, text_tokenizer, tmp_path
):
    media = corpus.manifest.parent / "media"
    lines = [
        {"segments": [{"text": "look:"}, {"image": str(media / "a.png")}, {"text": "a red square"}]},
        {"segments": [{"image": str(media / "b.jpg")}, {"text": "then"}, {"audio": str(media / "s.wav")},
                      {"text": "and"}, {"video": str(media / "v.mp4")}]},
        {"segments": [{"text": "only words here"}]},
        {"segments": [{"text": "two"}, {"image": str(media / "c.png")}, {"image": str(media / "a.png")}]},
        {"segments": [{"text": "broken"}, {"image": str(media / "broken.png")}]},  # a bad sample, listed
    ]  # fmt: skip
    manifest = tmp_path / "pages.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "codes"
    main(["tokenize", str(manifest), "--out", str(out), *files.args(), "--quiet"])
    (state,) = [json.loads(p.read_text()) for p in (out / "progress").glob("*.json")]
    assert state["kinds"] == {"interleaved": 4} and len(state["failures"]) == 1
    assert "broken.png" in state["failures"][0]["reason"]

    lenient = {"bad_samples": LENIENT}
    raw = attached(paired([ManifestSource([str(manifest)])], text_tokenizer, **lenient), model, tmp_path)
    coded = attached(paired([CodeShardSource([str(out / "index.json")])], text_tokenizer), model, tmp_path)
    for epoch in range(2):
        from_raw, from_codes = by_identity(raw, epoch), by_identity(coded, epoch)
        assert from_raw.keys() == from_codes.keys() and len(from_codes) == 4
        assert [from_raw[k][0] for k in from_raw] == [from_codes[k][0] for k in from_raw]
        assert {drawn.task for drawn, _ in from_codes.values()} == {"interleaved"}
        builder = SequenceBuilder(VOCAB, 512, layout=layout_of(model))
        a = builder.collate([from_raw[k][1] for k in from_raw])
        b = builder.collate([from_codes[k][1] for k in from_raw])
        assert_same_batches(a, b, model)
        kinds = {type(s).__name__ for _, doc in from_codes.values() for s in doc}
        assert {"VisualSegment", "AudioSegment", "TextSegment"} <= kinds


def test_code_shards_and_raw_media_give_the_same_draws_documents_and_codes(
    model, corpus, codes, text_tokenizer, tmp_path
):
    shards = [str(p) for p in corpus.shards]
    raw_sources = [ManifestSource([str(corpus.manifest)], tasks=TASKS), TarSource(shards, tasks=TASKS)]
    raw = attached(paired(raw_sources, text_tokenizer), model, tmp_path)
    coded = attached(paired([CodeShardSource([str(codes / "index.json")], tasks=TASKS)], text_tokenizer),
                     model, tmp_path)  # fmt: skip
    coded.sources[0].check_model(model, coded.layout)  # as its loaders do
    builder = SequenceBuilder(VOCAB, 512, layout=layout_of(model))
    tasks = set()
    for epoch in range(3):
        from_raw, from_codes = by_identity(raw, epoch), by_identity(coded, epoch)
        assert len(from_codes) == corpus.manifest_good + corpus.shard_good
        assert from_raw.keys() == from_codes.keys()
        draws = [from_raw[k][0] for k in from_raw]
        assert draws == [from_codes[k][0] for k in from_raw]  # task, caption dropped, dropout seed
        tasks |= {drawn.task for drawn, _ in from_codes.values()}
        a = builder.collate([from_raw[k][1] for k in from_raw])
        b = builder.collate([from_codes[k][1] for k in from_raw])
        assert_same_batches(a, b, model)
    assert tasks >= {"text_to_image", "image_to_text", "text_to_audio", "audio_to_text"}


def test_documents_of_code_records_have_the_shapes_of_the_shapes_world_tasks():
    vocab, make = VOCAB, DocumentMaker(VOCAB, TextTokenizer.byte_level(), MediaLayout(), 512)
    image = CodeRecord("image", np.zeros(85, np.uint16), "x", "s", "k", "h", {}, SCALES).segment()
    sample = PairedSample("s [k]", "ab", image, "s#k")
    caption = make.ids("ab")
    bos, eos = vocab.bos_id, vocab.eos_id
    generate = make(sample, "text_to_image")
    assert [type(s).__name__ for s in generate] == ["TextSegment", "VisualSegment", "TextSegment"]
    assert generate[0].ids == [bos, *caption] and not generate[0].predict and generate[1].predict
    understand = make(sample, "image_to_text")
    assert understand[0].ids == [bos] and not understand[1].predict and understand[2].ids == [*caption, eos]
    assert make(sample, "text_to_image", uncond=True)[0].ids == [bos]
    with pytest.raises(ValueError, match="a image sample cannot make a audio_to_text document"):
        make(sample, "audio_to_text")


# --- raw and codes together; the model's tokenizers -----------------------------------------------------


def test_raw_and_code_sources_mix_in_one_datamodule(model, corpus, codes, text_tokenizer, tmp_path):
    sources: list[PairedSource] = [
        ManifestSource([str(corpus.manifest)], tasks=TASKS),
        CodeShardSource([str(codes / "index.json")]),
    ]
    dm = attached(paired(sources, text_tokenizer, batch_size=4, bad_samples=LENIENT), model, tmp_path)
    payloads = set()
    for batch in dm.train_dataloader():
        payloads |= set(batch_tensors(batch))
        with torch.no_grad():
            assert torch.isfinite(model(batch).loss)
    assert {"visual.codes", "audio.codes"} <= payloads  # from the code shards
    assert {"visual.image_pixels", "audio.waves"} <= payloads  # from the raw manifest
    assert dm.bad_samples == len(corpus.manifest_bad)  # the manifest's own; the code records are all good


def trainer(root, steps: int = 3) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        limit_val_batches=1,
        val_check_interval=2,
        default_root_dir=root,
        **QUIET,
    )


def test_shards_of_other_tokenizers_are_refused_naming_both_fingerprints(
    files, codes, text_tokenizer, tmp_path
):
    other = unified_model(write_tokenizers(tmp_path / "other", seed=1))
    data = PairedDataModule(
        [CodeShardSource([str(codes / "index.json")])], vocab=VOCAB, tokenizer=text_tokenizer, seq_len=256
    )
    mine, theirs = model_fingerprints(unified_model(files)), model_fingerprints(other)
    with pytest.raises(ValueError, match="refusing the code shard") as error:
        trainer(tmp_path).fit(UnifiedPretraining(other, warmup_steps=1), datamodule=data)
    message = str(error.value)
    assert any(mine[n] in message and theirs[n] in message for n in mine)
    record = CodeRecord.from_sample(next(TarSamples().read(shard_urls(codes)[0], 0)))
    with pytest.raises(BadSample, match="fingerprint"):  # a record deeper in a shard: a bad sample
        check_record(record, theirs, layout_of(other))


class NeverRuns(torch.nn.Module):
    """Counts the calls of a tokenizer's encoder (a real forward hook, not a stand-in)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.calls = 0
        module.register_forward_hook(self.count)

    def count(self, *_: object) -> None:
        self.calls += 1


def test_unified_pretraining_fits_on_code_shards_without_running_the_tokenizers(
    files, corpus, codes, text_tokenizer, tmp_path
):
    model = unified_model(files)
    visual_calls, audio_calls = (
        NeverRuns(model.visual_tokenizer.encoder),
        NeverRuns(model.audio_codec.encoder),
    )
    source = CodeShardSource([str(codes / "index.json")])
    data = PairedDataModule(
        [source],
        vocab=VOCAB,
        tokenizer=text_tokenizer,
        seq_len=256,
        batch_size=2,
        val_fraction=0.2,
        num_workers=1,
    )
    task = UnifiedPretraining(model, lr=1e-3, warmup_steps=1)
    fit = trainer(tmp_path)
    fit.fit(task, datamodule=data)
    assert fit.global_step == 3
    assert torch.isfinite(fit.callback_metrics["val_loss"])
    assert source.expected == model_fingerprints(model)
    assert data.layout == layout_of(model)
    assert visual_calls.calls == audio_calls.calls == 0
    assert data.bad_samples == 0

    # The checkpoint of that run tokenizes with the model's own tokenizers (`--model` takes it).
    checkpoint = tmp_path / "last.ckpt"
    fit.save_checkpoint(checkpoint)
    out = tmp_path / "again"
    main(["tokenize", str(corpus.shards[1]), "--out", str(out), "--model", str(checkpoint), "--quiet"])
    hashes = {CodeRecord.from_sample(s).tokenizer_hash for s in TarSamples().read(shard_urls(out)[0], 0)}
    assert hashes == set(model_fingerprints(model).values())
