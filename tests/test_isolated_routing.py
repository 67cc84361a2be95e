"""Modality-isolated routing (ERNIE 4.5's separate expert pools), the ablation of ERNIE 5.0's agnostic
router: tokens choose only within their modality's pool, shared experts stay shared, a partition that does
not fit is refused, and without the option nothing changes."""

import pytest
import torch

from zoo.batch import GroupBatch, Modality
from zoo.hub import from_pretrained, save_pretrained
from zoo.models.backbone import UnifiedTransformer
from zoo.models.elastic import ElasticConfig
from zoo.models.moe import ModalityPools, Router
from zoo.registry import create_model

N_EXPERTS, TOP_K = 8, 2
TEXT_POOL = (0, 1, 2, 3)
VISION_POOL = (4, 5, 6, 7)
POOLS = ModalityPools(text=TEXT_POOL, image=VISION_POOL, video=VISION_POOL, audio=VISION_POOL)


def small_model(seed: int = 0, modality_pools: ModalityPools | None = None):
    torch.manual_seed(seed)
    return create_model(
        "tiny",
        dim=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        n_dense_layers=1,
        n_experts=N_EXPERTS,
        expert_hidden=32,
        top_k=TOP_K,
        max_seq_len=64,
        modality_pools=modality_pools,
    ).eval()


def mixed_batch(modalities: list[list[int]]) -> GroupBatch:
    """One document per row, one group per position, the given modality per position."""
    modality = torch.tensor(modalities)
    b, n = modality.shape
    return GroupBatch(
        input_ids=torch.full((b, n), 20),
        modality=modality,
        group_id=torch.arange(n).expand(b, n).clone(),
        doc_id=torch.zeros(b, n, dtype=torch.long),
        positions=torch.arange(n).view(1, 1, n).expand(3, b, n).clone(),
    )


TEXT, IMAGE, AUDIO = int(Modality.TEXT), int(Modality.IMAGE), int(Modality.AUDIO)
LAYOUT = [[TEXT] * 5 + [IMAGE] * 6 + [TEXT] * 3, [AUDIO] * 4 + [TEXT] * 6 + [IMAGE] * 4]


def routed_by_modality(out, batch) -> dict[int, set[int]]:
    modality = batch.modality[batch.valid]
    chosen: dict[int, set[int]] = {}
    for _, r in out.router:
        for m in modality.unique().tolist():
            chosen.setdefault(m, set()).update(r.indices[modality == m].flatten().tolist())
    return chosen


def test_isolated_text_tokens_never_choose_a_vision_pool_expert_and_vice_versa():
    model = small_model(modality_pools=POOLS)
    batch = mixed_batch(LAYOUT)
    x = torch.randn(2, 14, 64) * 3  # large, varied inputs: an agnostic router would cross the pools
    with torch.no_grad():
        chosen = routed_by_modality(model.backbone(x, batch), batch)
        # an elastic sub-model (fewer layers, smaller top-k) keeps the isolation
        sub = model.backbone(x, batch, elastic=ElasticConfig(layers=(0, 2), top_k=1))
    assert chosen[TEXT] <= set(TEXT_POOL) and chosen[IMAGE] <= set(VISION_POOL)
    assert chosen[AUDIO] <= set(VISION_POOL)
    assert routed_by_modality(sub, batch)[TEXT] <= set(TEXT_POOL)
    # the same inputs through the agnostic router do cross: the isolation is the option's doing
    agnostic = small_model()
    with torch.no_grad():
        free = routed_by_modality(agnostic.backbone(x, batch), batch)
    assert not free[TEXT] <= set(TEXT_POOL) and not free[IMAGE] <= set(VISION_POOL)


def test_isolated_gate_weights_are_the_softmax_over_the_pool_alone():
    model = small_model(modality_pools=POOLS)
    router = model.backbone.layers[1].ffn.router
    h = torch.randn(5, 64)
    text_only = torch.zeros(5, N_EXPERTS, dtype=torch.bool)
    text_only[:, list(TEXT_POOL)] = True
    with torch.no_grad():
        out = router(h, expert_mask=text_only)
        pool_probs = router.gate(h)[:, list(TEXT_POOL)].softmax(-1)
    assert torch.allclose(out.probs[:, list(TEXT_POOL)], pool_probs, atol=1e-6)
    assert torch.all(out.probs[:, list(VISION_POOL)] == 0)


def test_without_pools_the_outputs_do_not_depend_on_the_option_or_the_modality_labels():
    model = small_model()
    x = torch.randn(2, 14, 64)
    batch = mixed_batch(LAYOUT)
    as_text = mixed_batch([[TEXT] * 14, [TEXT] * 14])
    with torch.no_grad():
        before = model.backbone(x, batch)
        assert torch.equal(before.hidden, model.backbone(x, as_text).hidden)
        model.backbone.set_modality_pools(POOLS)
        isolated = model.backbone(x, batch)
        model.backbone.set_modality_pools(None)
        after = model.backbone(x, batch)
    assert not torch.equal(isolated.hidden, before.hidden)
    assert torch.equal(after.hidden, before.hidden)
    for (_, a), (_, b) in zip(before.router, after.router, strict=True):
        assert torch.equal(a.indices, b.indices)
    assert model.backbone.init_args["modality_pools"] is None


