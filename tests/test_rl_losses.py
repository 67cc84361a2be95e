"""RL losses as a specification: hand-computed advantages, clipping and IcePop masks, exact zero gradients
for masked tokens, MISC against the verl-formula oracle, and micro-batches that add up to the batch."""

import math

import pytest
import torch

from zoo.batch import Modality
from zoo.rl.losses import (
    LossStats,
    MismatchBounds,
    PolicyLossConfig,
    SuccessTracker,
    aggregate,
    group_advantages,
    grpo_token_loss,
    gspo_token_loss,
    icepop_sequence_weights,
    icepop_token_weights,
    kl_k3,
    mismatch_kl,
    pad_sequences,
    policy_loss,
    token_entropy,
    wpsm_weights,
)


def leaf(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


# ------------------------------------------------------------------------------------------ advantages


def test_group_advantages_are_normalised_per_group_and_zero_for_zero_variance_groups():
    rewards = torch.tensor(
        [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 1.0, 1.0]]
    )
    adv, zero = group_advantages(rewards, eps=0.0)
    assert zero.tolist() == [False, True, True, False]
    assert torch.equal(adv[1], torch.zeros(4)) and torch.equal(adv[2], torch.zeros(4))
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # unbiased, as GRPO/verl
    assert torch.allclose(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / std)
    assert torch.allclose(adv[3], torch.tensor([1.0, -1.0, 0.0, 0.0]) / rewards[3].std())
    unscaled, _ = group_advantages(rewards, scale=False)
    assert torch.allclose(unscaled[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_group_advantages_of_a_single_response_is_zero_and_non_finite_rewards_are_refused():
    adv, zero = group_advantages(torch.tensor([[0.7]]))
    assert adv.item() == 0.0 and zero.item()
    with pytest.raises(ValueError, match="non-finite"):
        group_advantages(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="N_groups, G"):
        group_advantages(torch.tensor([1.0, 0.0]))


# --------------------------------------------------------------------------------------------- clipping


def test_grpo_clip_matches_hand_computed_values_and_gradients_for_both_signs():
    ratios = torch.tensor([[0.5, 1.0, 1.5]])
    logp_old = torch.zeros(1, 3)
    for sign, expected, grads in (
        # A = +1: -min(r, clip(r, 0.8, 1.28)); r = 1.5 is clipped high (no gradient), r = 0.5 is not.
        (1.0, [-0.5, -1.0, -1.28], [-0.5, -1.0, 0.0]),
        # A = -1: -min(-r, -clip(r)); r = 0.5 is clipped low (loss 0.8, no gradient), r = 1.5 is not.
        (-1.0, [0.8, 1.0, 1.5], [0.0, 1.0, 1.5]),
    ):
        logp = ratios.log().clone().requires_grad_(True)
        loss, low, high = grpo_token_loss(logp, logp_old, torch.tensor([sign]), clip_low=0.2, clip_high=0.28)
        assert torch.allclose(loss, torch.tensor([expected]))
        loss.sum().backward()
        assert torch.allclose(logp.grad, torch.tensor([grads]))
        assert (low.tolist(), high.tolist()) == (
            ([[True, False, False]], [[False] * 3]) if sign < 0 else ([[False] * 3], [[False, False, True]])
        )


def test_gspo_clips_whole_sequences_by_their_length_normalised_ratio():
    # Row 0: mean log-ratio 3e-4 lies inside (1 - 3e-4, 1 + 4e-4); row 1: 6e-4 lies above it.
    logp_old = torch.zeros(2, 3)
    logp = leaf([[0.0, 3e-4, 6e-4], [6e-4, 6e-4, 6e-4]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    loss, low, high = gspo_token_loss(logp, logp_old, torch.tensor([1.0, 1.0]), mask)
    assert high.tolist() == [[False] * 3, [True] * 3] and not low.any()
    assert torch.allclose(loss[0], torch.full((3,), -math.exp(3e-4)))
    assert torch.allclose(loss[1], torch.full((3,), -(1 + 4e-4)))
    loss.sum().backward()
    assert torch.count_nonzero(logp.grad[1]) == 0
    assert torch.allclose(logp.grad[0], torch.full((3,), -math.exp(3e-4)))


def test_gspo_token_form_equals_gspo_in_value_and_gradient_without_token_weights():
    torch.manual_seed(0)
    logp_old = torch.randn(3, 5) * 0.01
    base = logp_old + torch.randn(3, 5) * 1e-4
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.3, -0.7, 0.4])
    eps = (1.0, 1.0)  # wide: no clipping, so the comparison covers the gradient everywhere
    a = base.clone().requires_grad_(True)
    per_token, _, _ = gspo_token_loss(a, logp_old, adv, mask, *eps)
    aggregate(per_token, mask, "sequence").backward()
    b = base.clone().requires_grad_(True)
    m = mask.float()
    s = torch.exp(((b - logp_old) * m).sum(1) / m.sum(1))  # GSPO: gradient through the mean
    (-(s * adv).mean()).backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-7)


# ----------------------------------------------------------------------------------------------- IcePop


def test_icepop_token_weights_keep_k_inside_the_bounds_and_zero_outside_and_at_padding():
    k = torch.tensor([[0.3, 0.5, 1.0, 2.0, 5.0, 6.0]])
    logp_inf = torch.zeros(1, 6)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    w = icepop_token_weights(k.log(), logp_inf, mask, 0.5, 5.0)
    assert torch.allclose(w, torch.tensor([[0.0, 0.5, 1.0, 2.0, 5.0, 0.0]]), atol=1e-6)
    assert not w.requires_grad


def test_sequence_icepop_uses_the_geometric_mean_ratio_for_every_token_of_the_response():
    # Row 0 has one outlier token (k = 8) but a geometric mean of 2: every token kept with weight 2.
    # Row 1: geometric mean 8: the whole response is dropped.
    logp_old = torch.tensor([[math.log(8.0), math.log(2.0), math.log(0.5)], [math.log(8.0)] * 3])
    mask = torch.ones(2, 3, dtype=torch.bool)
    w = icepop_sequence_weights(logp_old, torch.zeros(2, 3), mask, 0.5, 5.0)
    assert torch.allclose(w, torch.tensor([[2.0] * 3, [0.0] * 3]), atol=1e-5)


def test_mismatch_bounds_differ_per_modality():
    bounds = MismatchBounds(text=(0.5, 5.0), image=(0.9, 1.1))
    modality = torch.tensor([[int(Modality.TEXT), int(Modality.IMAGE)]])
    alpha, beta = bounds.tensors(modality)
    assert alpha.tolist() == [[0.5, pytest.approx(0.9)]] and beta.tolist() == [[5.0, pytest.approx(1.1)]]
    k = torch.tensor([[1.5, 1.5]])
    w = icepop_token_weights(k.log(), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), alpha, beta)
    assert w[0, 0] == pytest.approx(1.5) and w[0, 1] == 0.0
    with pytest.raises(ValueError, match="alpha <= 1 <= beta"):
        MismatchBounds(audio=(1.2, 3.0))


