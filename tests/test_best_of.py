"""Best of N (`zoo.inference.best_of`): candidates ranked by the caption log-prob the model itself reads back.

The models here are untrained, so their rankings mean nothing; what is checked is that the score is the
log-prob training optimises, that no row sees another, that the kept candidate is the best-scored one, and
that the gallery, `evaluate` and `zoo predict`'s settings carry the option with one sample's scores beside.
The other way round, `benchmarks/caption_channel.py` ranks captions by the image codes they draw back: its
score is checked the same way, and its pool of one-attribute edits."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from zoo.cli import ZooCLI
from zoo.datamodules.sequence import AudioSegment, MediaLayout, TextSegment, VisualSegment
from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule
from zoo.inference.best_of import ROWS_PER_DRAW, draw_candidates, rank_candidates, reading, score_documents
from zoo.models.backbone import UnifiedTransformer
from zoo.models.unified import UnifiedModel
from zoo.tasks.callbacks import MultimodalGallery
from zoo.tasks.multimodal_eval import evaluate, write_gallery
from zoo.tasks.pretrain import SamplingConfig
from zoo.tokenizers.audio import AudioCodec
from zoo.tokenizers.visual import VisualTokenizer
from zoo.tokenizers.vocab import UnifiedVocab
from zoo.world.scenes import COLOURS, SHAPES, parse_caption


@pytest.fixture(scope="module")
def tiny() -> tuple[UnifiedModel, ShapesMultimodalDataModule]:
    torch.manual_seed(0)
    visual, codec = VisualTokenizer(), AudioCodec()
    vocab = UnifiedVocab(text_size=320, visual_size=visual.codebook_size, audio_size=256, audio_levels=4)
    backbone = UnifiedTransformer(
        dim=32, n_layers=1, n_heads=2, n_kv_heads=1, n_experts=2, expert_hidden=16, top_k=1, max_seq_len=256
    )
    model = UnifiedModel(backbone, vocab, mtp_depth=0, visual_tokenizer=visual, audio_codec=codec).eval()
    data = ShapesMultimodalDataModule(
        vocab=vocab, layout=MediaLayout.of(model), caption_weight=0.0, text_to_image_weight=1.0,
        image_to_text_weight=1.0, text_to_audio_weight=1.0, max_objects=1, train_size=64, val_size=16,
        tokenizer_size=300, seq_len=256,
    )  # fmt: skip
    data.setup("validate")
    return model, data


def _readings(data: ShapesMultimodalDataModule, n: int, shift: int = 0) -> list:
    """Scene i's caption read after the image of scene i + shift (shift 0: its own image)."""
    scenes = data.world.scenes("val", n + shift)
    vocab = data.vocab
    return [
        reading(data.caption_ids(data.world.caption(scenes[i])), VisualSegment(data.image(scenes[i + shift]),
                predict=False), vocab.bos_id, vocab.eos_id)
        for i in range(n)
    ]  # fmt: skip


def test_a_documents_score_is_the_log_prob_of_its_caption_that_training_averages(tiny):
    model, data = tiny
    documents = _readings(data, 3)
    scores = score_documents(model, data.builder, documents)
    batch = data.builder.collate_prompts(documents)
    with torch.no_grad():
        out = model(batch)
    targets = int((batch.targets["text"] != -100).sum())
    assert targets == sum(len(d[-1].ids) for d in documents)  # the caption and <eos>, nothing else
    torch.testing.assert_close(-scores.sum() / targets, out.heads["text"].loss, atol=1e-5, rtol=1e-5)
    alone = torch.cat([score_documents(model, data.builder, [d]) for d in documents])
    # Padding and the other rows change nothing:
    torch.testing.assert_close(scores, alone, atol=1e-4, rtol=1e-5)


def test_the_kept_candidate_is_the_best_scored_and_a_candidate_with_nothing_to_read_never_wins(tiny):
    model, data = tiny
    scenes = data.world.scenes("val", 4)
    captions = [data.caption_ids(data.world.caption(s)) for s in scenes]
    own = [VisualSegment(data.image(s), predict=False) for s in scenes]
    other = [VisualSegment(data.image(s), predict=False) for s in scenes[1:] + scenes[:1]]
    nothing: list = [None] * 4
    best, scores = rank_candidates(model, data.builder, captions, [other, nothing, own])
    assert scores.shape == (3, 4) and torch.isinf(scores[1]).all()
    assert best == scores.argmax(0).tolist() and 1 not in best
    expected = score_documents(model, data.builder, _readings(data, 4))
    torch.testing.assert_close(scores[2], expected)
    with pytest.raises(ValueError, match="candidate lists of 4"):
        rank_candidates(model, data.builder, captions, [own[:3]])


