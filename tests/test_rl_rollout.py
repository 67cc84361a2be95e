"""The inference engine and router replay as a specification: the engine's log-probs are the trainer's
in float32 and differ in bf16/FP8, continuous batching equals one-at-a-time generation, in-flight
rollouts continue under synced weights, and router replay makes the trainer use the recorded experts
(lower mismatch KL) while the router still gets gradients."""

import logging

import pytest
import torch

from zoo.registry import create_model
from zoo.rl.rollout import (
    InferenceEngine,
    fp8_round_trip,
    mismatch_kl,
    routing_agreement,
    sequence_logprobs,
)

SMALL = dict(
    dim=64, n_layers=3, n_heads=2, n_kv_heads=1, n_experts=8, expert_hidden=32, top_k=2, max_seq_len=96
)
PROMPTS = [[1, 40, 41, 42], [1, 50], [1, 60, 61, 62, 63, 64, 65], [1, 70, 71]]


def small_model(expert_scale: float = 1.0, seed: int = 0):
    torch.manual_seed(seed)
    model = create_model("tiny", **SMALL).eval()
    with torch.no_grad():  # experts whose outputs matter, as after training: routing changes the logits
        for block in model.backbone.layers:
            if block.is_moe:
                block.ffn.experts.w2.mul_(expert_scale)
    return model


def max_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True) if x.numel())


def test_float32_engine_records_the_trainers_logprobs_and_full_sequence_routing():
    model = small_model()
    engine = InferenceEngine(model, max_new_tokens=12, stop_ids=(), seed=1)
    rollouts = engine.generate(PROMPTS, [None] * 4, max_new_tokens=[3, 12, 7, 1])
    assert [len(r.response_ids) for r in rollouts] == [3, 12, 7, 1]
    moe_layers = [i for i, b in enumerate(model.backbone.layers) if b.is_moe]
    for r in rollouts:
        assert r.truncated and not r.finished and r.versions == [0] * len(r.response_ids)
        assert r.inf_logprobs.shape == (len(r.response_ids),) and r.inf_logprobs.dtype == torch.float32
        assert sorted(r.routing) == moe_layers
        for chosen in r.routing.values():
            assert chosen.shape == (len(r.prompt_ids) + len(r.response_ids), 2)
    inf = [r.inf_logprobs for r in rollouts]
    with torch.no_grad():
        assert max_gap(sequence_logprobs(model, rollouts, replay=False), inf) < 1e-4
        assert max_gap(sequence_logprobs(model, rollouts, replay=True), inf) < 1e-4
    assert routing_agreement(model, rollouts) == 1.0


@pytest.mark.parametrize("precision", ["bfloat16", "fp8"])
def test_low_precision_engine_differs_from_the_float32_trainer(precision):
    model = small_model()
    engine = InferenceEngine(model, precision=precision, max_new_tokens=16, stop_ids=(), seed=1)
    rollouts = engine.generate(PROMPTS, [None] * 4)
    with torch.no_grad():
        trainer = sequence_logprobs(model, rollouts)
    assert max_gap(trainer, [r.inf_logprobs for r in rollouts]) > 1e-3
    if precision == "bfloat16":
        assert engine.model.text_embed.weight.dtype == torch.bfloat16
    else:  # rounded through float8 in place: float32 storage, FP8 values
        w = engine.model.backbone.layers[0].attention.wq.weight
        assert w.dtype == torch.float32 and torch.equal(w, fp8_round_trip(w))
        assert not torch.equal(w, model.backbone.layers[0].attention.wq.weight)


def test_router_replay_forces_the_recorded_experts_and_lowers_mismatch_kl():
    model = small_model(expert_scale=8.0)
    g = torch.Generator().manual_seed(0)
    prompts = [[1, *torch.randint(10, 300, (5,), generator=g).tolist()] for _ in range(8)]
    engine = InferenceEngine(model, precision="fp8", max_new_tokens=24, stop_ids=(), seed=2)
    rollouts = engine.generate(prompts, [None] * 8)
    assert routing_agreement(model, rollouts, replay=False) < 0.99
    assert routing_agreement(model, rollouts, replay=True) == 1.0
    inf = [r.inf_logprobs for r in rollouts]
    with torch.no_grad():
        without = float(mismatch_kl(inf, sequence_logprobs(model, rollouts, replay=False)))
        with_replay = float(mismatch_kl(inf, sequence_logprobs(model, rollouts, replay=True)))
    assert with_replay < 0.5 * without


