"""Specifications of the multimodal unified model: group layouts, NFSP, NCP, context images, generation.

The tokenizers here are real but untrained (random weights): the layout, the losses, the cache and the
round trips do not depend on their quality. Generation is checked against the full teacher-forced
forward pass: greedy decoding with the KV cache must pick what the uncached model ranks first.
"""

from __future__ import annotations

import pytest
import torch

from zoo.batch import IGNORE_INDEX, Modality
from zoo.datamodules.sequence import (
    AudioSegment,
    ContextSegment,
    MediaLayout,
    SequenceBuilder,
    TextSegment,
    VisualSegment,
)
from zoo.hub import from_pretrained, save_pretrained
from zoo.models.backbone import UnifiedTransformer
from zoo.models.media_generation import generate_audio, generate_text_after, generate_visual
from zoo.models.nfsp import flatten_scales
from zoo.models.unified import UnifiedModel
from zoo.models.vision import DualPathEncoder
from zoo.tokenizers.audio import AudioCodec
from zoo.tokenizers.visual import VisualTokenizer
from zoo.tokenizers.vocab import UnifiedVocab

HOP = 640


@pytest.fixture(scope="module")
def model() -> UnifiedModel:
    torch.manual_seed(0)
    tokenizer = VisualTokenizer()
    codec = AudioCodec()
    encoder = DualPathEncoder(out_dim=48)
    vocab = UnifiedVocab(text_size=64, visual_size=tokenizer.codebook_size, audio_size=256, audio_levels=4)
    backbone = UnifiedTransformer(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=4, expert_hidden=32, top_k=2, max_seq_len=512
    )
    return UnifiedModel(
        backbone, vocab, mtp_depth=1, visual_tokenizer=tokenizer, audio_codec=codec, vision_encoder=encoder
    ).eval()


@pytest.fixture(scope="module")
def builder(model: UnifiedModel) -> SequenceBuilder:
    layout = MediaLayout(model.nfsp.scales, audio_hop=model.audio_codec.hop, context_grid=(4, 4))
    return SequenceBuilder(model.vocab, 400, layout=layout)


def image(seed: int = 0) -> torch.Tensor:
    return torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def text(model: UnifiedModel, *ids: int, bos: bool = True) -> TextSegment:
    return TextSegment(([model.vocab.bos_id] if bos else []) + [model.vocab.text_offset + i for i in ids])


# --- layouts ---------------------------------------------------------------------------------------


def test_an_image_is_one_group_per_scale_on_the_finest_grid(model, builder):
    vocab = model.vocab
    batch = builder.collate([[text(model, 1, 2), VisualSegment(image()), TextSegment([vocab.eos_id])]])
    n = 3 + 1 + 85 + 1 + 1  # <bos> 1 2, <boi>, 1+4+16+64 codes, <eoi>, <eos>
    assert int(batch.valid.sum()) == n
    modality, group = batch.modality[0, :n], batch.group_id[0, :n]
    visual = modality == Modality.IMAGE
    assert int(visual.sum()) == 85
    # Each scale is one group; groups grow by one from scale to scale.
    sizes = torch.unique_consecutive(group[visual], return_counts=True)[1].tolist()
    assert sizes == [1, 4, 16, 64]
    assert (group.diff() >= 0).all()
    # Uni-RoPE: every scale sits on the finest (8x8) grid, offset by the image's start index t0 = 4.
    h = batch.positions[1, 0, :n][visual]
    assert h[0] == 4 + 4  # the 1x1 scale's centre
    assert set(h[-64:].tolist()) == set(range(4, 12))
    assert batch.positions[0, 0, :n][visual].unique().tolist() == [4]
    # Predicted codes are targets where they sit; text predicts <boi> before the image, nothing after it.
    everywhere = batch.modality[0] == Modality.IMAGE
    slots = batch.visual.slot[0][everywhere]
    assert slots.tolist() == list(range(85))
    assert torch.equal(batch.targets["visual"][0][everywhere], slots)
    targets = batch.targets["text"][0]
    assert targets[2] == vocab.special("<boi>")
    assert targets[3] == IGNORE_INDEX and targets[3 + 85] == IGNORE_INDEX  # <boi>, last code
    assert targets[4 + 85] == vocab.eos_id  # <eoi> predicts what follows
    assert batch.positions[0, 0, 4 + 85] == 4 + 8  # text resumes after the image's extent


