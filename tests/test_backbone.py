"""The backbone as a specification: the group mask, Uni-RoPE, modality-blind routing, elastic
sub-models and their extraction, the KV cache, and bad input."""

import inspect

import pytest
import torch

from zoo.batch import IGNORE_INDEX, PAD_DOC, GroupBatch, Modality, group_attention_mask
from zoo.datamodules.sequence import SequenceBuilder, TextSegment
from zoo.models.backbone import UnifiedTransformer, UniRoPE, apply_rotary
from zoo.models.elastic import ElasticConfig, ElasticSampler
from zoo.models.generation import speculative_generate
from zoo.models.unified import UnifiedModel
from zoo.registry import create_model
from zoo.tokenizers.vocab import UnifiedVocab


def small_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> UnifiedModel:
    torch.manual_seed(seed)
    args = dict(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        n_dense_layers=1,
        n_experts=8,
        expert_hidden=32,
        top_k=2,
        max_seq_len=128,
    )
    args.update(overrides)
    model = create_model("tiny", **args).to(dtype)
    return model.eval()


def hand_batch(doc, group, modality=None) -> GroupBatch:
    doc, group = torch.tensor([doc]), torch.tensor([group])
    n = doc.shape[1]
    modality = torch.full_like(doc, int(Modality.TEXT)) if modality is None else torch.tensor([modality])
    return GroupBatch(
        input_ids=torch.full_like(doc, 20),
        modality=modality,
        group_id=group,
        doc_id=doc,
        positions=torch.arange(n).view(1, 1, n).expand(3, 1, n).clone(),
    )


def test_group_mask_is_causal_across_groups_and_bidirectional_inside():
    # doc 0: a text token (group 0), a 2-position scale (group 1), a text token (group 2); doc 1: two tokens.
    batch = hand_batch(doc=[0, 0, 0, 0, 1, 1], group=[0, 1, 1, 2, 0, 1])
    mask = batch.attention_mask()[0, 0].int()
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],  # sees its group partner ahead of it
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [0, 0, 0, 0, 1, 0],  # a new document sees nothing of the previous one
            [0, 0, 0, 0, 1, 1],
        ]
    )
    assert torch.equal(mask, expected)


def test_padding_sees_only_itself_and_nothing_sees_padding():
    batch = hand_batch(doc=[PAD_DOC, PAD_DOC, 0, 0], group=[0, 0, 0, 1])
    mask = batch.attention_mask()[0, 0]
    assert mask[0].tolist() == [True, False, False, False]
    assert not mask[2:, :2].any()


def test_cached_mask_equals_the_corresponding_rows_of_the_full_mask():
    doc = torch.tensor([[0, 0, 0, 0, 0]])
    group = torch.tensor([[0, 1, 2, 2, 3]])
    full = group_attention_mask(doc, group, doc, group, query_offset=0)
    step = group_attention_mask(doc[:, 2:4], group[:, 2:4], doc[:, :4], group[:, :4], query_offset=2)
    assert torch.equal(step, full[:, :, 2:4, :4])