def test_candidates_are_drawn_a_few_prompts_at_a_time_and_come_back_per_prompt():
    calls: list[int] = []

    def draw(prompts: list[list[int]]) -> list[tuple[int, int]]:  # (prompt, call) per row
        calls.append(len(prompts))
        return [(p[0], len(calls)) for p in prompts]

    prompts = [[i] for i in range(ROWS_PER_DRAW // 4)]  # 4 candidates a call, 2 under guidance
    candidates = draw_candidates(draw, prompts, 5, rows_per_prompt=2)
    assert calls == [2 * len(prompts), 2 * len(prompts), len(prompts)]
    assert len(candidates) == 5
    assert all([c[0] for c in row] == list(range(len(prompts))) for row in candidates)
    assert [row[0][1] for row in candidates] == [1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="n must be >= 1"):
        draw_candidates(draw, prompts, 0)


def test_evaluate_keeps_its_keys_and_scores_one_sample_beside_the_best_of_n(tiny, tmp_path):
    model, data = tiny
    plain = evaluate(model, data, 2, tasks=["text_to_image", "text_to_audio"], max_audio_frames=3)
    best = evaluate(model, data, 2, tasks=["text_to_image", "text_to_audio"], max_audio_frames=3,
                    best_of=3, audio_best_of=2)  # fmt: skip
    assert not any("best_of" in k or "one_sample" in k for k in plain.metrics)
    assert set(plain.metrics) < set(best.metrics)  # every usual key is still there
    m = best.metrics
    assert m["text_to_image/best_of"] == 3.0 and m["text_to_audio/best_of"] == 2.0
    for key in ("text_to_image/one_sample_exact", "text_to_audio/one_sample_word_accuracy"):
        assert 0.0 <= m[key] <= 1.0
    assert len([s for s in best.samples if s.task == "text_to_image"]) == 2  # the kept ones only
    page = write_gallery(best, tmp_path).read_text()
    assert "| text_to_image, one sample (above: the best of 3 by the model's own reading) |" in page
    with pytest.raises(ValueError, match="audio_best_of must be >= 1"):
        evaluate(model, data, 2, tasks=["text_to_image"], audio_best_of=0)


def test_best_of_below_one_is_refused_where_it_is_configured():
    with pytest.raises(ValueError, match="best_of must be >= 1"):
        MultimodalGallery(best_of=0)
    with pytest.raises(ValueError, match="audio_best_of must be >= 1"):
        SamplingConfig(audio_best_of=0)


def test_speech_candidates_are_read_as_their_codes(tiny):
    model, data = tiny
    scene = data.world.scenes("val", 1)[0]
    caption = data.caption_ids(data.world.caption(scene))
    wave = data.speech(data.world.caption(scene), "val", 0, 0)
    codes = model.ncp.codec.encode(wave[None].float())[0]
    vocab = data.vocab
    as_codes = reading(caption, AudioSegment(codes=codes, predict=False), vocab.bos_id, vocab.eos_id)
    as_wave = reading(caption, AudioSegment(wave, predict=False), vocab.bos_id, vocab.eos_id)
    by_codes, by_wave = score_documents(model, data.builder, [as_codes, as_wave])
    assert abs(float(by_codes) - float(by_wave)) < 1e-3  # a generated utterance reads as its speech would
    assert by_codes < 0
    assert isinstance(as_codes[-1], TextSegment) and as_codes[-1].ids[-1] == vocab.eos_id


def test_zoo_predict_takes_best_of_from_yaml_and_refuses_zero(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    quickstart = str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml")
    args = ["--config", quickstart, f"--trainer.default_root_dir={tmp_path}"]
    cli = ZooCLI(args=[*args, "--model.init_args.sampling.best_of=4"], run=False)
    assert cli.model.sampling.best_of == 4 and cli.model.sampling.audio_best_of == 1
    with pytest.raises((ValueError, SystemExit)) as refused:
        ZooCLI(args=[*args, "--model.init_args.sampling.audio_best_of=0"], run=False)
    said = str(refused.value) + "".join(capfd.readouterr())
    assert "audio_best_of must be >= 1" in said  # the reason, not some other parse error


def _caption_channel():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # where it finds _common
    return importlib.import_module("caption_channel")


def test_a_drawing_score_is_the_log_prob_of_the_image_codes_that_training_averages(tiny):
    model, data = tiny
    scenes = data.world.scenes("val", 3)
    vocab = data.vocab
    documents = [
        [TextSegment([vocab.bos_id, *data.caption_ids(data.world.caption(s))], predict=False),
         VisualSegment(data.image(s)), TextSegment([vocab.eos_id])]
        for s in scenes
    ]  # fmt: skip
    scores = _caption_channel().score_drawings(model, data.builder, documents)
    with torch.no_grad():
        out = model(data.builder.collate_prompts(documents))
    codes = 3 * model.nfsp.tokens_per_frame  # every code of every image, the opener's none
    assert int(out.heads["visual"].metrics["visual/tokens"]) == codes
    torch.testing.assert_close(-scores.sum() / codes, out.heads["visual"].metrics["visual/nfsp_loss"])
    alone = torch.cat([_caption_channel().score_drawings(model, data.builder, [d]) for d in documents])
    torch.testing.assert_close(scores, alone, atol=1e-4, rtol=1e-5)  # padding and other rows change nothing


def test_the_caption_pool_holds_every_caption_one_colour_or_one_shape_away():
    text = "a small red circle at the top left and a large blue square in the center"
    edited = _caption_channel().edits(text)
    assert len(edited) == 2 * ((len(COLOURS) - 1) + (len(SHAPES) - 1)) == len(set(edited))
    original = parse_caption(text)
    for other in edited:
        changed = [
            (field, j) for j, (a, b) in enumerate(zip(original, parse_caption(other), strict=True))
            for field in ("colour", "shape", "size", "cell_index") if getattr(a, field) != getattr(b, field)
        ]  # fmt: skip
        assert len(changed) == 1 and changed[0][0] in ("colour", "shape"), (other, changed)
    assert _caption_channel().edits("a small red") == []  # nothing the grammar reads, nothing to edit
