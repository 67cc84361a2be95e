"""Paired media as documents (issue 14, items 1 and 5), specified on real files the tests write: every task
gives ShapesWorld's document shape, media may be pixels or codes, a manifest and a tar of the same samples
give the same batches, the mixture weights give the stated samples per epoch, sizes come from the model,
and bad samples are skipped, counted and named."""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from batch_helpers import batch_tensors
from paired_corpus import audio_bytes, corpus, image_bytes, write_interleaved, write_manifest, write_tar

from zoo.batch import IGNORE_INDEX
from zoo.datamodules.bad_samples import BadSample, BadSamplePolicy
from zoo.datamodules.media_samples import InterleavedSample, MediaSpec, PairedSample, decode_media
from zoo.datamodules.paired import PairedDataModule
from zoo.datamodules.paired_documents import (
    TASKS_OF_KIND,
    DocumentMaker,
    MediaSupport,
    TaskWeights,
    draw_task,
)
from zoo.datamodules.sequence import (
    AudioSegment,
    ContextSegment,
    MediaLayout,
    SequenceBuilder,
    TextSegment,
    VisualSegment,
)
from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule
from zoo.datamodules.shards import Shard, write_index
from zoo.datamodules.sources import ManifestSource, TarSource
from zoo.models.backbone import UnifiedTransformer
from zoo.models.unified import UnifiedModel
from zoo.task_names import SHAPES_TASKS as TASKS
from zoo.task_names import Task
from zoo.tokenizers.audio import AudioCodec
from zoo.tokenizers.text import TextTokenizer
from zoo.tokenizers.visual import VisualTokenizer
from zoo.tokenizers.vocab import UnifiedVocab

VOCAB = UnifiedVocab()
SPEC = MediaSpec().resolved_for(None)  # 32-pixel images, 5-frame clips, 16 kHz audio
LENIENT = BadSamplePolicy(max_bad_fraction=1.0, min_samples=1)


def shape(document: list) -> list[tuple]:
    """A document's segments with the words of each text collapsed: what a task's layout is."""
    out = []
    for s in document:
        if isinstance(s, TextSegment):
            marks = "".join("B" if i == VOCAB.bos_id else "E" if i == VOCAB.eos_id else "w" for i in s.ids)
            out.append(("text", re.sub("w+", "w", marks), s.predict))
        elif isinstance(s, VisualSegment):
            out.append(("video" if s.is_video else "image", s.predict))
        elif isinstance(s, AudioSegment):
            out.append(("audio", s.predict))
        else:
            assert isinstance(s, ContextSegment)
            out.append(("context",))
    return out


def maker(**kw) -> DocumentMaker:
    return DocumentMaker(VOCAB, TextTokenizer.byte_level(), MediaLayout(), 512, **kw)


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PairedSample]:
    """One decoded sample per kind, from a non-square JPEG, a 22 kHz FLAC and an MP4."""
    folder = tmp_path_factory.mktemp("media")
    items = {item.kind: item for item in corpus(folder, images=1, audio=1, videos=1)}
    return {
        kind: PairedSample(kind, item.caption, decode_media(kind, item.data, SPEC, name=kind))
        for kind, item in items.items()
    }


def shapes_world(image_context: bool = False, video_context: bool = False) -> ShapesMultimodalDataModule:
    world = ShapesMultimodalDataModule(
        vocab=VOCAB, image_context=image_context, video_context=video_context, video_frames=5
    )
    world.tokenizer = TextTokenizer.byte_level()
    return world


def kind_of_task(task: str) -> str:
    return next((k for k in ("image", "video", "audio") if k in task), "image")


# --- documents ---------------------------------------------------------------------------------


def test_every_task_gives_the_shapesworld_document_shape(media):
    world, make = shapes_world(), maker()
    for task in TASKS:
        expected = shape(world.task_document(task, "val", 0))
        assert shape(make(media[kind_of_task(task)], task)) == expected, task
    assert media["image"].media.pixels.shape == (3, 32, 32)  # the 40x24 JPEG, centre-cropped
    assert media["video"].media.pixels.shape == (3, 5, 32, 32)


