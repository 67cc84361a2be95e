"""Code shards into `UnifiedPretraining` as a specification (issue 14, item 3): for the same samples, the
documents streamed from code shards equal the documents of the raw media they were made from, down to the
codes the model's own tokenizers produce from those media; shards of other tokenizers are refused, naming
both fingerprints; a short fit on code shards runs without the tokenizers' encoders ever running.

Real files throughout (tests/code_shard_helpers.py): media, tar shards, `zoo tokenize`'s output.
"""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch
from code_shard_helpers import (
    SCALES,
    STRIDE,
    VOCAB,
    Corpus,
    TokenizerFiles,
    unified_model,
    write_corpus,
    write_tokenizers,
)

from zoo.cli import main
from zoo.datamodules.bad_samples import BadSample
from zoo.datamodules.code_records import CodeRecord
from zoo.datamodules.code_shards import CodeDocuments, CodeShardsDataModule, check_record, model_fingerprints
from zoo.datamodules.sequence import MediaLayout, SequenceBuilder
from zoo.datamodules.shards import JsonlLines, TarSamples, read_index
from zoo.datamodules.task_documents import PairedDocuments, TaskWeights, paired_document
from zoo.models.unified import UnifiedModel
from zoo.pretokenize.records import DecodeSettings, decode, manifest_record, tar_record
from zoo.tasks.pretrain import UnifiedPretraining
from zoo.tokenizers.text import TextTokenizer


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> TokenizerFiles:
    return write_tokenizers(tmp_path_factory.mktemp("tokenizers"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def codes(files: TokenizerFiles, corpus: Corpus, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("codes")
    inputs = [str(corpus.manifest), *map(str, corpus.shards)]
    main(["tokenize", *inputs, "--out", str(out), *files.args(), "--lines_per_shard", "5", "--quiet"])
    return out


@pytest.fixture(scope="module")
def model(files: TokenizerFiles) -> UnifiedModel:
    return unified_model(files).eval()


def layout_of(model: UnifiedModel) -> MediaLayout:
    layout = MediaLayout.of(model)
    assert layout.visual_scales == SCALES and layout.temporal_stride == STRIDE
    return layout


def shard_urls(out) -> list[str]:
    return [s.url for s in read_index(out / "index.json")]


def raw_media(record: CodeRecord, corpus: Corpus) -> torch.Tensor:
    """The medium of the raw sample a record was made from, decoded as `zoo tokenize` decodes it."""
    if record.source.endswith(".jsonl"):
        sample = next(s for s in JsonlLines().read(record.source, 0) if s["__key__"] == record.key)
        raw = manifest_record(sample)
    else:
        sample = next(s for s in TarSamples().read(record.source, 0) if s["__key__"] == record.key)
        raw = tar_record(sample)
    assert raw.text == record.text
    return decode(raw, DecodeSettings(image_size=32, video_frames=1 + STRIDE, sample_rate=16000))


def raw_segment(record: CodeRecord, corpus: Corpus):
    from zoo.datamodules.sequence import AudioSegment, VisualSegment

    value = raw_media(record, corpus)
    return AudioSegment(value) if record.kind == "audio" else VisualSegment(value)


def test_code_shards_and_raw_media_give_the_same_documents_and_codes(model, files, corpus, codes):
    documents = PairedDocuments(
        TextTokenizer.byte_level(), VOCAB, TaskWeights(caption=0.5), 0.3, 0.1, 0, True
    )
    layout = layout_of(model)
    stream = CodeDocuments(documents, layout, 512, model_fingerprints(model))
    builder = SequenceBuilder(VOCAB, 512, layout=layout)
    found = [CodeRecord.from_sample(s) for url in shard_urls(codes) for s in TarSamples().read(url, 0)]
    assert len(found) == corpus.manifest_good + corpus.shard_good
    tasks = set()
    for epoch in range(3):
        from_codes = [stream.document(r, epoch) for r in found]
        from_raw = [
            documents(r.kind, r.text, raw_segment(r, corpus), r.source, r.key, epoch)[1] for r in found
        ]
        tasks |= {documents(r.kind, r.text, r.segment(), r.source, r.key, epoch)[0] for r in found}
        coded, raw = builder.collate(from_codes), builder.collate(from_raw)
        for name in ("input_ids", "modality", "group_id", "doc_id", "positions"):
            assert torch.equal(getattr(coded, name), getattr(raw, name)), name
        assert torch.equal(coded.targets["text"], raw.targets["text"])
        for key in ("visual_target", "audio_target", "audio_end"):
            assert torch.equal(coded.payloads[key], raw.payloads[key]), key
        with torch.no_grad():
            media_codes, media_raw = model.encode_media(coded), model.encode_media(raw)
        assert torch.equal(media_codes.visual.tokens, media_raw.visual.tokens)  # the model's own tokenizer
        # The inputs built from those codes agree to float rounding: NFSP computes them per item for given
        # codes and batched for pixels, and a batched conv rounds differently.
        torch.testing.assert_close(
            media_codes.visual.features, media_raw.visual.features, atol=1e-5, rtol=1e-4
        )
        assert torch.equal(media_codes.audio, media_raw.audio)
    assert tasks >= {"text_to_image", "image_to_text", "text_to_audio", "audio_to_text"}


def test_documents_have_the_shapes_of_the_shapes_world_tasks():
    vocab, caption = VOCAB, [VOCAB.text_offset + 5, VOCAB.text_offset + 6]
    image = CodeRecord("image", np.zeros(85, np.uint16), "x", "s", "k", "h", {}, SCALES).segment()
    bos, eos = vocab.bos_id, vocab.eos_id
    generate = paired_document("text_to_image", caption, image, vocab)
    assert [type(s).__name__ for s in generate] == ["TextSegment", "VisualSegment", "TextSegment"]
    assert generate[0].ids == [bos, *caption] and not generate[0].predict and generate[1].predict
    understand = paired_document("image_to_text", caption, image, vocab)
    assert understand[0].ids == [bos] and not understand[1].predict and understand[2].ids == [*caption, eos]
    assert paired_document("text_to_image", caption, image, vocab, uncond=True)[0].ids == [bos]
    with pytest.raises(ValueError, match="does not take a image"):
        paired_document("audio_to_text", caption, image, vocab)


def trainer(root, steps: int = 3) -> L.Trainer:
    quiet = dict(
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    return L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        limit_val_batches=1,
        val_check_interval=2,
        default_root_dir=root,
        **quiet,
    )


def test_shards_of_other_tokenizers_are_refused_naming_both_fingerprints(files, codes, tmp_path):
    other = unified_model(write_tokenizers(tmp_path / "other", seed=1))
    data = CodeShardsDataModule(
        [str(codes / "index.json")], vocab=VOCAB, layout=layout_of(other), seq_len=256
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
    files, corpus, codes, tmp_path
):
    model = unified_model(files)
    visual_calls, audio_calls = (
        NeverRuns(model.visual_tokenizer.encoder),
        NeverRuns(model.audio_codec.encoder),
    )
    index = [str(codes / "index.json")]
    data = CodeShardsDataModule(
        index,
        vocab=VOCAB,
        layout=layout_of(model),
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
    assert data.expected == model_fingerprints(model)
    assert visual_calls.calls == audio_calls.calls == 0
    assert data.bad_samples == 0

    # The checkpoint of that run tokenizes with the model's own tokenizers (`--model` takes it).
    checkpoint = tmp_path / "last.ckpt"
    fit.save_checkpoint(checkpoint)
    out = tmp_path / "again"
    main(["tokenize", str(corpus.shards[1]), "--out", str(out), "--model", str(checkpoint), "--quiet"])
    hashes = {CodeRecord.from_sample(s).tokenizer_hash for s in TarSamples().read(shard_urls(out)[0], 0)}
    assert hashes == set(model_fingerprints(model).values())
