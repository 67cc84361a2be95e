"""The pipeline API (`zoo.pipeline`, issue 16 item 1): strings, PIL images and audio arrays in and out, the
same answers as the decoding core, from a model in memory, an exported folder or a Lightning checkpoint.

The model is tiny and untrained (a causal 3D visual tokenizer, a 2-level codec, a BPE tokenizer), so answers
are arbitrary: the tests check what the pipeline must guarantee whatever the weights.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from code_shard_helpers import unified_model, write_text_tokenizer, write_tokenizers
from PIL import Image

import zoo
from zoo.cli import main
from zoo.datamodules.documents import decode_text
from zoo.hub import save_pretrained
from zoo.inference import Pipeline, Speech
from zoo.models.generation import generate_text
from zoo.models.unified import UnifiedModel
from zoo.tokenizers.text import TextTokenizer

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["a small red circle at the top left", "a large blue square", "two green triangles", "café naïve"]


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> tuple[UnifiedModel, TextTokenizer]:
    folder = tmp_path_factory.mktemp("pipeline")
    model = unified_model(write_tokenizers(folder / "tokenizers"))
    tokenizer = TextTokenizer.load(write_text_tokenizer(folder / "tokenizer.json", TEXTS))
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def pipe(parts) -> Pipeline:
    return Pipeline(*parts)


def picture(seed: int, size: tuple[int, int] = (40, 48), mode: str = "RGB") -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB").convert(mode)


def tone(rate: int, seconds: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.3 * np.sin(2 * np.pi * 220 * t) + 0.1 * np.sin(2 * np.pi * 660 * t)).astype(np.float32)


def test_text_streams_in_pieces_that_join_to_the_greedy_answer_of_the_decoding_core(pipe, parts):
    model, tokenizer = parts
    pieces = list(pipe.stream("a small red", max_new_tokens=12, temperature=0))
    answer = pipe("a small red", max_new_tokens=12, temperature=0)
    assert isinstance(answer, str) and "".join(pieces) == answer
    assert len(pieces) >= 2, "a stream yields as tokens come, not the whole answer at once"
    # An untrained model emits stray bytes (shown as U+FFFD in the answer too), but no piece but the last may
    # end in one: that would be half a character, split across two pieces.
    assert all(pieces) and not any(piece.endswith("\ufffd") for piece in pieces[:-1])
    prompt = [model.vocab.bos_id, *model.vocab.text_to_unified(tokenizer.encode("a small red")).tolist()]
    ids = generate_text(model, [prompt], 12, temperature=0)[0]
    ids = ids[: ids.index(model.vocab.eos_id)] if model.vocab.eos_id in ids else ids
    assert answer == decode_text(tokenizer, model.vocab, ids)


def test_sampling_is_repeatable_with_a_seed_and_varies_without_one(pipe):
    first = pipe("a large", max_new_tokens=10, temperature=1.0, seed=3)
    assert pipe("a large", max_new_tokens=10, temperature=1.0, seed=3) == first
    others = {pipe("a large", max_new_tokens=10, temperature=1.0, seed=s) for s in range(4, 10)}
    assert others - {first}, "different seeds never changed the sample"


def test_caption_to_image_video_and_speech_come_back_as_pil_frames_and_a_wave(pipe, parts):
    model, _ = parts
    image = pipe("a small red circle", output="image", temperature=1.0, seed=0)
    assert isinstance(image, Image.Image) and image.mode == "RGB" and image.size == (32, 32)
    assert len(set(np.asarray(image).reshape(-1, 3).sum(1).tolist())) > 1, "a flat image came back"
    video = pipe("a small red circle", output="video", seed=0)
    assert isinstance(video, list) and len(video) == pipe.spec.video_frames
    assert all(isinstance(f, Image.Image) and f.size == (32, 32) for f in video)
    speech = pipe("a small red circle", output="speech", max_audio_frames=6, seed=0)
    assert isinstance(speech, Speech) and speech.sample_rate == model.audio_codec.sample_rate
    assert speech.wave.dtype == np.float32 and speech.wave.ndim == 1
    assert len(speech.wave) <= 6 * pipe.layout.audio_hop


def test_an_image_is_captioned_alike_from_pil_of_any_mode_a_file_and_bytes(pipe, tmp_path):
    path = tmp_path / "scene.png"
    picture(1).save(path)
    from_file = pipe(image=path, max_new_tokens=8, temperature=0)
    assert isinstance(from_file, str)
    assert pipe(image=Image.open(path), max_new_tokens=8, temperature=0) == from_file
    assert pipe(image=path.read_bytes(), max_new_tokens=8, temperature=0) == from_file
    other = pipe(image=picture(2, mode="RGBA"), max_new_tokens=8, temperature=0)  # RGBA read as RGB
    assert isinstance(other, str)
    prompted = list(pipe.stream("Describe the image:", image=path, max_new_tokens=8, temperature=0))
    assert all(isinstance(p, str) for p in prompted)


def test_audio_is_transcribed_alike_from_an_array_at_any_rate_a_speech_and_a_file(pipe, tmp_path):
    wave = tone(22050)
    path = tmp_path / "speech.wav"
    sf.write(path, wave, 22050)
    from_file = pipe(audio=path, max_new_tokens=6, temperature=0)
    assert pipe(audio=(wave, 22050), max_new_tokens=6, temperature=0) == from_file
    assert pipe(audio=Speech(wave, 22050), max_new_tokens=6, temperature=0) == from_file
    buffer = io.BytesIO()
    sf.write(buffer, np.stack([wave, wave], 1), 22050, format="FLAC")  # stereo FLAC, downmixed
    assert pipe(audio=buffer.getvalue(), max_new_tokens=6, temperature=0) == from_file


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: p(image=picture(0), audio=(tone(16000), 16000)), "one medium at a time"),
        (lambda p: p("a red circle", image=picture(0), output="image"), "give text only"),
        (lambda p: p("", output="image"), "needs a caption"),
        (lambda p: p("a red circle", output="sound"), "output must be one of"),
        (lambda p: p(), "nothing to answer"),
        (lambda p: p("a red circle", max_new_tokens=600), "exceed the model's context of 512"),
        (lambda p: p(audio=(np.zeros(8000, np.float32), 16000)), "silent"),
        (lambda p: p(image=b"not an image"), "cannot"),
        (lambda p: p(image=np.zeros((4, 4, 3))), "a path, bytes or a PIL image"),
    ],
)
def test_bad_requests_are_refused_with_what_to_change(pipe, call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call(pipe)


def test_a_model_without_a_codec_says_it_cannot_speak(parts):
    model, tokenizer = parts
    mute = UnifiedModel(model.backbone, model.vocab, mtp_depth=0, visual_tokenizer=model.visual_tokenizer)
    with pytest.raises(ValueError, match="no audio codec"):
        Pipeline(mute, tokenizer)("a red circle", output="speech")
    with pytest.raises(ValueError, match="audio"):
        Pipeline(mute, tokenizer)(audio=(tone(16000), 16000))


def test_an_exported_folder_gives_the_answers_of_the_model_it_was_written_from(pipe, parts, tmp_path):
    model, tokenizer = parts
    save_pretrained(model, tmp_path / "export", tokenizer)
    loaded = zoo.pipeline(tmp_path / "export")
    assert loaded.tokenizer.to_json() == tokenizer.to_json()
    for text in ("a small", "two green"):
        assert loaded(text, max_new_tokens=8, temperature=0) == pipe(text, max_new_tokens=8, temperature=0)
    image = picture(5)
    caption = pipe(image=image, max_new_tokens=6, temperature=0)
    assert loaded(image=image, max_new_tokens=6, temperature=0) == caption


def test_a_training_checkpoint_and_its_export_answer_alike_with_the_checkpoints_tokenizer(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # the quickstart's runs/ land in tmp_path
    main([
        "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--trainer.max_steps=2",
        "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        "--data.init_args.train_size=64", "--data.init_args.val_size=8",
    ])  # fmt: skip
    checkpoint = tmp_path / "runs" / "quickstart" / "latest" / "checkpoints" / "last.ckpt"
    main(["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "export")])
    from_checkpoint, from_export = zoo.pipeline(checkpoint), zoo.pipeline(tmp_path / "export")
    assert from_checkpoint.tokenizer.to_json() == from_export.tokenizer.to_json()
    answer = from_checkpoint("a small red", max_new_tokens=6, temperature=0)
    assert isinstance(answer, str) and answer == from_export("a small red", max_new_tokens=6, temperature=0)
    with pytest.raises(ValueError, match="has no visual tokenizer"):
        from_checkpoint("a small red circle", output="image")


def run_zoo(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`zoo ...` in a subprocess in `cwd`, as a user runs it (one thread, the repository's code)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "zoo.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, cwd=cwd)


def test_zoo_generate_streams_text_and_writes_images_and_speech_to_files(parts, tmp_path):
    model, tokenizer = parts
    folder = save_pretrained(model, tmp_path / "export", tokenizer)

    def generate(*args: str) -> subprocess.CompletedProcess:
        return run_zoo(tmp_path, "generate", str(folder), *args)

    text = generate("a small red", "--temperature", "0", "--max-new-tokens", "8")
    assert text.returncode == 0, text.stderr
    assert text.stdout.rstrip("\n") == Pipeline(*parts)("a small red", max_new_tokens=8, temperature=0)

    image = generate("a red circle", "--output", "image", "--best-of", "2", "--out", str(tmp_path / "c.png"))
    assert image.returncode == 0, image.stderr
    assert Image.open(tmp_path / "c.png").size == (32, 32) and "c.png" in image.stdout
    # An untrained model may end its speech at once: take a seed that speaks; the file must be that speech.
    seed, spoken = next(
        (s, w) for s in range(20)
        if len(w := Pipeline(*parts)("a red circle", output="speech", max_audio_frames=4, seed=s).wave)
    )  # fmt: skip
    speech = generate(
        "a red circle", "--output", "speech", "--max-audio-frames", "4", "--out", str(tmp_path / "c.wav"),
        "--seed", str(seed), "--temperature", "1",
    )  # fmt: skip
    assert speech.returncode == 0, speech.stderr
    info = sf.info(tmp_path / "c.wav")
    assert info.samplerate == model.audio_codec.sample_rate and info.frames == len(spoken)

    picture(3).save(tmp_path / "scene.png")  # the media flags reach the pipeline (which refuses this mix)
    wrong = generate("a red circle", "--image", str(tmp_path / "scene.png"), "--output", "image")
    assert wrong.returncode != 0 and "give text only" in wrong.stderr
    assert "Traceback" not in wrong.stderr, "a user error is one line, not a traceback"


def test_zoo_chat_keeps_the_conversation_resets_it_and_survives_bad_lines(pipe, parts, tmp_path):
    from zoo.cli.chat import Conversation, run

    picture(4).save(tmp_path / "scene.png")
    lines = "\n".join([
        "a small red", "/image missing.png", "/image " + str(tmp_path / "scene.png") + " and then",
        "/image " + str(tmp_path / "scene.png"), "/reset", "a small red", "/bogus", "/quit", "never read",
    ])  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    conversation = Conversation(pipe, {"temperature": 0}, 6)
    run(conversation, io.StringIO(lines + "\n"), out, err, prompt="")
    answers = out.getvalue().splitlines()
    first = pipe("a small red", max_new_tokens=6, temperature=0)
    # The second turn reads the first: the provisional rule joins every turn's text, the image its medium.
    second = pipe("a small red\n" + first + "\nand then", image=tmp_path / "scene.png", max_new_tokens=6,
                  temperature=0)  # fmt: skip
    assert answers == [first, second, "(conversation forgotten)", first]
    messages = err.getvalue().splitlines()
    assert "missing.png: no such file" in messages[0]
    assert "at most one image or audio a conversation" in messages[1], "a second image is refused"
    assert "unknown command /bogus" in messages[2]
    assert len(conversation.turns) == 2, "after /reset only the last exchange is kept"


def test_zoo_chat_in_a_terminal_session(parts, tmp_path):
    model, tokenizer = parts
    folder = save_pretrained(model, tmp_path / "export", tokenizer)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "zoo.cli", "chat", str(folder), "--temperature", "0", "--max-new-tokens", "5"],
        input="a small red\n/help\n", capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    answer, help_line = done.stdout.splitlines()
    assert answer == Pipeline(*parts)("a small red", max_new_tokens=5, temperature=0)
    assert help_line.startswith("commands: /image")


def test_a_model_with_a_vision_encoder_and_no_3d_tokenizer_reads_a_video_frame_by_frame(parts, tmp_path):
    from zoo.models.backbone import UnifiedTransformer
    from zoo.models.vision import DualPathEncoder
    from zoo.tokenizers.vocab import UnifiedVocab

    _, tokenizer = parts
    backbone = UnifiedTransformer(dim=48, n_layers=1, n_heads=2, n_kv_heads=1, n_experts=2, expert_hidden=16,
                                  top_k=1, max_seq_len=256)
    vocab = UnifiedVocab(text_size=tokenizer.vocab_size, visual_size=512, audio_size=256, audio_levels=2)
    model = UnifiedModel(backbone, vocab, mtp_depth=0, vision_encoder=DualPathEncoder(out_dim=48)).eval()
    reader = Pipeline(model, tokenizer)
    path = tmp_path / "clip.gif"
    frames = [picture(seed, (32, 32)) for seed in range(5)]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100)
    batch = reader.prompt_batch(None, video=path)
    assert batch.visual is None and batch.context.pixels.shape == (5, 3, 32, 32)  # one still a frame
    assert int((batch.context.slot >= 0).sum()) == 5 * 16
    assert batch.input_ids[0, -(5 * 16 + 2)] == vocab.special("<bov>")
    assert isinstance(reader(video=path, max_new_tokens=4, temperature=0), str)
    with pytest.raises(ValueError, match="cannot take video"):  # as codes, this model has no 3D tokenizer
        Pipeline(model, tokenizer, video_context=False).prompt_batch(None, video=path)


def test_best_of_returns_the_draw_the_model_reads_back_as_the_caption_most_likely(pipe, parts):
    from zoo.datamodules.sequence import VisualSegment
    from zoo.inference.best_of import reading, score_documents
    from zoo.inference.pipeline import to_pil
    from zoo.models.media_generation import generate_visual
    from zoo.models.refinement import decode_visual

    model, _ = parts
    caption = "a small red circle"
    kept = pipe(caption, output="image", temperature=1.0, seed=0, best_of=4)
    prompt = pipe.maker.generation_prompt("text_to_image", caption)
    # The same four draws by hand (one sampler call, as the pipeline makes them), each read back and scored.
    codes = generate_visual(model, [prompt] * 4, 1, 2.0, 1.0, None, None, torch.Generator().manual_seed(0))
    pixels = decode_visual(model, codes)
    vocab = model.vocab
    read = [pipe.maker.media(VisualSegment(p), False, "drawn", context=True) for p in pixels]
    documents = [reading(prompt[1:-1], r, vocab.bos_id, vocab.eos_id) for r in read]
    scores = score_documents(model, pipe.builder, documents)
    assert len(set(scores.tolist())) == 4  # the draws differ, so the choice is a real one
    assert np.array_equal(np.asarray(kept), np.asarray(to_pil(pixels[int(scores.argmax())])))
    speech = pipe(caption, output="speech", max_audio_frames=4, seed=0, best_of=2)
    assert isinstance(speech, Speech) and len(speech.wave) <= 4 * pipe.layout.audio_hop
    with pytest.raises(ValueError, match="best_of must be >= 1"):
        pipe(caption, output="image", best_of=0)