def test_mismatch_kl_is_zero_without_mismatch_and_positive_with_it():
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert mismatch_kl(torch.zeros(1, 3), torch.zeros(1, 3), mask) == 0
    assert mismatch_kl(torch.tensor([[0.1, -0.2, 0.0]]), torch.zeros(1, 3), mask) > 0


# --------------------------------------------------------------------- masked tokens get zero gradient


@pytest.mark.parametrize("algorithm", ["grpo", "gspo_misc"])
def test_tokens_outside_the_icepop_region_get_exactly_zero_gradient(algorithm: str):
    torch.manual_seed(1)
    logp_old = -torch.rand(2, 6)
    # k = exp(logp_old - logp_inf): tokens 2 and 5 of row 0 and token 1 of row 1 fall outside [0.5, 5].
    shift = torch.zeros(2, 6)
    shift[0, 2], shift[0, 5], shift[1, 1] = 3.0, -3.0, 2.0
    logp_inf = logp_old - shift
    logp = (logp_old + 0.05 * torch.randn(2, 6)).requires_grad_(True)
    mask = torch.ones(2, 6, dtype=torch.bool)
    config = PolicyLossConfig(algorithm=algorithm, clip_low=0.5, clip_high=0.5)
    loss, stats = policy_loss(config, logp, logp_old, logp_inf, torch.tensor([1.0, -2.0]), mask)
    loss.backward()
    masked = shift.abs() > 0
    assert torch.all(logp.grad[masked] == 0.0)
    assert torch.all(logp.grad[~masked] != 0.0)
    assert stats.masked == 3 and stats.tokens == 12


def test_a_masked_token_with_a_non_finite_log_prob_leaks_no_nan_into_the_gradient():
    logp_old = torch.zeros(1, 3)
    logp_inf = torch.tensor([[0.0, 5.0, 0.0]])  # k = exp(-5): masked
    logp = leaf([[0.0, float("-inf"), 0.0]])
    config = PolicyLossConfig(algorithm="gspo_misc")
    _, _ = policy_loss(
        config, logp.detach(), logp_old, logp_inf, torch.tensor([1.0]), torch.ones(1, 3).bool()
    )
    loss, _ = policy_loss(config, logp, logp_old, logp_inf, torch.tensor([1.0]), torch.ones(1, 3).bool())
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 1] == 0.0