def test_guidance_drops_the_caption_exactly_as_shapesworld_does(media):
    world = shapes_world()
    for task in ("text_to_image", "text_to_video"):
        documents = (world.task_document(task, "train", i) for i in range(200))
        unconditional = next(shape(d) for d in documents if len(d[0].ids) == 1)
        assert shape(maker()(media[kind_of_task(task)], task, uncond=True)) == unconditional
        assert unconditional == [("text", "B", True), (kind_of_task(task), True), ("text", "E", True)]


def test_image_context_reads_the_image_through_the_vision_encoder(media):
    expected = shape(shapes_world(image_context=True).task_document("image_to_text", "val", 0))
    assert ("context",) in expected
    assert shape(maker(image_context=True)(media["image"], "image_to_text")) == expected


def test_video_context_reads_the_frames_through_the_vision_encoder_and_only_videos(media):
    world = shapes_world(video_context=True)
    expected = shape(world.task_document("video_to_text", "val", 0))
    assert expected[1] == ("context",)
    assert shape(world.task_document("image_to_text", "val", 0))[1] == ("image", False)  # images: codes
    make = maker(video_context=True)
    assert shape(make(media["video"], "video_to_text")) == expected
    assert make(media["video"], "video_to_text")[1].pixels.shape == (3, 5, 32, 32)
    assert shape(make(media["image"], "image_to_text"))[1] == ("image", False)
    assert shape(make(media["video"], "text_to_video"))[1] == ("video", True)  # generation: still codes
    no_tokenizer = MediaSupport(image=False, video=False, audio=False)
    assert Task.VIDEO_TO_TEXT in no_tokenizer.tasks(image_context=False, video_context=True)
    assert Task.VIDEO_TO_TEXT not in no_tokenizer.tasks(image_context=False)
    assert Task.TEXT_TO_VIDEO not in no_tokenizer.tasks(image_context=False, video_context=True)
    clip_codes = PairedSample("c", "clip", VisualSegment(codes=torch.zeros(2 * 85).long(), video=True))
    with pytest.raises(BadSample, match="video_context reads pixels"):
        make(clip_codes, "video_to_text")
    with pytest.raises(BadSample, match="cannot take context videos"):
        maker(video_context=True, support=MediaSupport(context=False))(media["video"], "video_to_text")


def test_a_prompt_follows_bos_and_is_never_predicted(media):
    prompt = "Describe the image:"
    document = maker()(media["image"], "image_to_text", prompt=prompt)
    opening = document[0]
    assert not opening.predict and opening.ids[0] == VOCAB.bos_id and len(opening.ids) == 1 + len(prompt)
    batch = SequenceBuilder(VOCAB, 512).collate([document])
    assert (batch.targets["text"][0, : len(prompt)] == IGNORE_INDEX).all()  # no prompt token is a target
    assert batch.targets["text"][0, len(prompt)] == VOCAB.special("<boi>")
    generation = maker()(media["image"], "text_to_image", prompt="Draw:")
    assert shape(generation)[0] == ("text", "Bw", False)  # prompt and caption: the condition
    unconditional = maker()(media["image"], "text_to_image", prompt="Draw:", uncond=True)
    assert shape(unconditional)[0] == ("text", "B", True)  # guidance drops the prompt with the caption


def test_codes_in_place_of_pixels_and_waves_make_the_same_documents(media):
    layout = MediaLayout()
    codes = {
        "image": PairedSample("c", "picture", VisualSegment(codes=torch.arange(layout.tokens_per_frame))),
        "video": PairedSample("c", "clip", VisualSegment(codes=torch.zeros(2 * 85).long(), video=True)),
        "audio": PairedSample("c", "sound", AudioSegment(codes=torch.zeros(11, 4, dtype=torch.long))),
    }
    make = maker()
    for task in TASKS:
        kind = kind_of_task(task)
        assert shape(make(codes[kind], task)) == shape(make(media[kind], task)), task
    SequenceBuilder(VOCAB, 512).collate([make(codes[kind_of_task(t)], t) for t in TASKS])
    with pytest.raises(BadSample, match="image_context reads pixels"):
        maker(image_context=True)(codes["image"], "image_to_text")