def test_an_image_to_understand_is_read_whole_and_one_to_generate_is_teacher_forced(model, builder):
    # Teacher forcing never feeds the finest scale's codes: an image the model only reads must carry them,
    # or no caption could depend on details finer than the 4x4 scale.
    codes = model.nfsp.tokenizer.encode(image()[None])
    finer = [c.clone() for c in codes]
    finer[-1] = (finer[-1] + 1) % model.nfsp.tokenizer.codebook_size  # only the finest scale differs

    def inputs(per_scale: list[torch.Tensor], predict: bool) -> torch.Tensor:
        segment = VisualSegment(codes=flatten_scales(per_scale)[0], predict=predict)
        batch = builder.collate([[text(model, 1), segment, text(model, 2, bos=False)]])
        return model.nfsp.encode(batch.visual).features

    assert torch.equal(inputs(codes, predict=True), inputs(finer, predict=True))
    read, read_finer = inputs(codes, predict=False), inputs(finer, predict=False)
    assert not torch.equal(read[-64:], read_finer[-64:])
    assert torch.equal(read[:-64], read_finer[:-64])  # coarser scales read the same
    whole = model.nfsp.tokenizer.quantizer.features([c.flatten(0, 1) for c in codes])  # [1, D, 8, 8]
    torch.testing.assert_close(read[-64:], whole[0].permute(1, 2, 0).reshape(64, -1))
    from_pixels = builder.collate([[text(model, 1), VisualSegment(image(), predict=False)]])
    torch.testing.assert_close(model.nfsp.encode(from_pixels.visual).features, read)


def test_audio_frames_predict_the_next_frame_and_the_last_predicts_the_end(model, builder):
    vocab = model.vocab
    wave = torch.randn(3 * HOP + 5) * 0.1  # 4 frames
    batch = builder.collate([[text(model, 7), AudioSegment(wave), TextSegment([vocab.eos_id])]])
    target, end, slot = (batch.targets["audio"][0], batch.targets["audio_end"][0], batch.audio.slot[0])
    boa = 2
    assert batch.input_ids[0, boa] == vocab.special("<boa>")
    assert target[boa] == 0  # <boa> predicts frame 0
    frames = (batch.modality[0] == Modality.AUDIO).nonzero()[:, 0]
    assert slot[frames].tolist() == [0, 1, 2, 3]
    assert target[frames].tolist() == [1, 2, 3, -1]
    assert end[frames].tolist() == [False, False, False, True]
    assert batch.group_id[0, frames].tolist() == [3, 4, 5, 6]  # one group per frame


def test_a_context_image_is_one_bidirectional_group_without_targets(model, builder):
    batch = builder.collate([[text(model), ContextSegment(image()), text(model, 3, bos=False)]])
    context = batch.modality[0] == Modality.CONTEXT
    assert int(context.sum()) == 16
    assert batch.group_id[0][context].unique().numel() == 1
    assert (batch.targets["text"][0][context] == IGNORE_INDEX).all()
    assert batch.context.slot[0][context].tolist() == list(range(16))


