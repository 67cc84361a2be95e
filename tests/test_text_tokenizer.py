"""Specification of the byte-level BPE text tokenizer (zoo/tokenizers/text.py)."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import pre_tokenizers

from zoo.tokenizers.text import TextTokenizer, byte_symbols, train_tokenizer_main

WORDS = (
    "the a red blue green yellow circle square triangle small large tiny huge moves slowly quickly "
    "at top left right bottom centre of and is near far from which there one two three"
).split()

# Characters that break naive tokenizers: controls, odd whitespace, combining marks, RTL, CJK, emoji
# (with ZWJ and skin-tone modifiers), BOM, private use and astral code points.
# fmt: off
TRICKY = [
    "\x00", "\x01", "\x1b", "\x7f", "\t", "\n", "\r", "\r\n", " ", "  ", "\u00a0", "\u2028", "\u3000",
    "\ufeff", "\u200b", "e\u0301", "\u0300\u0301\u0302", "ש", "مرحبا", "日本語", "한국어", "😀",
    "\U0001f469\u200d\U0001f469\u200d\U0001f467", "\U0001f44d\U0001f3fd", "\U0001f1eb\U0001f1f7",
    "\ue000", "\U0010fffd", "\U0001d11e", "ǅ", "ß", "İ", "\ufffd",
]
# fmt: on


def english(rng: random.Random, n: int) -> list[str]:
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))).capitalize() + "." for _ in range(n)
    ]


def random_unicode(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(0, 12)):
        kind = rng.random()
        if kind < 0.4:
            parts.append(rng.choice(TRICKY))
        elif kind < 0.6:
            parts.append(" " * rng.randint(1, 5) + "\t" * rng.randint(0, 2) + "\n" * rng.randint(0, 2))
        elif kind < 0.8:
            parts.append(rng.choice(WORDS))
        else:
            cp = rng.randrange(0x110000)
            parts.append(chr(cp if not 0xD800 <= cp < 0xE000 else 0xE000))  # surrogates are not text
    return "".join(parts)


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return english(random.Random(0), 3000)


@pytest.fixture(scope="module")
def trained(corpus: list[str]) -> TextTokenizer:
    # A little random Unicode in training makes merges of multi-byte characters and whitespace runs too.
    rng = random.Random(1)
    return TextTokenizer.train(corpus + [random_unicode(rng) for _ in range(500)], vocab_size=600)


@pytest.fixture(scope="module")
def unicode_texts() -> list[str]:
    rng = random.Random(2)
    return ["", *TRICKY, *(random_unicode(rng) for _ in range(400))]


# --- bytes and round trip ---------------------------------------------------------------------------


def test_byte_level_tokenizer_gives_one_id_per_utf8_byte_equal_to_the_byte_value():
    tok = TextTokenizer.byte_level()
    assert tok.vocab_size == len(tok) == 256
    for text in ["A", "é", "日", "😀", "\x00 \n", ""]:
        assert tok.encode(text) == list(text.encode("utf-8"))


def test_byte_symbols_are_the_hugging_face_byte_level_alphabet():
    assert len(set(byte_symbols())) == 256
    assert set(byte_symbols()) == set(pre_tokenizers.ByteLevel.alphabet())


def test_default_constructor_is_the_byte_level_tokenizer():
    assert TextTokenizer().encode("hi é") == TextTokenizer.byte_level().encode("hi é")


@pytest.mark.parametrize("which", ["byte_level", "trained"])
def test_any_unicode_string_round_trips_exactly(which, trained, unicode_texts):
    tok = trained if which == "trained" else TextTokenizer.byte_level()
    for text in unicode_texts:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text, repr(text)


def test_encode_batch_equals_encode_one_by_one(trained, unicode_texts):
    assert trained.encode_batch(unicode_texts) == [trained.encode(t) for t in unicode_texts]
    assert trained.encode_batch([]) == []


def test_a_character_never_seen_in_training_falls_back_to_its_bytes(corpus):
    tok = TextTokenizer.train(corpus, vocab_size=400)
    assert tok.encode("😀") == list("😀".encode())
    assert tok.decode(tok.encode("red 😀 circle")) == "red 😀 circle"


# --- training -----------------------------------------------------------------------------------------


def test_trained_tokenizer_compresses_english_text_it_has_not_seen(trained):
    held_out = english(random.Random(99), 200)
    num_tokens = sum(len(ids) for ids in trained.encode_batch(held_out))
    num_bytes = sum(len(t.encode("utf-8")) for t in held_out)
    assert trained.vocab_size > 256
    assert num_tokens < 0.5 * num_bytes


def test_trained_ids_0_to_255_are_the_bytes_like_the_byte_level_tokenizer(trained):
    # Merged tokens come after the bytes, so the byte-level tokenizer is a prefix of every trained one.
    assert [trained.decode([b]) for b in range(32, 127)] == [chr(b) for b in range(32, 127)]
    assert trained.encode("\x00\x7f") == [0, 127]


def test_training_is_deterministic(corpus, tmp_path):
    TextTokenizer.train(corpus, vocab_size=300).save(tmp_path / "a.json")
    TextTokenizer.train(corpus, vocab_size=300).save(tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_vocab_size_may_be_smaller_than_requested_when_the_corpus_is_small():
    tok = TextTokenizer.train(["ab ab ab", "abc abc"], vocab_size=1000)
    assert 256 < tok.vocab_size < 1000
    assert max(tok.encode("ab abc")) < tok.vocab_size


@pytest.mark.parametrize("vocab_size", [0, 255, 256, 300.0])
def test_training_refuses_a_vocab_size_without_room_for_a_merge(vocab_size):
    with pytest.raises(ValueError, match="vocab_size must be an int >= 257"):
        TextTokenizer.train(["abc"], vocab_size=vocab_size)


def test_training_refuses_a_single_string_or_non_string_documents():
    with pytest.raises(TypeError, match="single str"):
        TextTokenizer.train("abc abc", vocab_size=300)
    with pytest.raises(TypeError, match="training text 1 must be a str"):
        TextTokenizer.train(["abc", 3], vocab_size=300)


# --- save / load ----------------------------------------------------------------------------------


def test_save_then_load_gives_identical_ids(trained, unicode_texts, tmp_path):
    path = tmp_path / "sub" / "tokenizer.json"
    trained.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["tokenizer.json"]
    json.loads(path.read_text(encoding="utf-8"))  # one plain JSON file, no pickle
    loaded = TextTokenizer.load(path)
    assert loaded.vocab_size == trained.vocab_size
    assert loaded.encode_batch(unicode_texts) == trained.encode_batch(unicode_texts)
    assert TextTokenizer(str(path)).encode("red circle") == trained.encode("red circle")


def test_load_of_a_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        TextTokenizer.load(tmp_path / "nope.json")


def test_load_of_a_corrupt_file_names_the_path(trained, tmp_path):
    path = tmp_path / "broken.json"
    trained.save(path)
    path.write_text(path.read_text(encoding="utf-8")[:-40], encoding="utf-8")
    with pytest.raises(ValueError, match="broken.json.*not valid JSON"):
        TextTokenizer.load(path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(pre_tokenizer={"type": "Whitespace"}), "pre_tokenizer must be ByteLevel"),
        (lambda c: c.update(normalizer={"type": "NFC"}), "normalizer"),
        (lambda c: c["model"].update(dropout=0.1), "dropout"),
        (lambda c: c["model"]["vocab"].pop("Ā"), "ids must be exactly|byte tokens are missing"),
        (lambda c: c.update(model={"type": "WordPiece"}), "model type must be 'BPE'"),
    ],
)
def test_load_refuses_a_tokenizer_json_that_is_not_byte_level_bpe(trained, tmp_path, edit, message):
    path = tmp_path / "other.json"
    trained.save(path)
    config = json.loads(path.read_text(encoding="utf-8"))
    edit(config)
    path.write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ValueError, match=message) as err:
        TextTokenizer.load(path)
    assert "other.json" in str(err.value)


# --- BPE-dropout -----------------------------------------------------------------------------------


def test_own_merge_loop_without_dropout_equals_hugging_face_encoding(trained, corpus, unicode_texts):
    # The dropout path re-implements HF's merge order; at p = 0 it must agree token for token.
    for text in corpus[:500] + unicode_texts:
        assert trained._encode_with_merges(text, 0.0, random.Random(0)) == trained.encode(text)


def test_dropout_is_off_by_default_and_at_zero(trained, corpus):
    for text in corpus[:50]:
        ids = trained.encode(text)
        assert trained.encode(text) == ids
        assert trained.encode(text, dropout=0.0, seed=3) == ids
        assert trained.encode(text, dropout=None) == ids


def test_dropout_changes_segmentation_but_always_decodes_exactly(trained, corpus, unicode_texts):
    changed = 0
    for i, text in enumerate(corpus[:100] + unicode_texts):
        ids = trained.encode(text, dropout=0.3, seed=i)
        assert trained.decode(ids) == text, repr(text)
        changed += ids != trained.encode(text)
    assert changed > 50
    base = sum(len(trained.encode(t)) for t in corpus[:100])
    assert sum(len(trained.encode(t, dropout=0.3, seed=0)) for t in corpus[:100]) > base


def test_dropout_is_reproducible_with_a_seed_and_varies_without_one(trained, corpus):
    text = " ".join(corpus[:5])
    assert trained.encode(text, dropout=0.2, seed=7) == trained.encode(text, dropout=0.2, seed=7)
    assert trained.encode(text, dropout=0.2, seed=7) != trained.encode(text, dropout=0.2, seed=8)
    assert len({tuple(trained.encode(text, dropout=0.2)) for _ in range(5)}) > 1
    batch = corpus[:20]
    first = trained.encode_batch(batch, dropout=0.2, seed=1)
    assert first == trained.encode_batch(batch, dropout=0.2, seed=1) != trained.encode_batch(batch)


def test_a_dropped_merge_is_drawn_again_after_the_next_merge(tmp_path):
    # Two independent merges, ab and cd, on "abcd" with p = 0.5. Provilkov et al. redraw every candidate at
    # every step: no merge with p^2 = 0.25, both with (1 - p^2)(1 - p) = 0.375. A skipped merge that were
    # never retried would give both merges only (1 - p)^2 = 0.25 of the time.
    TextTokenizer.byte_level().save(tmp_path / "bytes.json")
    config = json.loads((tmp_path / "bytes.json").read_text(encoding="utf-8"))
    config["model"]["vocab"].update({"ab": 256, "cd": 257})
    config["model"]["merges"] = [["a", "b"], ["c", "d"]]
    (tmp_path / "abcd.json").write_text(json.dumps(config), encoding="utf-8")
    tok = TextTokenizer.load(tmp_path / "abcd.json")
    assert tok.encode("abcd") == [256, 257]
    n = 4000
    lengths = [len(tok.encode("abcd", dropout=0.5, seed=i)) for i in range(n)]
    assert lengths.count(2) / n == pytest.approx(0.375, abs=0.03)
    assert lengths.count(4) / n == pytest.approx(0.25, abs=0.03)


def test_full_dropout_gives_the_raw_bytes(trained):
    text = "the red circle 日本"
    assert trained.encode(text, dropout=1.0) == list(text.encode("utf-8"))


@pytest.mark.parametrize("dropout", [-0.1, 1.5, True, "0.1"])
def test_dropout_outside_0_1_is_refused(trained, dropout):
    with pytest.raises(ValueError, match=r"dropout must be a probability in \[0, 1\]"):
        trained.encode("abc", dropout=dropout)


# --- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["minus_one", "vocab_size", "huge"])
def test_decode_refuses_ids_outside_the_vocabulary_naming_id_and_range(trained, bad):
    size = trained.vocab_size
    token = {"minus_one": -1, "vocab_size": size, "huge": 10**12}[bad]
    with pytest.raises(ValueError, match=rf"token id {token} is outside the text vocabulary 0\.\.{size - 1}"):
        trained.decode([5, token])


def test_decode_refuses_non_integer_ids_and_accepts_integer_like_ones(trained):
    with pytest.raises(TypeError, match="must be integers"):
        trained.decode([1.5])
    torch = pytest.importorskip("torch")
    ids = trained.encode("red circle")
    assert trained.decode(torch.tensor(ids)) == "red circle"


def test_encode_refuses_non_strings_and_lone_surrogates(trained):
    with pytest.raises(TypeError, match="text must be a str, got bytes"):
        trained.encode(b"abc")
    with pytest.raises(ValueError, match="lone surrogate"):
        trained.encode("ab\ud800c")
    with pytest.raises(TypeError, match="single str"):
        trained.encode_batch("abc")


# --- command line ---------------------------------------------------------------------------------


def write_corpus(tmp_path, rng: random.Random) -> tuple:
    txt = tmp_path / "a.txt"
    txt.write_text("\n".join(english(rng, 800)) + "\n\n   \n", encoding="utf-8")
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text(
        "\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(english(rng, 800))) + "\n\n",
        encoding="utf-8",
    )
    return txt, jsonl


def test_command_trains_from_txt_and_jsonl_and_writes_a_loadable_json(tmp_path, capsys):
    txt, jsonl = write_corpus(tmp_path, random.Random(5))
    out = tmp_path / "tok" / "tokenizer.json"
    train_tokenizer_main(["--files", str(txt), str(jsonl), "--vocab_size", "400", "--out", str(out)])
    tok = TextTokenizer.load(out)
    printed = capsys.readouterr().out
    assert f"vocab size {tok.vocab_size} (requested 400)" in printed
    assert "tokens per character over 1600 documents" in printed
    per_char = float(printed.split("; ")[1].split()[0])
    assert 0 < per_char < 0.5
    assert tok.decode(tok.encode("the red circle")) == "the red circle"


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"text": "fine"', "b.jsonl:3: invalid JSON"),
        ('{"caption": "no text"}', 'b.jsonl:3: expected an object with a "text" field'),
        ('{"text": 5}', 'b.jsonl:3: "text" must be a string'),
    ],
)
def test_command_names_file_and_line_of_a_bad_jsonl_record(tmp_path, capsys, line, message):
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text('{"text": "a b"}\n\n' + line + "\n", encoding="utf-8")
    with pytest.raises(SystemExit):
        train_tokenizer_main(["--files", str(jsonl), "--out", str(tmp_path / "t.json")])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


def test_command_refuses_missing_files_and_empty_corpora(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_tokenizer_main(["--files", str(tmp_path / "missing.txt")])
    assert "missing.txt" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(SystemExit):
        train_tokenizer_main(["--files", str(empty), "--out", str(tmp_path / "t.json")])
    assert "no documents" in capsys.readouterr().err
