"""Specification of zoo/models/moe.py: routing, dispatch, elastic width/top-k, replay and balancing."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from zoo.models.moe import (
    Experts,
    MoEFeedForward,
    Router,
    SwiGLU,
    expert_mask_of,
    grouped_matmul,
)

DIM, N_EXPERTS, HIDDEN, TOP_K = 16, 8, 12, 2


def reference_moe(moe: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """The textbook MoE: for every token, for every chosen expert, add weight * expert(token)."""
    flat = x.reshape(-1, moe.dim)
    routing = moe.router(flat)
    ex = moe.experts
    out = torch.zeros_like(flat)
    for n in range(flat.shape[0]):
        for j in range(routing.indices.shape[1]):
            e = int(routing.indices[n, j])
            h = F.silu(flat[n] @ ex.w1[e]) * (flat[n] @ ex.w3[e])
            out[n] = out[n] + routing.weights[n, j] * (h @ ex.w2[e])
    if moe.shared is not None:
        out = out + moe.shared(flat)
    return out.view(x.shape)


def make_moe(score_func: str = "softmax", n_shared: int = 0, balancing: str = "aux_loss") -> MoEFeedForward:
    torch.manual_seed(0)
    moe = MoEFeedForward(
        DIM, N_EXPERTS, HIDDEN, TOP_K, n_shared_experts=n_shared, score_func=score_func, balancing=balancing
    )
    # Larger weights than the 0.02 init so that every expert and gate matters in the comparisons.
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=0.3)
    return moe


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("n_shared", [0, 2])
def test_output_and_gradients_equal_a_per_token_reference_loop(score_func: str, n_shared: int) -> None:
    moe = make_moe(score_func, n_shared)
    x = torch.randn(3, 7, DIM, requires_grad=True)
    out = moe(x).out
    grads = torch.autograd.grad(out.square().sum(), [x, *moe.parameters()])

    ref_out = reference_moe(moe, x)
    ref_grads = torch.autograd.grad(ref_out.square().sum(), [x, *moe.parameters()])

    assert out.shape == x.shape
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    names = ["x"] + [name for name, _ in moe.named_parameters()]
    for name, g, r in zip(names, grads, ref_grads, strict=True):
        # fp32 sums in a different order: compare relative to the gradient's scale
        error = float((g - r).abs().max() / r.abs().max())
        assert error < 1e-5, f"gradient of {name} differs by {error:.2e} of its scale"


def test_gate_receives_gradient_through_the_gate_weights() -> None:
    moe = make_moe()
    moe(torch.randn(10, DIM)).out.sum().backward()
    assert moe.router.gate.weight.grad is not None and moe.router.gate.weight.grad.abs().sum() > 0


def test_grouped_matmul_padded_fallback_equals_grouped_path() -> None:
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1])
    offsets = counts.cumsum(0, dtype=torch.int32)
    x = torch.randn(9, 8, dtype=torch.float64)
    w = torch.randn(4, 8, 4, dtype=torch.float64)
    got = grouped_matmul(x, w, counts, offsets)  # float64 is not accepted by torch._grouped_mm
    want = torch.cat([x[0:3] @ w[0], x[3:8] @ w[2], x[8:9] @ w[3]])
    torch.testing.assert_close(got, want)
    fast = grouped_matmul(x.float(), w.float(), counts, offsets)
    torch.testing.assert_close(fast.double(), want, atol=1e-5, rtol=1e-5)


def test_moe_runs_in_float64_and_with_dims_the_grouped_kernel_rejects() -> None:
    torch.manual_seed(0)
    odd = MoEFeedForward(6, 4, 5, 2, n_shared_experts=1)  # rows of 6 * 4 bytes: not 16-byte aligned
    x = torch.randn(5, 6, requires_grad=True)
    out = odd(x).out
    torch.testing.assert_close(out, reference_moe(odd, x))
    out.sum().backward()
    assert x.grad is not None and odd.experts.w2.grad is not None
    moe = make_moe().double()
    x64 = torch.randn(4, DIM, dtype=torch.float64)
    torch.testing.assert_close(moe(x64).out, reference_moe(moe, x64))


def test_experts_gradients_pass_gradcheck_with_an_empty_expert() -> None:
    torch.manual_seed(0)
    experts = Experts(3, 4, 5).double()
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(6, dtype=torch.float64, requires_grad=True)
    counts = torch.tensor([2, 0, 4])
    params = (experts.w1, experts.w3, experts.w2)
    assert torch.autograd.gradcheck(lambda x, w, *_: experts(x, counts, w), (x, weights, *params))
    torch.testing.assert_close(experts(x, counts), experts(x, counts, torch.ones(6, dtype=torch.float64)))


def test_bfloat16_input_runs_and_returns_bfloat16() -> None:
    moe = make_moe()
    x = torch.randn(2, 5, DIM)
    with torch.no_grad():
        want = moe(x).out
        got = moe.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert got.out.dtype == torch.bfloat16 and got.router.weights.dtype == torch.bfloat16
    assert float((got.out.float() - want).abs().max() / want.abs().max()) < 0.05


def test_router_forward_takes_no_modality_argument() -> None:
    params = list(inspect.signature(Router.forward).parameters)
    assert params == ["self", "x", "top_k", "expert_mask", "forced_indices"]
    params = list(inspect.signature(MoEFeedForward.forward).parameters)
    assert params == ["self", "x", "top_k", "expert_mask", "forced_indices"]


def test_identical_hidden_states_route_identically_anywhere_in_any_batch() -> None:
    moe = make_moe()
    token = torch.randn(DIM)
    batch_a = torch.randn(2, 5, DIM)
    batch_b = torch.randn(4, 3, DIM)
    batch_a[1, 3] = token
    batch_b[0, 0] = token
    batch_b[3, 2] = token
    ra = moe.router(batch_a.reshape(-1, DIM))
    rb = moe.router(batch_b.reshape(-1, DIM))
    sets = [ra.indices[8].sort().values, rb.indices[0].sort().values, rb.indices[11].sort().values]
    assert all(torch.equal(sets[0], s) for s in sets[1:])
    torch.testing.assert_close(ra.weights[8].sort().values, rb.weights[11].sort().values)
    out_a, out_b = moe(batch_a).out, moe(batch_b).out
    torch.testing.assert_close(out_a[1, 3], out_b[0, 0])
    torch.testing.assert_close(out_a[1, 3], out_b[3, 2])


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_expert_mask_never_selects_dropped_experts(score_func: str) -> None:
    moe = make_moe(score_func, balancing="aux_free")
    moe.router.expert_bias[:] = torch.tensor([5.0, 0, 0, 0, 0, 0, 0, -5.0])  # tempt it towards expert 0
    keep = [1, 2, 5, 7]
    routing = moe.router(torch.randn(200, DIM), expert_mask=expert_mask_of(keep, N_EXPERTS))
    assert set(routing.indices.unique().tolist()) <= set(keep)
    dropped = [e for e in range(N_EXPERTS) if e not in keep]
    assert routing.probs[:, dropped].abs().max() == 0
    assert routing.load[dropped].sum() == 0
    if score_func == "softmax":
        torch.testing.assert_close(routing.probs.sum(-1), torch.ones(200))


def test_elastic_top_k_is_respected() -> None:
    moe = make_moe()
    x = torch.randn(30, DIM)
    for k in (1, 3, 5):
        routing = moe(x, top_k=k).router
        assert routing.indices.shape == (30, k)
        assert all(len(set(row)) == k for row in routing.indices.tolist())
        assert routing.load.sum() == 30 * k
    with pytest.raises(ValueError, match="top_k"):
        moe(x, top_k=N_EXPERTS + 1)
    with pytest.raises(ValueError, match="top_k"):
        moe(x, top_k=3, expert_mask=expert_mask_of([0, 1], N_EXPERTS))


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_extract_equals_the_masked_full_model_and_has_fewer_parameters(score_func: str) -> None:
    moe = make_moe(score_func, n_shared=1, balancing="aux_free")
    moe.router.expert_bias.normal_()
    keep = [6, 1, 3, 4]
    small = moe.extract(keep, top_k=1)
    x = torch.randn(2, 9, DIM)
    full = moe(x, top_k=1, expert_mask=expert_mask_of(keep, N_EXPERTS))
    got = small(x)
    torch.testing.assert_close(got.out, full.out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.router.z_loss, full.router.z_loss)
    assert sum(p.numel() for p in small.parameters()) < sum(p.numel() for p in moe.parameters())
    assert small.experts.w1.shape[0] == len(keep) and small.router.gate.weight.shape[0] == len(keep)
    with torch.no_grad():
        small.experts.w1.zero_()  # copies, not views
    assert moe.experts.w1.abs().sum() > 0


def test_extract_rejects_bad_expert_lists() -> None:
    moe = make_moe()
    for keep in ([], [1, 1], [0, N_EXPERTS]):
        with pytest.raises(ValueError, match="keep_experts"):
            moe.extract(keep)


def test_forced_indices_reproduce_recorded_sets_and_gradients_reach_the_gate() -> None:
    moe = make_moe()
    x = torch.randn(12, DIM)
    recorded = moe.router(x).indices
    with torch.no_grad():
        moe.router.gate.weight.add_(torch.randn_like(moe.router.gate.weight))  # policy moved on
    assert not torch.equal(moe.router(x).indices, recorded)
    replay = moe(x, forced_indices=recorded)
    assert torch.equal(replay.router.indices, recorded)
    live = moe.router(x).probs.gather(1, recorded)
    torch.testing.assert_close(replay.router.weights, live / live.sum(-1, keepdim=True))
    replay.out.square().sum().backward()
    assert moe.router.gate.weight.grad.abs().sum() > 0


def test_forced_indices_are_validated() -> None:
    moe = make_moe()
    x = torch.randn(4, DIM)
    with pytest.raises(ValueError, match="forced_indices"):
        moe(x, forced_indices=torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="forced_indices"):
        moe(x, forced_indices=torch.full((4, 2), N_EXPERTS))
    with pytest.raises(ValueError, match="repeats"):
        moe(x, forced_indices=torch.zeros(4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="drops"):
        moe(x, forced_indices=torch.tensor([[0, 1]] * 4), expert_mask=expert_mask_of([1, 2], N_EXPERTS))


def test_update_bias_moves_towards_underloaded_experts_and_keeps_mean_zero() -> None:
    router = Router(DIM, 4, 1, score_func="sigmoid", balancing="aux_free")
    router.tokens_per_expert.copy_(torch.tensor([10.0, 2.0, 5.0, 3.0]))  # mean load 5
    router.calls_available.fill_(1.0)  # one routing call, every expert available
    load = router.update_bias(0.1)
    assert torch.equal(load, torch.tensor([10.0, 2.0, 5.0, 3.0]))
    b = router.expert_bias
    assert b[1] > b[2] > b[0] and b[1] == b[3]  # underloaded up, balanced unchanged, overloaded down
    torch.testing.assert_close(b[1] - b[0], torch.tensor(0.2))
    assert abs(float(b.mean())) < 1e-7
    assert router.tokens_per_expert.sum() == 0


def test_update_bias_ignores_experts_that_elastic_width_dropped() -> None:
    torch.manual_seed(0)
    moe = MoEFeedForward(DIM, 8, 16, 2, balancing="aux_free").train()
    moe(torch.randn(64, DIM), expert_mask=expert_mask_of([0, 1, 2, 3], 8))
    load = moe.router.update_bias(1e-3)
    bias = moe.router.expert_bias
    # Dropped experts were never choosable: their zero load is no signal, so only re-centring moves them,
    # and the kept ones are compared among themselves (the busiest goes down, the idlest up).
    assert bias[4:].abs().max() < 1e-3 / 2
    assert bias[int(load[:4].argmax())] < 0 < bias[int(load[:4].argmin())]
    assert abs(float(bias.mean())) < 1e-7


def test_bias_selects_experts_but_never_changes_gate_weights() -> None:
    router = Router(DIM, 4, 2, score_func="sigmoid", balancing="aux_free")
    x = torch.randn(50, DIM)
    before = router(x)
    router.expert_bias.copy_(torch.tensor([-10.0, -10.0, 10.0, 10.0]))
    after = router(x)
    assert torch.equal(after.indices.sort(-1).values, torch.tensor([[2, 3]] * 50))
    chosen = before.probs.gather(1, after.indices)
    torch.testing.assert_close(after.weights, chosen / chosen.sum(-1, keepdim=True))


def test_training_accumulates_load_for_the_bias_callback_and_eval_does_not() -> None:
    router = Router(DIM, 4, 2, balancing="aux_free")
    router(torch.randn(10, DIM))
    router(torch.randn(5, DIM))
    assert router.tokens_per_expert.sum() == 30
    router.eval()
    router(torch.randn(5, DIM))
    assert router.tokens_per_expert.sum() == 30
    assert "tokens_per_expert" not in router.state_dict() and "expert_bias" in router.state_dict()


def test_update_bias_is_a_no_op_without_aux_free_balancing() -> None:
    router = Router(DIM, 4, 1, balancing="aux_loss")
    router.tokens_per_expert.copy_(torch.tensor([10.0, 2.0, 4.0, 4.0]))
    router.update_bias(0.1)
    assert router.expert_bias.abs().sum() == 0


def test_aux_loss_is_the_coefficient_for_uniform_routing_and_larger_when_collapsed() -> None:
    n, coef = 64, 0.01
    router = Router(DIM, 4, 1, aux_loss_coef=coef)
    with torch.no_grad():
        router.gate.weight.zero_()  # every expert equally likely: P_i = 1/4
    x = torch.randn(n, DIM)
    uniform = router(x, forced_indices=torch.arange(n).remainder(4).unsqueeze(1))  # f_i = 1/4
    torch.testing.assert_close(uniform.aux_loss, torch.tensor(coef))
    with torch.no_grad():
        router.gate.weight[0] = 1.0
    collapsed = router(x.abs())  # everything prefers expert 0
    assert (collapsed.indices == 0).all()
    assert collapsed.aux_loss > 2 * coef
    assert Router(DIM, 4, 1, balancing="aux_free")(x).aux_loss == 0


def test_z_loss_is_the_mean_squared_logsumexp_of_the_logits() -> None:
    router = Router(DIM, N_EXPERTS, 2, z_loss_coef=0.5)
    x = torch.randn(20, DIM)
    expected = 0.5 * torch.logsumexp(router.gate(x), dim=-1).square().mean()
    torch.testing.assert_close(router(x).z_loss, expected)


def test_dense_swiglu_and_experts_shapes() -> None:
    assert SwiGLU(DIM, 24)(torch.randn(2, 3, DIM)).shape == (2, 3, DIM)
    experts = Experts(N_EXPERTS, DIM, HIDDEN)
    assert experts.w1.shape == (N_EXPERTS, DIM, HIDDEN) and experts.w2.shape == (N_EXPERTS, HIDDEN, DIM)
    with pytest.raises(ValueError, match="counts"):
        experts(torch.randn(4, DIM), torch.tensor([4]))


def test_bad_inputs_name_what_was_expected() -> None:
    moe = make_moe()
    with pytest.raises(ValueError, match="width"):
        moe(torch.randn(3, DIM + 1))
    with pytest.raises(ValueError, match="expert_mask"):
        moe(torch.randn(3, DIM), expert_mask=torch.ones(N_EXPERTS))
    with pytest.raises(ValueError, match="every expert"):
        moe(torch.randn(3, DIM), expert_mask=torch.zeros(N_EXPERTS, dtype=torch.bool))
    with pytest.raises(ValueError, match="score_func"):
        Router(DIM, 4, 1, score_func="relu")  # type: ignore[arg-type]


def test_decoding_few_assignments_skips_the_sort_and_computes_exactly_what_the_sorted_path_does():
    torch.manual_seed(0)
    moe = MoEFeedForward(dim=32, n_experts=16, expert_hidden=8, top_k=3, n_shared_experts=1).eval()
    x = torch.randn(4, 32)  # 12 assignments < 16 experts: the unsorted path
    with torch.no_grad():
        out = moe(x)
        # The sorted path, step by step: sort assignments by expert, run them, add each token's slots.
        routing = out.router
        order = routing.indices.t().reshape(-1).argsort(stable=True)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
        rows = x.index_select(0, order.remainder(4))
        weights = routing.weights.t().reshape(-1).index_select(0, order)
        expert_rows = moe.experts(rows, routing.load.long(), weights).index_select(0, inverse).view(3, 4, 32)
        expected = expert_rows[0] + expert_rows[1]
        expected += expert_rows[2]
        expected = expected + moe.shared(x)
    assert torch.equal(out.out, expected)