def test_a_context_video_is_one_group_a_frame_each_frame_encoded_as_its_own_still(model, builder):
    frames = torch.stack([image(seed) for seed in range(3)], dim=1)  # [3, T=3, 32, 32]
    batch = builder.collate([[text(model), ContextSegment(frames), text(model, 3, bos=False)]])
    ids, context = batch.input_ids[0], batch.modality[0] == Modality.CONTEXT
    opener = int(context.nonzero()[0]) - 1
    assert ids[opener] == model.vocab.special("<bov>") and ids[opener + 49] == model.vocab.special("<eov>")
    assert int(context.sum()) == 48 and batch.context.pixels.shape == (3, 3, 32, 32)
    assert batch.group_id[0][context].unique().numel() == 3  # one bidirectional group a frame
    t = batch.positions[0, 0][context].view(3, 16)
    assert (t == t[:, :1]).all() and (t[1:, 0] - t[:-1, 0] == 1).all()  # frames advance t
    assert (batch.targets["text"][0][context] == IGNORE_INDEX).all()
    assert batch.context.slot[0][context].tolist() == list(range(48))
    with torch.no_grad():
        tokens = model.encode_media(batch).context
        alone = model.encode_media(builder.collate([[text(model), ContextSegment(frames[:, 1])]])).context
        torch.testing.assert_close(tokens[16:32], alone)  # frame 1 read as the still it is
        # Causal across frames: changing the last frame leaves what the first two frames' positions compute.
        changed = frames.clone()
        changed[:, 2] = image(7)
        other = builder.collate([[text(model), ContextSegment(changed), text(model, 3, bos=False)]])
        first, second = model.forward_hidden(batch).hidden[0], model.forward_hidden(other).hidden[0]
    before_last = context.nonzero()[:32, 0]
    torch.testing.assert_close(first[before_last], second[before_last])
    last = int(batch.valid[0].sum()) - 1  # the text after the clip sees every frame
    assert not torch.allclose(first[last], second[last])
    with pytest.raises(ValueError, match=r"\[3, H, W\] or \[3, T, H, W\]"):
        ContextSegment(torch.zeros(32, 32))


def test_context_tokens_enter_at_unit_scale_and_a_frozen_encoder_stays_as_loaded(builder):
    torch.manual_seed(0)
    backbone = UnifiedTransformer(
        dim=48, n_layers=1, n_heads=2, n_kv_heads=1, n_experts=2, expert_hidden=16, top_k=1, max_seq_len=512
    )
    vocab = UnifiedVocab(text_size=64, visual_size=512, audio_size=256, audio_levels=4)
    frozen = UnifiedModel(
        backbone, vocab, mtp_depth=0, vision_encoder=DualPathEncoder(out_dim=48), freeze_vision_encoder=True
    ).train()
    assert not frozen.vision_encoder.training and frozen.backbone.training
    batch = builder.collate([[text(frozen), ContextSegment(image()), text(frozen, 3, bos=False)]])
    context = frozen.encode_media(batch).context
    torch.testing.assert_close(context.pow(2).mean(-1), torch.ones(16), atol=1e-3, rtol=0)  # RMS 1
    frozen(batch).loss.backward()
    assert all(p.grad is None for p in frozen.vision_encoder.parameters())
    assert frozen.context_norm.weight.grad is not None  # the norm is the model's, and trains


def test_media_that_do_not_fit_the_layout_are_refused(model, builder):
    with pytest.raises(ValueError, match=r"6 frames does not fit the temporal stride 4: expected 1 \+ 4"):
        builder.collate([[text(model), VisualSegment(torch.zeros(3, 6, 32, 32))]])
    with pytest.raises(ValueError, match="empty audio"):
        builder.collate([[text(model), AudioSegment(torch.zeros(0))]])
    long_doc = [text(model), AudioSegment(torch.zeros(600 * HOP))]
    with pytest.raises(ValueError, match="media are never cut"):
        SequenceBuilder(model.vocab, 64, truncate=True, layout=builder.layout).collate([long_doc])
    with pytest.raises(ValueError, match="either pixels or codes"):
        VisualSegment()
    with pytest.raises(ValueError, match="visual scales"):
        wrong = SequenceBuilder(model.vocab, 400, layout=MediaLayout(visual_scales=(1, 2, 8)))
        model(wrong.collate([[text(model), VisualSegment(image())]]))


# --- the model ---------------------------------------------------------------------------------------


def test_every_modality_trains_through_one_backbone_and_the_tokenizers_stay_frozen(model, builder):
    vocab = model.vocab
    docs = [
        [text(model, 1, 2), VisualSegment(image(1)), TextSegment([vocab.eos_id])],
        [text(model), ContextSegment(image(2)), text(model, 5, vocab.eos_id - vocab.text_offset, bos=False)],
        [text(model, 4), AudioSegment(torch.randn(2 * HOP) * 0.1), TextSegment([vocab.eos_id])],
    ]
    model.train()
    try:
        assert not model.nfsp.tokenizer.training and not model.ncp.codec.training
        out = model(builder.collate(docs))
        assert set(out.heads) == {"text", "visual", "audio"}
        assert torch.isfinite(out.loss)
        out.loss.backward()
        assert all(p.grad is None for p in model.nfsp.tokenizer.parameters())
        assert all(p.grad is None for p in model.ncp.codec.parameters())
        assert model.nfsp.proj.weight.grad.abs().sum() > 0
        assert model.ncp.input_embed.weight.grad.abs().sum() > 0
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.vision_encoder.parameters())
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()