def test_misc_gradient_matches_the_verl_formula_oracle():
    # REFERENCES.md 2.8: T = 6, M = [1, 1.1, 0, 0.9, 1, 0], A = 1.3 -> grad = -(M / 6) * A.
    weights = torch.tensor([[1.0, 1.1, 0.0, 0.9, 1.0, 0.0]])
    logp_old = torch.zeros(1, 6)
    log_k = torch.where(weights > 0, weights.clamp_min(1e-9).log(), torch.tensor(-10.0))
    logp_inf = logp_old - log_k
    logp = torch.zeros(1, 6, requires_grad=True)
    loss, _ = policy_loss(
        PolicyLossConfig(algorithm="gspo_misc"),
        logp,
        logp_old,
        logp_inf,
        torch.tensor([1.3]),
        torch.ones(1, 6).bool(),
    )
    loss.backward()
    expected = torch.tensor([[-0.2167, -0.2383, 0.0, -0.1950, -0.2167, 0.0]])
    assert torch.allclose(logp.grad, expected, atol=1e-4)
    assert loss.item() == pytest.approx(-(weights.sum() / 6 * 1.3).item(), rel=1e-5)


def test_sequence_level_icepop_on_gspo_drops_a_whole_response_for_one_extreme_token():
    logp_old = torch.zeros(2, 4)
    logp_inf = torch.zeros(2, 4)
    logp_inf[0, 1] = -8.0  # one token with k = e^8 pulls the geometric mean of row 0 above beta
    logp = torch.zeros(2, 4, requires_grad=True)
    mask = torch.ones(2, 4, dtype=torch.bool)
    loss, stats = policy_loss(
        PolicyLossConfig(algorithm="gspo"), logp, logp_old, logp_inf, torch.ones(2), mask
    )
    loss.backward()
    assert torch.count_nonzero(logp.grad[0]) == 0 and torch.count_nonzero(logp.grad[1]) == 4
    assert stats.masked == 4
    # MISC drops only that token.
    logp.grad = None
    loss, stats = policy_loss(
        PolicyLossConfig(algorithm="gspo_misc"), logp, logp_old, logp_inf, torch.ones(2), mask
    )
    loss.backward()
    assert torch.count_nonzero(logp.grad[0]) == 3 and stats.masked == 1


# ----------------------------------------------------------------------------------------- aggregation


@pytest.mark.parametrize("algorithm", ["grpo", "gspo", "gspo_misc"])
@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_micro_batches_with_global_counts_give_the_full_batch_gradient(algorithm: str, aggregation: str):
    torch.manual_seed(2)
    lengths = [5, 2, 7, 3, 6, 1]
    rows = [(-torch.rand(n), torch.randn(n) * 0.3, torch.randn(n) * 0.2) for n in lengths]
    logp_old, m = pad_sequences([r[0] for r in rows])
    noise, _ = pad_sequences([r[1] for r in rows])
    mismatch, _ = pad_sequences([r[2] for r in rows])
    logp_inf = logp_old + mismatch
    base = logp_old + 0.1 * noise
    adv = torch.randn(len(lengths))
    config = PolicyLossConfig(algorithm=algorithm, aggregation=aggregation, clip_low=0.2, clip_high=0.3)
    total_tokens, total_seqs = int(m.sum()), len(lengths)

    full = base.clone().requires_grad_(True)
    loss, full_stats = policy_loss(config, full, logp_old, logp_inf, adv, m, total_tokens, total_seqs)
    loss.backward()

    split = base.clone().requires_grad_(True)
    stats = LossStats()
    for part in (slice(0, 1), slice(1, 4), slice(4, 6)):
        # Each micro-batch is padded to its own longest response, as a loader would.
        width = int(m[part].sum(1).max())
        part_loss, part_stats = policy_loss(
            config,
            split[part, :width],
            logp_old[part, :width],
            logp_inf[part, :width],
            adv[part],
            m[part, :width],
            total_tokens,
            total_seqs,
        )
        part_loss.backward()
        stats = stats + part_stats
    assert torch.allclose(full.grad, split.grad, atol=1e-6)
    assert stats.tokens == full_stats.tokens == total_tokens
    assert stats.masked == full_stats.masked