def test_router_replay_still_trains_the_router_and_returns_entropies():
    model = small_model().train()
    engine = InferenceEngine(model, max_new_tokens=6, stop_ids=(), seed=0)
    rollouts = engine.generate(PROMPTS, [None] * 4)
    logprobs, entropies = sequence_logprobs(model, rollouts, replay=True, with_entropy=True)
    assert [e.shape for e in entropies] == [lp.shape for lp in logprobs]
    assert all(bool((e > 0).all()) for e in entropies)
    torch.stack([lp.sum() for lp in logprobs]).sum().backward()
    gate = model.backbone.layers[1].ffn.router.gate.weight
    assert gate.grad is not None and float(gate.grad.abs().sum()) > 0


def test_logprobs_use_the_sampling_temperature():
    model = small_model()
    engine = InferenceEngine(model, max_new_tokens=8, temperature=0.7, stop_ids=(), seed=0)
    rollouts = engine.generate(PROMPTS[:2], [None] * 2)
    inf = [r.inf_logprobs for r in rollouts]
    with torch.no_grad():
        assert max_gap(sequence_logprobs(model, rollouts, temperature=0.7), inf) < 1e-4
        assert max_gap(sequence_logprobs(model, rollouts, temperature=1.0), inf) > 1e-3


def test_continuous_batching_equals_generating_each_prompt_alone():
    model = small_model()
    # Two slots for four prompts: rows leave and join mid-flight, the cache is merged and compacted.
    engine = InferenceEngine(model, max_new_tokens=10, temperature=0.0, stop_ids=(), max_batch=2)
    budgets = [2, 10, 5, 8]
    rollouts = engine.generate(PROMPTS, [None] * 4, max_new_tokens=budgets)
    for prompt, budget, r in zip(PROMPTS, budgets, rollouts, strict=True):
        assert r.response_ids == model.generate([prompt], budget, temperature=0.0, stop_ids=())[0]
    assert engine.stats.tokens == sum(budgets)


def test_stop_ids_end_responses_and_a_full_context_gives_an_empty_truncated_one(caplog):
    model = small_model()
    every = tuple(range(model.vocab.text_head_size))
    engine = InferenceEngine(model, max_new_tokens=5, stop_ids=every, seed=0)
    rollouts = engine.generate(PROMPTS[:2], [None] * 2)
    assert all(len(r.response_ids) == 1 and r.finished and not r.truncated for r in rollouts)
    full = [1] + [40] * (SMALL["max_seq_len"] - 1)
    with caplog.at_level(logging.WARNING):
        (empty,) = InferenceEngine(model, max_new_tokens=5).generate([full], [None])
    assert empty.response_ids == [] and empty.truncated and "no room" in caplog.text
    assert empty.inf_logprobs.shape == (0,)
    assert all(chosen.shape[0] == len(full) for chosen in empty.routing.values())
    with torch.no_grad():
        assert sequence_logprobs(model, [empty])[0].shape == (0,)