def test_interleaved_texts_are_predicted_and_media_are_input_or_predicted_by_the_setting(media):
    image = media["image"].media
    sample = InterleavedSample("doc", ("first", image, "second", image, "third"))
    text = ("text", "w", True)
    assert shape(maker()(sample, "interleaved")) == [
        ("text", "B", True), text, ("image", False), text, ("image", False), text, ("text", "E", True),
    ]  # fmt: skip
    assert shape(maker(interleaved_media="predict")(sample, "interleaved"))[2] == ("image", True)
    assert shape(maker(image_context=True)(sample, "interleaved"))[2] == ("context",)
    with pytest.raises(BadSample, match="at least one text"):
        maker()(InterleavedSample("doc", (image,)), "interleaved")


def test_a_document_longer_than_seq_len_and_media_the_model_lacks_are_bad_samples(media):
    short = DocumentMaker(VOCAB, TextTokenizer.byte_level(), MediaLayout(), 40)
    with pytest.raises(BadSample, match=r"text_to_audio document takes \d+ positions .*more than seq_len=40"):
        short(PairedSample("long", "sound", AudioSegment(torch.full((48000,), 0.1))), "text_to_audio")
    no_audio = maker(support=MediaSupport(audio=False))
    with pytest.raises(BadSample, match="cannot take audio"):
        no_audio(media["audio"], "audio_to_text")


def test_the_task_is_drawn_from_seed_epoch_and_index_among_those_the_media_allow(media):
    weights = TaskWeights(text_to_image=2.0, image_to_text=1.0, text_to_audio=1.0)
    supported = MediaSupport().tasks(image_context=False)
    draws = [draw_task(media["image"], weights, supported, 0, 0, i) for i in range(3000)]
    assert draws == [draw_task(media["image"], weights, supported, 0, 0, i) for i in range(3000)]
    counts = Counter(draws)
    assert set(counts) == {"text_to_image", "image_to_text"}  # never an audio task for an image
    assert 1.8 < counts["text_to_image"] / counts["image_to_text"] < 2.2
    assert draws != [draw_task(media["image"], weights, supported, 0, 1, i) for i in range(3000)]
    with pytest.raises(BadSample, match="feeds none of the tasks"):
        draw_task(media["video"], TaskWeights(text_to_video=0, video_to_text=0), supported, 0, 0, 0)


# --- sources and the datamodule ------------------------------------------------------------------


def datamodule(*sources, **kw) -> PairedDataModule:
    kw = {"val_fraction": 0.0, "batch_size": 2, "seq_len": 512, "tokenizer_size": 300, **kw}
    dm = PairedDataModule(list(sources), **kw)
    dm.setup("fit")
    return dm


def epoch(dm: PairedDataModule, number: int) -> list:
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(number)
    return list(loader)


GENERATING = TaskWeights(image_to_text=0.0, video_to_text=0.0, audio_to_text=0.0)
UNDERSTANDING = TaskWeights(text_to_image=0.0, text_to_video=0.0, text_to_audio=0.0)


def test_a_manifest_and_a_tar_of_the_same_samples_give_identical_batches(tmp_path: Path):
    items = corpus(tmp_path)  # JPEG, PNG, FLAC, stereo WAV at 8 kHz, MP4
    manifest, tar = write_manifest(tmp_path, items), write_tar(tmp_path / "shard.tar", items)
    # A manifest line and a tar sample are two samples (their identities, file and key, differ), so each
    # draws its own task: one task per medium makes their documents comparable, each way in turn.
    for tasks in (GENERATING, UNDERSTANDING):
        from_manifest = datamodule(ManifestSource([str(manifest)], tasks=tasks), uncond_prob=0.0)
        from_tar = datamodule(TarSource([str(tar)], tasks=tasks), uncond_prob=0.0)
        assert from_manifest.tokenizer.to_json() == from_tar.tokenizer.to_json()  # the same captions
        for number in (0, 1):
            a, b = epoch(from_manifest, number), epoch(from_tar, number)
            assert len(a) == len(b) == len(items) // 2
            for x, y in zip(a, b, strict=True):
                tx, ty = batch_tensors(x), batch_tensors(y)
                assert tx.keys() == ty.keys()
                assert [k for k in tx if not torch.equal(tx[k], ty[k])] == []
        assert from_manifest.bad_samples == from_tar.bad_samples == 0