def test_a_bf16_autocast_step_trains_on_the_codes_the_tokenizers_give_in_full_precision(model, builder):
    """`precision: bf16-mixed` puts the training step under autocast; the frozen tokenizers must still run in
    fp32, or bf16 features pick other nearest codes (and the quantizer's phi mixes dtypes)."""
    vocab = model.vocab
    docs = [
        [text(model, 1, 2), VisualSegment(image(3)), TextSegment([vocab.eos_id])],
        [text(model, 4), AudioSegment(torch.randn(2 * HOP) * 0.1), TextSegment([vocab.eos_id])],
    ]
    batch = builder.collate(docs)
    full = model.encode_media(batch)
    model.train()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = model.encode_media(batch)
            out = model(batch)
        assert torch.equal(mixed.visual.tokens, full.visual.tokens) and torch.equal(mixed.audio, full.audio)
        assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
        out.loss.backward()
        assert model.nfsp.proj.weight.grad.abs().sum() > 0
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()


def test_greedy_nfsp_generation_with_the_cache_matches_the_full_forward_pass(model, builder):
    vocab = model.vocab
    prompt = [vocab.bos_id, vocab.text_offset + 3, vocab.text_offset + 9, vocab.special("<boi>")]
    codes = generate_visual(model, [prompt], temperature=0.0)
    assert [tuple(c.shape) for c in codes] == [(1, 1, s, s) for s in model.nfsp.scales]
    flat = flatten_scales(codes)[0]
    doc = [TextSegment(prompt[:-1]), VisualSegment(codes=flat)]
    batch = builder.collate([doc])
    out = model(batch)
    where = batch.targets["visual"][0] >= 0
    ranked_first = model.nfsp.logits(out.backbone.hidden[0][where]).argmax(-1)
    assert torch.equal(ranked_first, flat)
    assert model.nfsp.decode(codes).shape == (1, 3, 32, 32)


def test_guidance_of_one_is_the_conditional_model(model):
    vocab = model.vocab
    prompt = [vocab.bos_id, vocab.text_offset + 3, vocab.special("<boi>")]
    plain = generate_visual(model, [prompt], temperature=0.0)
    guided = generate_visual(model, [prompt], cfg_scale=1.0, temperature=0.0)
    assert all(torch.equal(a, b) for a, b in zip(plain, guided, strict=True))
    strong = generate_visual(model, [prompt], cfg_scale=4.0, temperature=0.0)
    assert any(not torch.equal(a, b) for a, b in zip(plain, strong, strict=True))


def test_speech_guidance_of_one_is_the_conditional_model_and_its_unconditional_rows_are_bos_boa(model):
    vocab = model.vocab
    prompts = [[vocab.bos_id, vocab.text_offset + t, vocab.special("<boa>")] for t in (5, 9)]
    plain = generate_audio(model, prompts, max_frames=6, temperature=0.0)
    guided = generate_audio(model, prompts, max_frames=6, temperature=0.0, cfg_scale=1.0)
    assert all(torch.equal(a, b) for a, b in zip(plain, guided, strict=True))
    strong = generate_audio(model, prompts, max_frames=6, temperature=0.0, cfg_scale=4.0)
    assert any(not torch.equal(a, b) for a, b in zip(plain, strong, strict=True))
    # g = 0 would be the unconditional model alone if it weighed l_uncond only: the first frame at g -> 0
    # from above tends to what <bos><boa> alone says, which a plain run of that prompt gives.
    unconditional = generate_audio(model, [[vocab.bos_id, vocab.special("<boa>")]], 1, temperature=0.0)[0]
    faint = generate_audio(model, prompts[:1], 1, temperature=0.0, cfg_scale=1e-6)[0]
    assert torch.equal(faint, unconditional)
    with pytest.raises(ValueError, match="cfg_scale must be >= 0"):
        generate_audio(model, prompts, 2, cfg_scale=-1.0)


