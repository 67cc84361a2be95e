"""Specifications of the data side: packing into group batches (zoo/datamodules/sequence.py), text files
(text.py), reproducible epochs and BPE-dropout (documents.py) and ShapesWorld captions (shapes_data.py).

Real small files in tmp_path, no mocks.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import lightning as L
import pytest
import torch

from zoo.batch import IGNORE_INDEX, PAD_DOC, GroupBatch, Modality
from zoo.datamodules.sequence import SequenceBuilder, TextSegment
from zoo.datamodules.shapes_data import ShapesDataModule
from zoo.datamodules.text import TextFilesDataModule, read_documents
from zoo.tokenizers.text import TextTokenizer
from zoo.tokenizers.vocab import UnifiedVocab

VOCAB = UnifiedVocab(text_size=512, visual_size=64, audio_size=16, audio_levels=2)
WORDS = "the a red blue green yellow circle square triangle small large near far from left right top".split()


def text_ids(n: int, start: int = 0) -> list[int]:
    """`n` distinct unified text ids."""
    return [VOCAB.text_offset + start + i for i in range(n)]


def doc(*lengths: int, start: int = 0) -> list[TextSegment]:
    segments, offset = [], start
    for n in lengths:
        segments.append(TextSegment(text_ids(n, offset)))
        offset += n
    return segments


def sentences(seed: int, n: int, words: tuple[int, int] = (6, 12)) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))).capitalize() + "." for _ in range(n)
    ]


# --- SequenceBuilder ---------------------------------------------------------------------------------


def test_documents_are_packed_greedily_in_their_order_never_back_into_an_earlier_row():
    builder = SequenceBuilder(VOCAB, seq_len=8)
    # 5 | 4 + 3: a first-fit packer would put the 3 beside the 5; greedy-in-order opens no old row.
    rows = builder.pack([doc(5), doc(4), doc(3)])
    assert [[len(d[0]) for d in row] for row in rows] == [[5], [4, 3]]
    # A document that exactly fills the rest of a row stays in it.
    rows = builder.pack([doc(3), doc(4), doc(2), doc(6)])
    assert [[len(d[0]) for d in row] for row in rows] == [[3, 4], [2, 6]]


def test_first_fit_decreasing_packs_longest_first_into_the_first_row_with_room():
    builder = SequenceBuilder(VOCAB, seq_len=8, packing="first_fit_decreasing")
    # In order this is 5 | 4 + 3 | 4: three rows. Longest first, the 3 goes back beside the 5: two rows.
    rows = builder.pack([doc(5), doc(4), doc(3), doc(4)])
    assert [[len(d[0]) for d in row] for row in rows] == [[5, 3], [4, 4]]
    builder.packing = "in_order"
    assert len(builder.pack([doc(5), doc(4), doc(3), doc(4)])) == 3
    with pytest.raises(ValueError, match="packing must be one of"):
        builder.packing = "best_fit"


def test_collate_lays_out_doc_ids_groups_positions_and_next_token_targets_per_document():
    builder = SequenceBuilder(VOCAB, seq_len=8)
    a, b, c, d = doc(3, start=0), doc(4, start=10), doc(2, start=20), doc(6, start=30)
    batch = builder.collate([a, b, c, d])
    assert isinstance(batch, GroupBatch)
    assert batch.input_ids.shape == (2, 8) and batch.positions.shape == (3, 2, 8)
    assert batch.doc_id.tolist() == [[0, 0, 0, 1, 1, 1, 1, PAD_DOC], [0, 0, 1, 1, 1, 1, 1, 1]]
    assert batch.group_id.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 0, 1, 2, 3, 4, 5]]
    # Text is one token per group: every (t, h, w) coordinate is the index within the document.
    for axis in range(3):
        assert batch.positions[axis, 0, :7].tolist() == [0, 1, 2, 0, 1, 2, 3]
        assert batch.positions[axis, 1].tolist() == [0, 1, 0, 1, 2, 3, 4, 5]
    ia, ib, ic, id_ = a[0].ids, b[0].ids, c[0].ids, d[0].ids
    assert batch.input_ids.tolist() == [[*ia, *ib, VOCAB.pad_id], [*ic, *id_]]
    ign = IGNORE_INDEX
    assert batch.targets["text"].tolist() == [
        [ia[1], ia[2], ign, ib[1], ib[2], ib[3], ign, ign],
        [ic[1], ign, *id_[1:], ign],
    ]


def test_padding_positions_belong_to_no_document_and_have_pad_modality():
    batch = SequenceBuilder(VOCAB, seq_len=8).collate([doc(5), doc(4)])
    pad = batch.doc_id == PAD_DOC
    assert pad.sum() == 16 - 9
    assert (batch.modality[pad] == Modality.PAD).all()
    assert (batch.modality[~pad] == Modality.TEXT).all()
    assert (batch.input_ids[pad] == VOCAB.pad_id).all()
    assert (batch.targets["text"][pad] == IGNORE_INDEX).all()
    assert batch.valid.tolist() == (~pad).tolist()


def test_context_segments_are_inputs_but_never_targets():
    prompt = TextSegment(text_ids(3), predict=False)
    answer = TextSegment(text_ids(3, start=100))
    batch = SequenceBuilder(VOCAB, seq_len=8).collate([[prompt, answer]])
    assert batch.input_ids[0, :6].tolist() == [*prompt.ids, *answer.ids]
    # Position i predicts token i+1: the prompt's tokens 1 and 2 are never targets, the answer's all are.
    assert batch.targets["text"][0].tolist() == [IGNORE_INDEX, IGNORE_INDEX, *answer.ids, *[IGNORE_INDEX] * 3]
    targets = set(batch.targets["text"].flatten().tolist())
    assert not targets & set(prompt.ids)


def test_a_one_token_document_has_no_target():
    batch = SequenceBuilder(VOCAB, seq_len=4).collate([doc(1), doc(2, start=5)])
    second = text_ids(2, start=5)
    assert batch.targets["text"][0].tolist() == [IGNORE_INDEX, second[1], IGNORE_INDEX, IGNORE_INDEX]


@pytest.mark.parametrize("bad", [-1, VOCAB.visual_offset, VOCAB.size + 5])
def test_ids_outside_specials_and_text_are_refused(bad: int):
    with pytest.raises(
        ValueError, match=rf"token id {bad} is outside the allowed range 0\.\.{VOCAB.visual_offset - 1}"
    ):
        SequenceBuilder(VOCAB, seq_len=8).collate([[TextSegment([VOCAB.bos_id, bad])]])


def test_an_empty_document_is_refused():
    builder = SequenceBuilder(VOCAB, seq_len=8)
    with pytest.raises(ValueError, match="empty document"):
        builder.collate([doc(2), [TextSegment([])]])
    with pytest.raises(ValueError, match="empty document"):
        builder.collate([[]])


def test_no_documents_and_too_short_rows_are_refused():
    with pytest.raises(ValueError, match="no documents"):
        SequenceBuilder(VOCAB, seq_len=8).collate([])
    with pytest.raises(ValueError, match="seq_len must be >= 2"):
        SequenceBuilder(VOCAB, seq_len=1)


def test_an_over_long_document_is_refused_naming_both_lengths():
    with pytest.raises(ValueError, match=r"document of 10 tokens is longer than seq_len=8.*truncate=True"):
        SequenceBuilder(VOCAB, seq_len=8).collate([doc(4, 6)])


def test_truncate_cuts_an_over_long_document_to_seq_len_with_a_warning():
    builder = SequenceBuilder(VOCAB, seq_len=8, truncate=True)
    long = doc(4, 6)
    with pytest.warns(UserWarning, match="truncating documents longer than seq_len=8"):
        batch = builder.collate([long, doc(3)])
    flat = [*long[0].ids, *long[1].ids]
    assert batch.input_ids[0].tolist() == flat[:8]
    assert batch.doc_id[0].tolist() == [0] * 8
    assert batch.targets["text"][0].tolist() == [*flat[1:8], IGNORE_INDEX]
    assert batch.doc_id[1].tolist()[:3] == [0, 0, 0]


# --- text files ----------------------------------------------------------------------------------------


def write_txt(path: Path, docs: list[str]) -> Path:
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text(
        "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8"
    )
    return path


def test_txt_files_give_one_document_per_blank_line_separated_paragraph(tmp_path: Path):
    path = tmp_path / "a.txt"
    path.write_text("First paragraph\nstill first.\n\n\n  Second, café ☃.  \n \n\nThird\n", encoding="utf-8")
    assert read_documents(path) == ["First paragraph\nstill first.", "Second, café ☃.", "Third"]


def test_paragraphs_are_read_line_by_line_exactly_as_a_whole_file_split_on_blank_lines(tmp_path: Path):
    # The streamed reader holds one paragraph at a time; it must agree with re.split(r"\n\s*\n") on the
    # whole text: CRLF and lone CR endings, whitespace-only lines, runs of blank lines, Unicode spaces.
    rng = random.Random(7)
    pieces = ["word", "two words", " lead", "trail ", "\t", " ", "\u2028", "\u00a0x", "é☃", ""]
    endings = ["\n", "\r\n", "\r"]
    path = tmp_path / "p.txt"
    for _ in range(200):
        text = "".join(rng.choice(pieces) + rng.choice(endings) for _ in range(rng.randint(0, 12)))
        path.write_bytes(text.encode("utf-8"))
        normalised = text.replace("\r\n", "\n").replace("\r", "\n")
        expected = [p.strip() for p in re.split(r"\n\s*\n", normalised) if p.strip()]
        assert read_documents(path) == expected, repr(text)


def test_a_file_that_is_not_utf8_is_refused_naming_the_byte(tmp_path: Path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("first\n\ncafé\n".encode("latin-1"))
    with pytest.raises(
        ValueError, match=rf"{path} is not valid UTF-8 \(invalid continuation byte at byte 10\)"
    ):
        read_documents(path)


def test_jsonl_files_give_the_text_field_of_each_line_skipping_blank_lines(tmp_path: Path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "one\\n\\ntwo"}\n\n{"text": "日本語", "meta": 3}\n', encoding="utf-8")
    assert read_documents(path) == ["one\n\ntwo", "日本語"]


def test_a_bad_json_line_is_refused_naming_the_file_and_line(tmp_path: Path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": oops}\n', encoding="utf-8")
    dm = TextFilesDataModule([str(path)])
    with pytest.raises(ValueError, match=rf"{path}:2: invalid JSON"):
        dm.setup("fit")
    path.write_text('{"text": "fine"}\n{"body": "no text"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=rf'{path}:2: expected an object with a string "text" field'):
        read_documents(path)


def test_a_missing_file_is_refused_naming_the_path(tmp_path: Path):
    missing = tmp_path / "nowhere.txt"
    dm = TextFilesDataModule([str(missing)])
    with pytest.raises(FileNotFoundError, match=str(missing)):
        dm.setup("fit")


def test_an_unsupported_file_type_is_refused(tmp_path: Path):
    path = tmp_path / "table.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(
        ValueError, match=r"table\.csv: unsupported text file type '\.csv'; use \.txt, \.md or \.jsonl"
    ):
        TextFilesDataModule([str(path)]).setup("fit")


def test_no_training_files_are_refused():
    with pytest.raises(ValueError, match="train_files is empty"):
        TextFilesDataModule([])


def test_validation_is_the_tail_of_the_training_documents_when_no_val_files_are_given(tmp_path: Path):
    docs = sentences(0, 20)
    dm = TextFilesDataModule([str(write_txt(tmp_path / "a.txt", docs))], val_fraction=0.25)
    assert dm.texts("train") == docs[:15] and dm.texts("val") == docs[15:]
    separate = TextFilesDataModule(
        [str(write_txt(tmp_path / "a.txt", docs))],
        val_files=[str(write_jsonl(tmp_path / "v.jsonl", ["held out"]))],
    )
    assert separate.texts("train") == docs and separate.texts("val") == ["held out"]


def test_files_are_read_in_order_txt_and_jsonl_together(tmp_path: Path):
    a, b = sentences(1, 3), sentences(2, 4)
    dm = TextFilesDataModule(
        [str(write_txt(tmp_path / "a.txt", a)), str(write_jsonl(tmp_path / "b.jsonl", b))],
        val_files=[str(write_txt(tmp_path / "v.txt", ["v"]))],
    )
    assert dm.texts("train") == a + b


def test_the_default_tokenizer_is_byte_level_and_a_batch_is_a_group_batch_that_decodes_back(tmp_path: Path):
    # 35 bytes (multi-byte characters included) + <bos>/<eos>: exactly one document per 64-position row.
    rng = random.Random(3)
    docs = ["x" + "".join(rng.choice("abcd ") for _ in range(28)) + "é☃." for _ in range(12)]
    dm = TextFilesDataModule(
        [str(write_txt(tmp_path / "a.txt", docs))], vocab=VOCAB, seq_len=64, batch_size=4, val_fraction=0.25
    )
    dm.setup("fit")
    assert dm.tokenizer.vocab_size == 256
    first = dm.datasets["train"][0]
    assert first[0].ids == [
        VOCAB.bos_id,
        *(b + VOCAB.text_offset for b in docs[0].encode("utf-8")),
        VOCAB.eos_id,
    ]
    batch = next(iter(dm.train_dataloader()))
    assert isinstance(batch, GroupBatch)
    assert batch.input_ids.shape == (4, 64) and batch.positions.shape == (3, 4, 64)
    assert batch.targets["text"].shape == (4, 64)
    order = indices(dm.train_dataloader().sampler)
    for row in range(4):
        ids = batch.input_ids[row][batch.valid[row]].tolist()
        assert ids[0] == VOCAB.bos_id and ids[-1] == VOCAB.eos_id
        assert dm.decode(ids) == docs[order[row]]
    val = next(iter(dm.val_dataloader()))
    assert [dm.decode(val.input_ids[r][val.valid[r]].tolist()) for r in range(3)] == docs[9:]


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return sentences(4, 60)


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory, corpus: list[str]) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    TextTokenizer.train(corpus, vocab_size=320).save(path)
    return path


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory: pytest.TempPathFactory, corpus: list[str]) -> Path:
    return write_txt(tmp_path_factory.mktemp("corpus") / "corpus.txt", corpus)


def text_dm(corpus_file: Path, tokenizer: Path | None, **kwargs) -> TextFilesDataModule:
    args = dict(vocab=VOCAB, seq_len=128, batch_size=8, val_fraction=0.2)
    dm = TextFilesDataModule(
        [str(corpus_file)], tokenizer=str(tokenizer) if tokenizer else None, **{**args, **kwargs}
    )
    dm.setup("fit")
    return dm


def test_a_trained_tokenizer_file_is_used_when_given(
    corpus_file: Path, tokenizer_path: Path, corpus: list[str]
):
    dm = text_dm(corpus_file, tokenizer_path)
    trained = TextTokenizer.load(tokenizer_path)
    assert dm.tokenizer.to_json() == trained.to_json()
    ids = dm.datasets["train"][0][0].ids
    assert ids == [VOCAB.bos_id, *(i + VOCAB.text_offset for i in trained.encode(corpus[0])), VOCAB.eos_id]
    assert len(ids) - 2 < len(corpus[0].encode("utf-8"))  # merges happened: not the byte tokenizer
    assert dm.decode(ids) == corpus[0]


def test_a_tokenizer_larger_than_the_text_vocabulary_is_refused_at_setup(
    corpus_file: Path, tokenizer_path: Path
):
    size = TextTokenizer.load(tokenizer_path).vocab_size
    small = UnifiedVocab(text_size=300, visual_size=64, audio_size=16, audio_levels=2)
    dm = TextFilesDataModule([str(corpus_file)], tokenizer=str(tokenizer_path), vocab=small)
    with pytest.raises(
        ValueError, match=rf"tokenizer has {size} ids .* text_size=300: raise vocab.text_size"
    ):
        dm.setup("fit")


# --- reproducible epochs and BPE-dropout -----------------------------------------------------------------


def batches(dm: L.LightningDataModule, epoch: int, split: str = "train") -> list[torch.Tensor]:
    loader = dm.train_dataloader() if split == "train" else dm.val_dataloader()
    loader.sampler.set_epoch(epoch)
    return [b.input_ids for b in loader]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True)
    )


def indices(sampler) -> list[int]:
    """The document indices of a sampler that yields (index, epoch) pairs."""
    return [index for index, _ in sampler]


def test_the_train_order_is_a_function_of_seed_and_epoch(corpus_file: Path):
    one, two = text_dm(corpus_file, None, seed=5), text_dm(corpus_file, None, seed=5)
    assert same(batches(one, 0), batches(two, 0))
    assert indices(one.train_dataloader().sampler) == indices(two.train_dataloader().sampler)
    order0 = indices(one.train_dataloader().sampler)
    one.train_dataloader().sampler.set_epoch(1)
    assert indices(one.train_dataloader().sampler) != order0
    assert sorted(indices(one.train_dataloader().sampler)) == sorted(order0)
    assert {epoch for _, epoch in one.train_dataloader().sampler} == {1}  # the epoch travels with each index
    assert not same(batches(one, 1), batches(two, 0))
    assert same(batches(one, 1), batches(two, 1))
    assert same(batches(one, 0), batches(two, 0))  # going back to an epoch gives it back exactly
    assert not same(batches(text_dm(corpus_file, None, seed=6), 0), batches(two, 0))


def test_validation_order_is_fixed(corpus_file: Path):
    dm = text_dm(corpus_file, None)
    assert indices(dm.val_dataloader().sampler) == list(range(len(dm.texts("val"))))


def dropout_dm(corpus_file: Path, tokenizer_path: Path, **kwargs) -> TextFilesDataModule:
    return text_dm(corpus_file, tokenizer_path, bpe_dropout=0.3, seed=1, **kwargs)


def test_bpe_dropout_segments_documents_differently_across_epochs_but_decodes_the_same(
    corpus_file: Path, tokenizer_path: Path, corpus: list[str]
):
    dm = dropout_dm(corpus_file, tokenizer_path)
    train = dm.datasets["train"]
    dm.train_dataloader().sampler.set_epoch(0)
    epoch0 = [train[i][0].ids for i in range(len(train))]
    dm.train_dataloader().sampler.set_epoch(1)
    epoch1 = [train[i][0].ids for i in range(len(train))]
    assert epoch0 != epoch1
    deterministic = TextTokenizer.load(tokenizer_path)
    plain = [
        [VOCAB.bos_id, *(t + VOCAB.text_offset for t in deterministic.encode(c)), VOCAB.eos_id]
        for c in corpus
    ]
    assert epoch0 != plain[: len(train)]
    for i, (a, b) in enumerate(zip(epoch0, epoch1, strict=True)):
        assert dm.decode(a) == dm.decode(b) == corpus[i]


def test_bpe_dropout_is_identical_for_the_same_seed_and_epoch(corpus_file: Path, tokenizer_path: Path):
    one, two = dropout_dm(corpus_file, tokenizer_path), dropout_dm(corpus_file, tokenizer_path)
    for epoch in (0, 1, 0):
        assert same(batches(one, epoch), batches(two, epoch))
    assert not same(batches(one, 0), batches(one, 1))


def test_validation_never_uses_bpe_dropout(corpus_file: Path, tokenizer_path: Path):
    dm = dropout_dm(corpus_file, tokenizer_path)
    tok = TextTokenizer.load(tokenizer_path)
    val_texts = dm.texts("val")
    for epoch in (0, 1, 2):
        dm.train_dataloader().sampler.set_epoch(epoch)
        val = dm.datasets["val"]
        val.sampler.set_epoch(epoch)
        for i, text in enumerate(val_texts):
            assert val[i][0].ids == [
                VOCAB.bos_id,
                *(t + VOCAB.text_offset for t in tok.encode(text)),
                VOCAB.eos_id,
            ]


def test_bpe_dropout_with_dataloader_workers_matches_the_single_process_draws(
    corpus_file: Path, tokenizer_path: Path
):
    reference = dropout_dm(corpus_file, tokenizer_path)
    workers = dropout_dm(corpus_file, tokenizer_path, num_workers=1)
    loader = workers.train_dataloader()  # one loader across epochs, as Lightning's fit loop keeps it
    for epoch in (0, 1):
        loader.sampler.set_epoch(epoch)
        assert same([b.input_ids for b in loader], batches(reference, epoch)), f"epoch {epoch} differs"


# --- ShapesWorld ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shapes() -> ShapesDataModule:
    dm = ShapesDataModule(train_size=128, val_size=16, batch_size=16, seq_len=128, prompts=["a red", ""])
    dm.setup("fit")
    return dm


def test_shapes_setup_trains_a_tokenizer_that_fits_the_vocabulary(shapes: ShapesDataModule):
    assert shapes.tokenizer is not None
    assert 256 < shapes.tokenizer.vocab_size <= shapes.tokenizer_size <= shapes.vocab.text_size
    caption = shapes.texts("train")[0]
    assert len(shapes.tokenizer.encode(caption)) < len(caption.encode("utf-8"))


def test_shapes_batches_are_group_batches_of_whole_captions(shapes: ShapesDataModule):
    batch = next(iter(shapes.train_dataloader()))
    assert isinstance(batch, GroupBatch) and batch.seq_len == 128
    assert int((batch.input_ids == shapes.vocab.bos_id).sum()) == 16  # the 16 captions of the batch
    decoded = shapes.decode(batch.input_ids[0][batch.doc_id[0] == 0].tolist())
    assert decoded in shapes.texts("train")


def test_score_text_reads_captions_of_its_world_and_rejects_garbage(shapes: ShapesDataModule):
    training = shapes.texts("train")[0]
    assert shapes.score_text(training) == {"grammatical": 1.0, "novel": 0.0}
    test_caption = shapes.world.caption(
        shapes.world.scene(0, "test")
    )  # has a held-out pair: never trained on
    assert shapes.score_text(test_caption) == {"grammatical": 1.0, "novel": 1.0}
    for garbage in ("purple banana sings loudly", "", "a red"):
        assert shapes.score_text(garbage)["grammatical"] == 0.0


def test_the_shapes_tokenizer_travels_in_the_datamodule_state(shapes: ShapesDataModule, tmp_path: Path):
    state = shapes.state_dict()
    torch.save(state, tmp_path / "dm.pt")
    restored = torch.load(tmp_path / "dm.pt", weights_only=True)  # plain strings: safe to load
    other = ShapesDataModule(world_seed=7, train_size=64, val_size=8)  # would train another tokenizer
    other.load_state_dict(restored)
    other.setup("fit")
    assert other.tokenizer.to_json() == shapes.tokenizer.to_json()
    caption = shapes.texts("val")[0]
    assert other.tokenizer.encode(caption) == shapes.tokenizer.encode(caption)
    assert ShapesDataModule(train_size=8, val_size=8).state_dict() == {}  # nothing before setup


def test_shapes_predict_prompts_are_unified_ids_starting_with_bos(shapes: ShapesDataModule):
    prompts = [p for batch in shapes.predict_dataloader() for p in batch]
    assert len(prompts) == 2 and all(isinstance(p, list) and p[0] == shapes.vocab.bos_id for p in prompts)
    assert shapes.decode(prompts[0]) == "a red" and prompts[1] == [shapes.vocab.bos_id]


def test_shapes_free_generation_by_default_is_eight_bare_bos_prompts():
    dm = ShapesDataModule(train_size=32, val_size=8, batch_size=4)
    prompts = [p for batch in dm.predict_dataloader() for p in batch]  # sets up on its own
    assert prompts == [[dm.vocab.bos_id]] * 8