def test_per_micro_batch_denominators_would_change_the_gradient():
    """Why the counts are global: a token-mean per micro-batch weights short micro-batches up."""
    per_token = torch.ones(2, 3, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    (aggregate(per_token[:1], mask[:1], "token") + aggregate(per_token[1:], mask[1:], "token")).backward()
    local = per_token.grad.clone()
    per_token.grad = None
    aggregate(per_token, mask, "token").backward()
    assert not torch.allclose(local, per_token.grad)
    assert torch.allclose(per_token.grad[mask], torch.full((4,), 0.25))


# ------------------------------------------------------------------------------------ WPSM, KL, entropy


def test_wpsm_damps_only_correct_confident_answers_to_well_learned_queries():
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, 1.0])
    acc = torch.tensor([0.9, 0.5, 0.9, 0.9, 0.9])
    entropy = torch.tensor([0.1, 0.1, 0.9, 0.1, 0.2])
    weights, hit = wpsm_weights(adv, acc, entropy, tau=0.8, eta=0.5, alpha=0.6)
    assert hit.tolist() == [True, False, False, False, True]
    assert torch.allclose(weights, torch.tensor([0.4, 1.0, 1.0, 1.0, 0.4]))


def test_wpsm_sequence_weights_scale_the_gradient_and_are_counted():
    logp = torch.zeros(2, 2, requires_grad=True)
    z = torch.zeros(2, 2)
    mask = torch.ones(2, 2, dtype=torch.bool)
    config = PolicyLossConfig(algorithm="grpo", icepop=False)
    weights = torch.tensor([0.25, 1.0])
    loss, _ = policy_loss(config, logp, z, z, torch.ones(2), mask, sequence_weights=weights)
    loss.backward()
    assert torch.allclose(logp.grad[0], 0.25 * logp.grad[1])


def test_success_tracker_keeps_the_latest_accuracy_or_an_exponential_average():
    latest = SuccessTracker()
    latest.update("q", [True, False])
    assert latest.update("q", [True, True, True, True]) == 1.0
    ema = SuccessTracker(momentum=0.5)
    ema.update("q", [False, False])
    assert ema.update("q", torch.tensor([True, True])) == 0.5
    assert ema.get("unseen", default=-1.0) == -1.0 and ema.visits["q"] == 2
    restored = SuccessTracker(momentum=0.5)
    restored.load_state_dict(ema.state_dict())
    assert restored.get("q") == 0.5


def test_kl_k3_and_entropy_terms():
    logp = leaf([[0.0, -1.0]])
    assert torch.allclose(kl_k3(logp, logp.detach()), torch.zeros(1, 2))
    assert (kl_k3(logp, torch.tensor([[-0.5, -0.2]])) > 0).all()
    assert token_entropy(torch.zeros(4, 7)) == pytest.approx(torch.full((4,), math.log(7)))
    config = PolicyLossConfig(algorithm="grpo", kl_coef=0.1, entropy_coef=0.01)
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="logp_ref"):
        policy_loss(config, logp, z, z, torch.ones(1), torch.ones(1, 2).bool())
    loss, stats = policy_loss(
        config, logp, z, z, torch.ones(1), torch.ones(1, 2).bool(), entropy=torch.ones(1, 2), logp_ref=z
    )
    assert stats.kl_sum > 0 and stats.entropy_sum == 2.0
    assert stats.logs()["entropy"] == 1.0


def test_loss_config_defaults_follow_the_algorithm_and_bad_values_are_refused():
    assert PolicyLossConfig(algorithm="grpo").epsilons == (0.2, 0.28)
    assert PolicyLossConfig(algorithm="gspo").epsilons == (3e-4, 4e-4)
    assert PolicyLossConfig(algorithm="grpo").reduction == "token"
    assert PolicyLossConfig(algorithm="gspo_misc").reduction == "sequence"
    with pytest.raises(ValueError, match="algorithm"):
        PolicyLossConfig(algorithm="ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="clip_low"):
        PolicyLossConfig(clip_low=1.5)
    with pytest.raises(ValueError, match="same|share"):
        policy_loss(
            PolicyLossConfig(),
            torch.zeros(1, 2),
            torch.zeros(1, 3),
            torch.zeros(1, 2),
            torch.ones(1),
            torch.ones(1, 2).bool(),
        )


def test_pad_sequences_keeps_the_graph_and_marks_real_tokens():
    a, b = leaf([1.0, 2.0]), leaf([3.0])
    padded, mask = pad_sequences([a, b])
    assert padded.tolist() == [[1.0, 2.0], [3.0, 0.0]] and mask.tolist() == [[True, True], [True, False]]
    padded.sum().backward()
    assert a.grad.tolist() == [1.0, 1.0]