def test_a_source_reads_several_manifests_each_relative_to_its_own_folder_and_piped_shards(tmp_path: Path):
    first = write_manifest(tmp_path / "part0", corpus(tmp_path, 2, 0, 0))
    write_manifest(tmp_path / "part1", [type(i)(i.suffix, i.data, f"other {n}") for n, i in
                                        enumerate(corpus(tmp_path, 2, 0, 0))])  # fmt: skip
    dm = datamodule(ManifestSource([str(tmp_path / "part{0,1}" / first.name)]), batch_size=1, uncond_prob=0.0)
    captions = sorted(dm.decode(b.input_ids[0].tolist()) for b in epoch(dm, 0))
    assert captions == ["other 0", "other 1", "picture 0", "picture 1"]
    # Anything webdataset opens, e.g. a `pipe:` command, with its counts from an index.
    items = corpus(tmp_path, 3, 1, 0)
    local = write_tar(tmp_path / "local.tar", items)
    piped = f"pipe:cat {local}"
    write_index(tmp_path / "index.json", [Shard(piped, len(items))])
    a = datamodule(TarSource([str(local)]), tokenizer_size=None)
    b = datamodule(TarSource([piped], index=str(tmp_path / "index.json")), tokenizer_size=None)
    for x, y in zip(epoch(a, 0), epoch(b, 0), strict=True):
        tx, ty = batch_tensors(x), batch_tensors(y)
        assert tx.keys() == ty.keys() and all(torch.equal(tx[k], ty[k]) for k in tx)


def test_interleaved_documents_from_a_manifest_and_a_tar_are_identical(tmp_path: Path):
    manifest, tar = write_interleaved(tmp_path)
    a = datamodule(ManifestSource([str(manifest)]), tokenizer_size=None)
    b = datamodule(TarSource([str(tar)]), tokenizer_size=None)
    for i in range(2):
        x, y = a.datasets["train"][i], b.datasets["train"][i]
        assert shape(x) == shape(y) == [
            ("text", "B", True), ("text", "w", True), ("image", False), ("text", "w", True),
            ("image", False), ("text", "w", True), ("text", "E", True),
        ]  # fmt: skip
        assert all(torch.equal(s.pixels, t.pixels) for s, t in zip(x, y, strict=True) if hasattr(s, "pixels"))


def test_mixture_weights_give_each_source_weight_times_its_size_samples_per_epoch(tmp_path: Path):
    photos = [type(i)(i.suffix, i.data, f"photo {n}") for n, i in enumerate(corpus(tmp_path, 4, 0, 0))]
    manifest = ManifestSource([str(write_manifest(tmp_path, corpus(tmp_path, 6, 0, 0)))], weight=2.0)
    tar = TarSource([str(write_tar(tmp_path / "photos.tar", photos))], weight=0.5)
    only_captioning = TaskWeights(text_to_image=0.0)
    manifest.tasks = tar.tasks = only_captioning
    dm = datamodule(manifest, tar, batch_size=1, uncond_prob=0.0)
    seen = []
    for number in (0, 1):
        captions = [dm.decode(batch.input_ids[0].tolist()) for batch in epoch(dm, number)]
        assert len(captions) == 2 * 6 + 4 // 2
        counts = Counter(captions)
        assert {counts[f"picture {i}"] for i in range(6)} == {2}  # weight 2: every sample twice
        seen.append({c for c in counts if c.startswith("photo")})
        assert len(seen[-1]) == 2 and all(counts[c] == 1 for c in seen[-1])  # weight 0.5: half, once
    assert seen[0] == seen[1]  # the fractional part is a fixed part of the source