def test_uni_rope_on_text_equals_ordinary_1d_rope():
    head_dim, length = 16, 7
    rope = UniRoPE(head_dim, theta=10000.0)
    pos = torch.arange(length).view(1, 1, length).expand(3, 1, length)
    cos, sin = rope(pos)
    inv = 1.0 / 10000.0 ** (torch.arange(0, head_dim // 2).float() / (head_dim // 2))
    angles = torch.arange(length).float()[:, None] * inv
    assert torch.allclose(cos[0], torch.cat([angles, angles], -1).cos(), atol=1e-6)
    assert torch.allclose(sin[0], torch.cat([angles, angles], -1).sin(), atol=1e-6)


def test_uni_rope_sections_read_their_own_axis():
    rope = UniRoPE(16, sections=(4, 2, 2))
    pos = torch.zeros(3, 1, 1, dtype=torch.long)
    pos[1] = 5  # only h moves: only the h section (pairs 4, 5) may rotate
    cos, _ = rope(pos)
    rotated = (cos[0, 0, :8] - 1).abs() > 1e-6
    assert rotated.tolist() == [False] * 4 + [True] * 2 + [False] * 2


def test_rotary_makes_attention_scores_depend_on_relative_position_only():
    rope = UniRoPE(8)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(i, j):
        pi = torch.full((3, 1, 1), i)
        pj = torch.full((3, 1, 1), j)
        return (apply_rotary(q, *rope(pi)) * apply_rotary(k, *rope(pj))).sum()

    assert torch.allclose(score(3, 1), score(10, 8), atol=1e-5)


def test_router_never_sees_the_modality():
    model = small_model()
    router = model.backbone.layers[1].ffn.router
    inputs = list(inspect.signature(router.forward).parameters)
    assert inputs == ["x", "top_k", "expert_mask", "forced_indices"]
    h = torch.randn(3, 64)
    assert torch.equal(router(torch.cat([h, h])).indices[:3], router(torch.cat([h, h])).indices[3:])
    # The same embeddings labelled text or image give the same hidden states and the same expert choices.
    x = torch.randn(1, 6, 64)
    as_text = hand_batch(doc=[0] * 6, group=[0, 1, 2, 3, 4, 5], modality=[int(Modality.TEXT)] * 6)
    as_image = hand_batch(doc=[0] * 6, group=[0, 1, 2, 3, 4, 5], modality=[int(Modality.IMAGE)] * 6)
    text_out, image_out = model.backbone(x, as_text), model.backbone(x, as_image)
    assert torch.equal(text_out.hidden, image_out.hidden)
    for (_, a), (_, b) in zip(text_out.router, image_out.router, strict=True):
        assert torch.equal(a.indices, b.indices)


def test_elastic_extract_equals_full_model_with_the_same_configuration():
    model = small_model()
    batch = SequenceBuilder(model.vocab, 32).collate(
        [[TextSegment([1, 20, 30, 40, 50, 2])], [TextSegment([1, 25, 35, 2])]]
    )
    config = ElasticConfig(layers=(0, 2, 3), experts=(1, 3, 4, 6), top_k=1)
    full = model(batch, elastic=config)
    small = model.extract(config)
    alone = small(batch)
    assert torch.allclose(full.backbone.hidden, alone.backbone.hidden, atol=1e-5)
    assert torch.allclose(full.loss, alone.loss, atol=1e-5)
    assert small.backbone.n_layers == 3 and small.backbone.n_experts == 4 and small.backbone.top_k == 1
    assert small.num_parameters() < model.num_parameters()
    # The extracted model is rebuilt from its own spec alone (what a checkpoint stores).
    rebuilt = UnifiedModel(UnifiedTransformer(**small.backbone.init_args), model.vocab)
    assert sum(p.numel() for p in rebuilt.parameters()) == small.num_parameters()


def test_elastic_sampler_follows_the_paper_probabilities_and_is_reproducible():
    sampler = ElasticSampler(seed=3)
    draws = [sampler.sample(step, 8, 16, 4) for step in range(2000)]
    assert draws[:50] == [sampler.sample(step, 8, 16, 4) for step in range(50)]
    full_depth = sum(d.layers is None for d in draws) / len(draws)
    full_width = sum(d.experts is None for d in draws) / len(draws)
    full_topk = sum(d.top_k is None for d in draws) / len(draws)
    assert abs(full_depth - 0.75) < 0.04 and abs(full_width - 0.8) < 0.04 and abs(full_topk - 0.8) < 0.04
    for d in draws:
        if d.layers is not None:
            assert d.layers[0] == 0 and d.layers[-1] == 7 and len(d.layers) < 8
        if d.top_k is not None:
            assert 1 <= d.top_k < 4


def test_kv_cache_generation_equals_recomputation():
    model = small_model()
    prompts = [[1, 20, 21, 22], [1, 30]]
    cached = model.generate(prompts, 12, temperature=0, use_cache=True, stop_ids=())
    recomputed = model.generate(prompts, 12, temperature=0, use_cache=False, stop_ids=())
    assert cached == recomputed
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    sampled = model.generate(
        prompts, 12, temperature=1.0, top_p=0.9, use_cache=True, generator=g1, stop_ids=()
    )
    sampled_again = model.generate(
        prompts, 12, temperature=1.0, top_p=0.9, use_cache=False, generator=g2, stop_ids=()
    )
    assert sampled == sampled_again


def test_left_padding_does_not_change_a_prompts_continuation():
    model = small_model()
    alone = model.generate([[1, 30]], 8, temperature=0, stop_ids=())
    padded = model.generate([[1, 20, 21, 22, 23], [1, 30]], 8, temperature=0, stop_ids=())
    assert padded[1] == alone[0]


def test_speculative_mtp_decoding_equals_greedy_decoding():
    model = small_model(dtype=torch.float64)
    greedy = model.generate([[1, 20, 21]], 24, temperature=0, stop_ids=())[0]
    speculative, acceptance = speculative_generate(model, [1, 20, 21], 24, stop_ids=())
    assert speculative == greedy
    # Stopping: both stop right after the same stop token (here: the 5th greedy token).
    stop = (greedy[4],)
    expected = greedy[: greedy.index(stop[0]) + 1]
    assert speculative_generate(model, [1, 20, 21], 24, stop_ids=stop)[0] == expected
    assert model.generate([[1, 20, 21]], 24, temperature=0, stop_ids=stop)[0] == expected
    assert 0.0 <= acceptance <= 1.0


def test_mtp_depth_zero_and_two_both_train():
    for depth in (0, 2):
        model = small_model(mtp_depth=depth).train()
        batch = SequenceBuilder(model.vocab, 16).collate([[TextSegment([1, 20, 30, 40, 50, 60, 2])]])
        out = model(batch)
        out.loss.backward()
        keys = out.heads["text"].metrics
        assert ("text/mtp1_loss" in keys) == (depth >= 1) and ("text/mtp2_loss" in keys) == (depth >= 2)


def test_mtp_targets_stay_inside_documents():
    model = small_model(mtp_depth=1)
    # Two 3-token documents: MTP at position i predicts t_{i+2} within the same document only.
    batch = SequenceBuilder(model.vocab, 8).collate([[TextSegment([1, 20, 2])], [TextSegment([1, 30, 2])]])
    targets = batch.targets["text"][0].tolist()
    assert targets[:6] == [20, 2, IGNORE_INDEX, 30, 2, IGNORE_INDEX]
    out = model(batch)
    assert "text/mtp1_loss" in out.heads["text"].metrics  # positions 0 and 3 have a two-ahead target


def test_paper_preset_is_about_a_trillion_parameters_with_under_3_percent_active():
    model = create_model("ernie5-paper", device="meta")
    total, active = model.num_parameters(), model.num_parameters(active=True)
    assert 0.8e12 < total < 1.3e12
    assert active / total < 0.03
    assert model.backbone.top_k / model.backbone.n_experts < 0.03


def test_bad_input_is_refused_with_a_clear_message():
    model = small_model()
    with pytest.raises(ValueError, match="empty"):
        model.generate([[]], 4)
    with pytest.raises(ValueError, match="outside the allowed range"):
        model.generate([[1, model.vocab.text_head_size + 5]], 4)
    with pytest.raises(ValueError, match="exceeds the context of 128"):
        model.generate([[1] * 100], 40)
    with pytest.raises(ValueError, match="longer than seq_len=8"):
        SequenceBuilder(model.vocab, 8).collate([[TextSegment(list(range(1, 12)))]])
    with pytest.warns(UserWarning, match="truncating"):
        batch = SequenceBuilder(model.vocab, 8, truncate=True).collate([[TextSegment(list(range(1, 12)))]])
    assert batch.seq_len == 8
    with pytest.raises(KeyError, match="unknown special token"):
        UnifiedVocab().special("<image>")
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model(SequenceBuilder(model.vocab, 200).collate([[TextSegment([1] * 150)]]))
    with pytest.raises(TypeError, match="unknown override"):
        create_model("tiny", n_layer=3)
    with pytest.raises(ValueError, match="meta"):
        create_model("ernie5-paper")