def test_greedy_ncp_generation_with_the_cache_matches_the_full_forward_pass(model, builder):
    vocab = model.vocab
    prompt = [vocab.bos_id, vocab.text_offset + 5, vocab.special("<boa>")]
    frames = generate_audio(model, [prompt], max_frames=6, temperature=0.0)[0]
    assert frames.shape[1] == 4 and 1 <= frames.shape[0] <= 6
    batch = builder.collate([[TextSegment(prompt[:-1]), AudioSegment(codes=frames)]])
    hidden = model(batch).backbone.hidden[0]
    # <boa> and every frame but the last predict a frame.
    predictors = (batch.targets["audio"][0] >= 0).nonzero()[:, 0]
    replayed, _ = model.ncp.sample(hidden[predictors], temperature=0.0)
    assert torch.equal(replayed, frames[: len(predictors)])
    assert model.ncp.decode(frames[None]).shape == (1, len(frames) * HOP)


def test_captioning_after_media_with_the_cache_matches_the_full_forward_pass(model, builder):
    vocab = model.vocab
    prompts = [
        [text(model), ContextSegment(image(3))],
        [text(model), VisualSegment(image(4), predict=False)],
    ]
    out = generate_text_after(model, builder.collate_prompts(prompts), 4, temperature=0.0, stop_ids=(-1,))
    for prompt, tokens in zip(prompts, out, strict=True):
        batch = builder.collate([[*prompt, TextSegment(tokens)]])
        logits = model.text_head.logits(model(batch).backbone.hidden[0])
        n = int(batch.valid.sum())
        assert logits[n - 5 : n - 1].argmax(-1).tolist() == tokens
        assert all(t < vocab.text_head_size for t in tokens)


def test_a_multimodal_model_round_trips_through_the_hub_format(model, builder, tmp_path):
    save_pretrained(model, tmp_path / "mm")
    loaded = from_pretrained(tmp_path / "mm")
    assert isinstance(loaded.visual_tokenizer, VisualTokenizer) and isinstance(loaded.audio_codec, AudioCodec)
    batch = builder.collate([[text(model, 1), VisualSegment(image(5)), AudioSegment(torch.randn(HOP) * 0.1)]])
    assert torch.allclose(model(batch).loss, loaded(batch).loss)


def test_video_is_frames_of_scales_and_greedy_generation_matches_the_full_forward_pass():
    torch.manual_seed(0)
    tokenizer = VisualTokenizer(temporal=True, temporal_stride=2)
    vocab = UnifiedVocab(text_size=64, visual_size=tokenizer.codebook_size, audio_size=256, audio_levels=4)
    backbone = UnifiedTransformer(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=4, expert_hidden=32, top_k=2, max_seq_len=512
    )
    model = UnifiedModel(backbone, vocab, mtp_depth=0, visual_tokenizer=tokenizer).eval()
    builder = SequenceBuilder(vocab, 400, layout=MediaLayout(tokenizer.scales, temporal_stride=2))
    video = torch.rand(3, 5, 32, 32) * 2 - 1  # 5 frames -> 1 + 2 latent frames
    batch = builder.collate([[TextSegment([vocab.bos_id]), VisualSegment(video)]])
    visual = batch.modality[0] == Modality.VIDEO
    assert int(visual.sum()) == 3 * 85
    assert batch.positions[0, 0][visual].unique().tolist() == [2, 3, 4]  # t advances per latent frame
    assert batch.input_ids[0, 1] == vocab.special("<bov>")
    prompt = [vocab.bos_id, vocab.text_offset + 2, vocab.special("<bov>")]
    codes = generate_visual(model, [prompt], frames=3, temperature=0.0)
    flat = flatten_scales(codes)[0]
    fed = builder.collate([[TextSegment(prompt[:-1]), VisualSegment(codes=flat, video=True)]])
    where = fed.targets["visual"][0] >= 0
    assert torch.equal(model.nfsp.logits(model(fed).backbone.hidden[0][where]).argmax(-1), flat)
    assert model.nfsp.decode(codes).shape == (1, 3, 5, 32, 32)