def test_sizes_come_from_the_model_and_a_disagreeing_setting_is_refused(tmp_path: Path):
    torch.manual_seed(0)
    backbone = UnifiedTransformer(dim=32, n_layers=1, n_heads=2, n_experts=2, expert_hidden=16, top_k=1)
    model = UnifiedModel(
        backbone,
        VOCAB,
        visual_tokenizer=VisualTokenizer(image_size=16, channels=(8, 16)),
        audio_codec=AudioCodec(sample_rate=8000),
    )
    source = ManifestSource([str(write_manifest(tmp_path, corpus(tmp_path, 1, 1, 0)))])
    dm = PairedDataModule([source])
    dm.resolve_media(model)
    assert (dm.spec.image_size, dm.spec.sample_rate) == (16, 8000)
    assert dm.layout == MediaLayout.of(model) and dm.builder.layout == dm.layout
    assert dm.supported == {"caption", "interleaved", *TASKS_OF_KIND["image"], *TASKS_OF_KIND["audio"]}
    image = decode_media("image", image_bytes(0), dm.spec)
    assert image.pixels.shape == (3, 16, 16)
    with pytest.raises(ValueError, match="media.image_size=32 differs from the model's tokenizer"):
        PairedDataModule([source], media=MediaSpec(image_size=32)).resolve_media(model)
    with pytest.raises(ValueError, match="visual_scales"):
        PairedDataModule([source], layout=MediaLayout(visual_scales=(1, 2, 4))).resolve_media(model)


