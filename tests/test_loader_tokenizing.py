"""Media tokenized in the dataloader's workers (`tokenize_in_loader=True` of ShapesMultimodalDataModule and
PairedDataModule): the documents carry the frozen tokenizers' codes, and the model's loss is the one it
computes from pixels and waveforms itself."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from paired_corpus import corpus, write_manifest

from zoo.datamodules.loader_tokenizing import TokenizedDocuments, tokenize_document
from zoo.datamodules.paired import PairedDataModule
from zoo.datamodules.sequence import AudioSegment, MediaLayout, VisualSegment
from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule
from zoo.datamodules.sources import ManifestSource
from zoo.datamodules.streaming import StreamDataset
from zoo.models.backbone import UnifiedTransformer
from zoo.models.unified import UnifiedModel
from zoo.tasks.pretrain import UnifiedPretraining
from zoo.tokenizers.audio import AudioCodec
from zoo.tokenizers.visual import VisualTokenizer
from zoo.tokenizers.vocab import UnifiedVocab

EVERY_TASK = dict(caption_weight=1.0, text_to_image_weight=1.0, image_to_text_weight=1.0,
                  text_to_audio_weight=1.0, audio_to_text_weight=1.0)  # fmt: skip


def make_model() -> UnifiedModel:
    torch.manual_seed(0)
    visual, codec = VisualTokenizer(), AudioCodec(kmeans_init=False)
    vocab = UnifiedVocab(text_size=320, visual_size=visual.codebook_size, audio_size=256, audio_levels=4)
    backbone = UnifiedTransformer(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, expert_hidden=16,
                                  top_k=2, max_seq_len=256)  # fmt: skip
    return UnifiedModel(backbone, vocab, mtp_depth=0, visual_tokenizer=visual, audio_codec=codec)


def make_data(model: UnifiedModel, **overrides) -> ShapesMultimodalDataModule:
    args = dict(train_size=16, val_size=4, batch_size=8, seq_len=256, tokenizer_size=300, **EVERY_TASK)
    layout = MediaLayout.of(model)
    return ShapesMultimodalDataModule(vocab=model.vocab, layout=layout, **{**args, **overrides})


def media_kinds(document) -> set[str]:
    kinds = set()
    for segment in document:
        if isinstance(segment, VisualSegment):
            kinds.add("pixels" if segment.pixels is not None else "visual codes")
        elif isinstance(segment, AudioSegment):
            kinds.add("wave" if segment.wave is not None else "audio codes")
    return kinds


def test_tokenized_documents_give_the_loss_the_model_computes_from_pixels_and_waves():
    model = make_model().eval()
    raw = make_data(model)
    raw.setup("fit")
    tokenized = make_data(model)
    tokenized.tokenizer = raw.tokenizer
    tokenized.tokenize_with(model.visual_tokenizer, model.audio_codec)
    tokenized.setup("fit")
    keys = [(i, 0) for i in range(16)]
    raw_docs = [raw.datasets["train"][k] for k in keys]
    docs = [tokenized.loader_dataset("train")[k] for k in keys]
    assert set().union(*map(media_kinds, raw_docs)) == {"pixels", "wave"}
    assert set().union(*map(media_kinds, docs)) == {"visual codes", "audio codes"}
    for first, second in ((raw_docs[:8], docs[:8]), (raw_docs[8:], docs[8:])):
        with torch.no_grad():
            expected = model(raw.builder.collate(first)).loss
            got = model(tokenized.builder.collate(second)).loss
        assert torch.allclose(got, expected, atol=1e-6), (got, expected)


def test_the_copies_are_the_model_s_tokenizers_and_leave_them_alone():
    model = make_model()
    data = make_data(model)
    data.tokenize_with(model.visual_tokenizer, model.audio_codec)
    copies = data.loader_tokenizers
    assert copies.visual is not model.visual_tokenizer and copies.audio is not model.audio_codec
    for mine, theirs in ((copies.visual, model.visual_tokenizer), (copies.audio, model.audio_codec)):
        state = theirs.state_dict()
        assert all(torch.equal(v, state[k]) for k, v in mine.state_dict().items())
    image = torch.rand(3, 32, 32) * 2 - 1
    (segment,) = tokenize_document([VisualSegment(image, predict=False)], copies)
    assert segment.pixels is None and not segment.predict
    codes = model.visual_tokenizer.encode(image[None])
    assert torch.equal(segment.codes, torch.cat([c.flatten() for c in codes]))


def test_an_uninitialised_codec_is_refused_before_any_document_is_made():
    model = make_model()
    with pytest.raises(ValueError, match="never initialised"):
        make_data(model).tokenize_with(None, AudioCodec())


def fit_two_steps(model: UnifiedModel, data: L.LightningDataModule, folder: Path) -> L.Trainer:
    task = UnifiedPretraining(model, lr=1e-3, warmup_steps=1)
    trainer = L.Trainer(accelerator="cpu", max_steps=2, default_root_dir=folder, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, enable_checkpointing=False)  # fmt: skip
    trainer.fit(task, datamodule=data)
    return trainer


def test_a_fit_with_tokenize_in_loader_trains_on_codes_made_in_a_worker(tmp_path):
    model = make_model()
    data = make_data(model, tokenize_in_loader=True, num_workers=1)
    trainer = fit_two_steps(model, data, tmp_path)
    assert trainer.global_step == 2
    assert isinstance(data.loaders["train"].dataset.documents.make, TokenizedDocuments)
    assert not isinstance(data.datasets["train"].make, TokenizedDocuments)  # (the copy is the loader's)
    batch = next(iter(data.train_dataloader()))
    assert batch.visual is not None and batch.visual.image_pixels is None and batch.visual.codes is not None
    assert batch.audio is not None and batch.audio.waves is None and batch.audio.codes is not None


def paired_data(model: UnifiedModel, folder: Path, **overrides) -> PairedDataModule:
    source = ManifestSource([str(write_manifest(folder, corpus(folder, images=4, audio=4, videos=0)))])
    args = dict(val_fraction=0.0, batch_size=4, seq_len=256, tokenizer_size=300, uncond_prob=0.0)
    layout = MediaLayout.of(model)
    return PairedDataModule([source], vocab=model.vocab, layout=layout, **{**args, **overrides})


def test_a_paired_stream_tokenized_in_its_workers_gives_the_loss_of_its_pixels_and_waves(tmp_path):
    model = make_model().eval()
    raw = paired_data(model, tmp_path)
    raw.setup("fit")
    tokenized = paired_data(model, tmp_path, packing="first_fit_decreasing")
    tokenized.tokenizer = raw.tokenizer
    tokenized.setup("fit")
    tokenized.tokenize_with(model.visual_tokenizer, model.audio_codec)
    raw_batches, batches = list(raw.train_dataloader()), list(tokenized.train_dataloader())
    assert len(raw_batches) == len(batches) == 2
    for first, second in zip(raw_batches, batches, strict=True):
        assert first.visual.image_pixels is not None and first.audio.waves is not None
        assert second.visual.image_pixels is None and second.audio.waves is None
        with torch.no_grad():  # rows packed differently; documents never attend across each other
            expected, got = model(first).loss, model(second).loss
        assert torch.allclose(got, expected, atol=1e-5), (got, expected)


def test_a_paired_fit_with_tokenize_in_loader_reads_codes_from_a_worker(tmp_path):
    model = make_model()
    data = paired_data(model, tmp_path, tokenize_in_loader=True, num_workers=1)
    trainer = fit_two_steps(model, data, tmp_path)
    assert trainer.global_step == 2
    stream = data.loaders["train"].dataset
    assert isinstance(stream, StreamDataset) and isinstance(stream.map, TokenizedDocuments)
    batch = next(iter(data.train_dataloader()))
    assert batch.visual is not None and batch.visual.image_pixels is None and batch.visual.codes is not None
    assert batch.audio is not None and batch.audio.waves is None and batch.audio.codes is not None