def test_sync_mid_flight_continues_under_the_new_weights_with_per_token_versions():
    model = small_model()
    engine = InferenceEngine(model, max_new_tokens=12, stop_ids=(), seed=3)
    rollouts = engine.start(PROMPTS, [None] * 4)
    engine.step(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.sync(model, version=1)
    while engine.pending:
        engine.step(4)
    assert engine.stats.reprefills == 4
    for r in rollouts:
        assert r.versions == [0] * 6 + [1] * 6  # prefill + 5 steps sampled 6 tokens before the sync
        assert all(chosen.shape[0] == len(r.prompt_ids) + 12 for chosen in r.routing.values())
    # Tokens sampled after the sync were sampled from the new weights, on a re-prefilled context.
    with torch.no_grad():
        trainer = sequence_logprobs(model, rollouts)
    assert max_gap([t[6:] for t in trainer], [r.inf_logprobs[6:] for r in rollouts]) < 1e-4
    assert max_gap([t[:6] for t in trainer], [r.inf_logprobs[:6] for r in rollouts]) > 1e-3


def test_a_rollout_finished_just_before_a_sync_is_completed_under_the_weights_that_sampled_it():
    model = small_model()
    engine = InferenceEngine(model, max_new_tokens=6, stop_ids=(), seed=5)
    short, long = engine.start(PROMPTS[:2], [None] * 2, max_new_tokens=[2, 6])
    engine.step(1)  # the prefill and one decode: `short` has its 2 tokens, its last one not yet fed
    engine.sync(model, version=1)
    assert engine.pending == 2 and engine.step(1) == [short]
    assert short.versions == [0, 0] and all(t.shape[0] == len(PROMPTS[0]) + 2 for t in short.routing.values())
    while engine.pending:
        engine.step(4)
    assert long.versions == [0, 0, 1, 1, 1, 1]


def test_interrupt_returns_partial_rollouts_that_resume_to_their_budget():
    model = small_model()
    engine = InferenceEngine(model, max_new_tokens=9, stop_ids=(), seed=4)
    engine.start(PROMPTS, [None] * 4, max_new_tokens=[2, 9, 9, 9])
    done = engine.step(3)
    partial = engine.interrupt()
    assert engine.pending == 0 and [len(r.response_ids) for r in done] == [2]
    assert all(not r.done and len(r.response_ids) == 4 for r in partial)
    for r in partial:  # every position fed so far has its routing
        assert all(chosen.shape[0] == len(r.prompt_ids) + 4 for chosen in r.routing.values())
    engine.sync(model, version=2)
    engine.resume(partial)
    while engine.pending:
        engine.step(8)
    for r in partial:
        assert r.truncated and len(r.response_ids) == 9 and r.versions == [0] * 4 + [2] * 5
        assert r.inf_logprobs.shape == (9,)
        assert all(chosen.shape[0] == len(r.prompt_ids) + 9 for chosen in r.routing.values())


def test_bad_input_is_refused_with_a_clear_error():
    model = small_model()
    engine = InferenceEngine(model, max_new_tokens=4)
    with pytest.raises(ValueError, match="2 prompts but 1 queries"):
        engine.start(PROMPTS[:2], [None])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.start([[1], []], [None, None])
    with pytest.raises(ValueError, match="exceeds the context"):
        engine.start([[1] * 200], [None])
    with pytest.raises(ValueError, match="precision"):
        InferenceEngine(model, precision="int4")
    (r,) = InferenceEngine(model, max_new_tokens=3, record_routing=False).generate([[1, 5]], [None])
    with pytest.raises(ValueError, match="no recorded routing"):
        sequence_logprobs(model, [r], replay=True)


def test_engine_copies_and_syncs_a_model_converted_for_fp8_training_and_checkpointing():
    from zoo.parallel import Parallelism, parallelize

    model = parallelize(small_model(), Parallelism(fp8=True, activation_checkpointing=True))
    engine = InferenceEngine(model, max_new_tokens=4, stop_ids=(), seed=0)
    assert type(engine.model.backbone.layers[0]).__name__ == "TransformerBlock"  # a plain copy
    with torch.no_grad():
        model.text_head.output.weight.add_(0.5)
    engine.sync(model, version=1)
    assert torch.equal(engine.model.text_head.output.weight, model.text_head.output.weight)
    (r,) = engine.generate([[1, 5, 6]], [None])
    assert r.versions == [1] * 4 and sequence_logprobs(model, [r], replay=True)[0].shape == (4,)


def test_an_engine_samples_only_ids_the_tokenizer_decodes_and_the_trainer_scores_them_alike():
    from zoo.parallel import Parallelism, parallelize

    model = small_model()
    model.decode_text_with(20)  # a 20-id tokenizer: the vocabulary's other text ids decode to nothing
    engine = InferenceEngine(model, max_new_tokens=8, temperature=1.5, stop_ids=(), seed=0)
    rollouts = engine.generate(PROMPTS, [None] * 4)
    assert all(t < model.vocab.text_offset + 20 for r in rollouts for t in r.response_ids)
    with torch.no_grad():
        logprobs, entropies = sequence_logprobs(model, rollouts, temperature=1.5, with_entropy=True)
    assert max_gap(logprobs, [r.inf_logprobs for r in rollouts]) < 1e-4
    assert all(bool(torch.isfinite(e).all()) for e in entropies)  # masked ids count as no probability
    wrapped = parallelize(small_model(), Parallelism(fp8=True))
    wrapped.decode_text_with(20)
    assert InferenceEngine(wrapped, max_new_tokens=2).model.decodable_text_ids == 20  # rebuilt plain, kept