def write_bad_manifest(folder: Path) -> tuple[Path, list[str]]:
    """Six good images and one line for each way a record can be bad; the reasons the log must name."""
    (folder / "media").mkdir(parents=True)
    good = image_bytes(0)
    for i in range(6):
        (folder / f"media/{i}.jpg").write_bytes(good)
    (folder / "media/cut.jpg").write_bytes(good[: len(good) // 2])
    (folder / "media/noise.png").write_bytes(b"this is not a picture")
    (folder / "media/long.flac").write_bytes(audio_bytes(0, seconds=20.0))
    lines = [json.dumps({"image": f"media/{i}.jpg", "caption": f"picture {i}"}) for i in range(6)]
    bad = {
        json.dumps({"image": "media/missing.jpg", "caption": "x"}): "missing.jpg: no such file",
        json.dumps({"image": "media/cut.jpg", "caption": "x"}): "cut.jpg",
        json.dumps({"image": "media/noise.png", "caption": "x"}): "cannot read image",
        json.dumps({"image": "media/0.jpg", "caption": "   "}): "empty caption",
        '{"image": "media/0.jpg", "caption": ': "invalid JSON",
        json.dumps({"image": "media/0.jpg"}): "no caption",
        json.dumps({"image": "media/0.jpg", "audio": "media/long.flac", "caption": "x"}): "exactly one of",
        json.dumps({"audio": "media/long.flac", "text": "twenty seconds"}): "more than seq_len=256",
    }
    path = folder / "manifest.jsonl"
    path.write_text("\n".join([*lines[:3], *bad, *lines[3:]]) + "\n")
    return path, list(bad.values())


def test_bad_samples_are_replaced_counted_and_named_by_file_and_line(tmp_path: Path, caplog):
    path, reasons = write_bad_manifest(tmp_path)
    dm = datamodule(ManifestSource([str(path)]), seq_len=256, batch_size=1, bad_samples=LENIENT)
    with caplog.at_level(logging.WARNING, logger="zoo.datamodules.bad_samples"):
        batches = epoch(dm, 0)
    assert len(batches) == 6 + len(reasons)  # every bad sample's place taken by a good one
    assert dm.bad_samples == len(reasons)
    logged = [r.getMessage() for r in caplog.records if "bad sample" in r.getMessage()]
    assert len(logged) == len(reasons)
    for reason in reasons:
        assert any(reason in line and str(path) in line for line in logged), reason
    assert all(re.search(r"\[line \d+\]", line) for line in logged)


def test_bad_tar_samples_are_named_by_shard_and_key(tmp_path: Path, caplog):
    import webdataset as wds

    shard = tmp_path / "bad.tar"
    with wds.TarWriter(str(shard)) as sink:
        for i in range(4):
            sink.write({"__key__": f"good{i}", "jpg": image_bytes(i), "txt": f"picture {i}"})
        sink.write({"__key__": "two", "jpg": image_bytes(0), "png": image_bytes(1, format="PNG"), "txt": "x"})
        sink.write({"__key__": "mute", "jpg": image_bytes(0)})
        sink.write({"__key__": "broken", "jpg": b"\xff\xd8 not really a jpeg", "txt": "x"})
        sink.write({"__key__": "badjson", "jpg": image_bytes(0), "json": b"{not json"})
    dm = datamodule(TarSource([str(shard)]), batch_size=1, bad_samples=LENIENT)
    with caplog.at_level(logging.WARNING, logger="zoo.datamodules.bad_samples"):
        assert len(epoch(dm, 0)) == 8
    assert dm.bad_samples == 4
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for key, reason in (("two", "expected one media field"), ("mute", "no caption"),
                        ("broken", "bad.tar:broken.jpg"), ("badjson", "not valid JSON")):  # fmt: skip
        assert re.search(rf"bad.tar \[{key}\].*{re.escape(reason)}", logged), (key, logged)


def test_validation_is_the_tail_of_each_source_read_once_in_file_order(tmp_path: Path):
    items = corpus(tmp_path, 10, 0, 0)
    source = ManifestSource([str(write_manifest(tmp_path, items))], weight=3.0)
    dm = datamodule(source, val_fraction=0.2, batch_size=1)
    (train,), (val,) = dm.splits()["train"][1], dm.splits()["val"][1]
    assert train.samples == 3 * 8 and val.samples == 2
    assert [(s.start, s.samples) for s in val.shards] == [(8, 2)]
    first = list(dm.val_dataloader())
    assert [dm.decode(b.input_ids[0].tolist()) for b in first] == ["picture 8", "picture 9"]
    dm.datasets["val"].epoch = 5
    again = list(dm.val_dataloader())  # the same documents every epoch (tasks drawn as in epoch 0)
    for x, y in zip(first, again, strict=True):
        tx, ty = batch_tensors(x), batch_tensors(y)
        assert tx.keys() == ty.keys() and all(torch.equal(tx[k], ty[k]) for k in tx)


def test_predict_answers_validation_samples_captions_and_files(tmp_path: Path):
    items = corpus(tmp_path, 3, 1, 0)
    manifest = write_manifest(tmp_path, items)
    picture = tmp_path / "mine.jpg"
    picture.write_bytes(image_bytes(7, size=(64, 30)))
    dm = datamodule(
        ManifestSource([str(manifest)]), val_fraction=0.25, predict_samples=1,
        predict_captions=["a red square"], predict_files=[str(picture), str(tmp_path / "gone.png")],
    )  # fmt: skip
    requests = dm.predict_requests()
    named = [(r.task, r.name) for r in requests]
    assert ("image_to_text", "val000") in named or ("audio_to_text", "val000") in named
    assert ("text_to_image", "caption000") in named and ("text_to_audio", "caption000") in named
    assert ("image_to_text", "mine") in named
    gone = next(r for r in requests if r.name == "gone")
    assert gone.error and "gone.png" in gone.error
    caption = next(r for r in requests if r.name == "caption000" and r.task == "text_to_image")
    assert caption.prompt[-1] == VOCAB.special("<boi>")
    image = next(r for r in requests if r.name == "mine")
    assert image.document[1].pixels.shape == (3, 32, 32) and not image.document[1].predict