def test_a_text_only_batch_gives_the_vision_pool_no_gradient_while_shared_experts_learn():
    model = small_model(modality_pools=POOLS).train()
    batch = mixed_batch([[TEXT] * 10, [TEXT] * 10])
    model.backbone(torch.randn(2, 10, 64), batch).hidden.square().sum().backward()
    ffn = model.backbone.layers[1].ffn
    assert torch.all(ffn.router.gate.weight.grad[list(VISION_POOL)] == 0)
    assert torch.all(ffn.experts.w1.grad[list(VISION_POOL)] == 0)
    assert ffn.experts.w1.grad[list(TEXT_POOL)].abs().sum() > 0
    assert ffn.shared.w1.weight.grad.abs().sum() > 0


def test_partitions_that_do_not_fit_n_experts_are_refused_with_the_reason():
    def build(pools: ModalityPools, top_k: int = TOP_K) -> None:
        UnifiedTransformer(
            dim=32,
            n_layers=2,
            n_heads=2,
            n_kv_heads=1,
            n_experts=N_EXPERTS,
            top_k=top_k,
            expert_hidden=16,
            modality_pools=pools,
        )

    with pytest.raises(ValueError, match=r"experts \[6, 7\] in no pool"):
        build(ModalityPools(text=(0, 1, 2), image=(3, 4, 5)))
    with pytest.raises(ValueError, match="expert 3 is in two different pools"):
        build(ModalityPools(text=(0, 1, 2, 3), image=(3, 4, 5, 6, 7)))
    with pytest.raises(ValueError, match=r"out of range: expected ids in \[0, 8\)"):
        build(ModalityPools(text=(0, 1, 2, 3), image=(4, 5, 6, 7, 8)))
    with pytest.raises(ValueError, match="fewer than top_k=3"):
        build(ModalityPools(text=(0, 1), image=(2, 3, 4, 5, 6, 7)), top_k=3)
    with pytest.raises(ValueError, match="repeats an expert"):
        build(ModalityPools(text=(0, 0, 1, 2, 3), image=VISION_POOL))
    with pytest.raises(ValueError, match="no modality any expert"):
        build(ModalityPools())
    # a modality without a pool is fine until one of its tokens arrives
    model = small_model(modality_pools=ModalityPools(text=TEXT_POOL, image=VISION_POOL))
    with pytest.raises(ValueError, match="no experts to AUDIO tokens"):
        model.backbone(torch.randn(2, 14, 64), mixed_batch(LAYOUT))


def test_elastic_width_that_leaves_a_pool_short_of_top_k_is_an_error_naming_the_fix():
    model = small_model(modality_pools=POOLS)
    batch = mixed_batch(LAYOUT)
    with pytest.raises(ValueError, match="p_full_width=1.0"):
        model.backbone(torch.randn(2, 14, 64), batch, elastic=ElasticConfig(experts=(0, 4, 5, 6, 7)))


def test_extract_renumbers_the_pools_and_equals_the_full_model():
    model = small_model(modality_pools=POOLS)
    batch = mixed_batch(LAYOUT)
    config = ElasticConfig(experts=(0, 1, 2, 4, 5, 7))
    x = torch.randn(2, 14, 64)
    small = model.backbone.extract(config)
    assert small.modality_pools.text == (0, 1, 2) and small.modality_pools.image == (3, 4, 5)
    with torch.no_grad():
        torch.testing.assert_close(small(x, batch).hidden, model.backbone(x, batch, elastic=config).hidden)


def test_pools_survive_the_hub_round_trip(tmp_path):
    model = small_model(modality_pools=POOLS)
    loaded = from_pretrained(save_pretrained(model, tmp_path / "isolated"))
    assert loaded.backbone.modality_pools == POOLS
    batch, x = mixed_batch(LAYOUT), torch.randn(2, 14, 64)
    with torch.no_grad():
        assert torch.equal(loaded.backbone(x, batch).hidden, model.backbone(x, batch).hidden)


def test_aux_free_bias_balances_within_each_pool():
    router = Router(dim=8, n_experts=N_EXPERTS, top_k=TOP_K, balancing="aux_free")
    router.set_pools(POOLS.pool_of_expert(N_EXPERTS))
    # text experts see far more tokens than vision experts; inside each pool expert 0 / 4 is the busiest
    router.tokens_per_expert.copy_(torch.tensor([40.0, 20, 20, 20, 8, 2, 2, 2]))
    router.calls_available.fill_(1.0)
    router.update_bias(gamma=1.0)
    bias = router.expert_bias
    # within a pool the busiest expert goes down and the others up, whatever the other pool's load
    assert bias[0] < bias[1] and bias[4] < bias[5]
    assert bias[1] == bias[2] == bias[3] and bias[5] == bias[6] == bias[7]
