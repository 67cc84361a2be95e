"""The tool-use environment as a specification (zoo/rl/envs/tools.py, the engine's side in zoo/rl/rollout.py):
the calculator evaluates arithmetic over an AST allow-list and refuses everything else as a result, never an
exception; the reward reads the final answer only; and in rollouts of a tiny real model the engine stops at
the policy's `</tool>`, feeds the tool's result in place of sampling, lets the policy continue, marks the
result tokens, resumes an interrupted injection exactly, and the loss gives those tokens no weight.

The model is a tiny one trained for a few seconds to write the call for one query, with a *wrong* result
after it ("<result>7</result>"), so that every right result in its rollouts comes from the environment."""

import lightning as L
import pytest
import torch

from zoo.datamodules.sequence import SequenceBuilder, TextSegment
from zoo.models.sampling import Sampler
from zoo.registry import create_model
from zoo.rl.envs.data import ToolRLDataModule
from zoo.rl.envs.tools import (
    CLOSE,
    ToolTasks,
    calculate,
    call_of,
    result_text,
    run_call,
    verify_tool_answer,
)
from zoo.rl.losses import PolicyLossConfig
from zoo.rl.records import Query
from zoo.rl.rollout import InferenceEngine
from zoo.rl.update import PolicyUpdate, UpdateConfig

TINY = dict(
    dim=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, expert_hidden=16, top_k=2, max_seq_len=96
)


@pytest.mark.parametrize(
    "expression, value", [("37*58", 2146), ("(3+4)*2 - 1", 13), ("7/2", 3.5), ("-2**3", -8), ("17 % 5", 2)]
)
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "call, error",
    [
        ('calc: __import__("os").system("true")', "Call is not allowed"),
        ("calc: (1).__class__", "Attribute is not allowed"),
        ("calc: x + 1", "Name is not allowed"),
        ("calc: 2**1000", "exponent"),
        ("calc: 1e300 * 1e300 * 1e300", "beyond"),
        ("calc: 1/0", "division by zero"),
        ("calc: 3 +", "not an expression"),
        ("calc: " + "9" * 90, "longer than"),
        ("search: cats", "unknown tool"),
    ],
)
def test_the_calculator_refuses_everything_but_arithmetic_as_an_error_result(call, error):
    result = run_call(call)
    assert result.startswith("error: ") and error in result


def test_the_reward_reads_the_final_answer_after_the_last_tool_result():
    q = Query("tool/1/train/0", "compute 15*76", "1140", "", "tool_calc")
    assert verify_tool_answer(q, "<tool>calc: 15*76</tool> <result>1140</result> Answer: 1140") == 1.0
    assert verify_tool_answer(q, "<tool>calc: 15*76</tool> <result>1140</result>") == 0.0  # no answer given
    assert verify_tool_answer(q, "<tool>calc: 15*76</tool> <result>1140</result> Answer: 1141") == 0.0
    assert verify_tool_answer(q, "1140") == 1.0  # no tool called: the whole completion is the answer


def test_queries_carry_the_transcript_the_environment_would_make_and_split_held_out_prompts():
    tasks = ToolTasks((1, 2), seed=0)
    train, heldout = tasks.queries("train", 200), tasks.queries("heldout", 20)
    assert {q.prompt for q in train}.isdisjoint(q.prompt for q in heldout)
    q = train[0]
    call = call_of(q.solution)
    assert q.solution.startswith(f"<tool>{call}{CLOSE}{result_text(call)}")
    assert verify_tool_answer(q, q.solution) == 1.0


@pytest.fixture(scope="module")
def trained() -> tuple:
    """A tiny model that writes the call for the first training query, then a wrong result and an answer."""
    torch.manual_seed(0)
    model = create_model("tiny", **TINY)
    data = ToolRLDataModule(vocab=model.vocab, train_size=8, heldout_size=2, tokenizer_size=300)
    data.setup()
    query = data.train_queries()[0]
    wrong = query.solution.replace(f"<result>{query.answer}</result>", "<result>7</result>")
    ids = [*data.base_prompt_ids(query), *data.encode_text(wrong), model.vocab.eos_id]
    batch = SequenceBuilder(model.vocab, 96).collate([[TextSegment(ids)]] * 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(80):
        loss = model(batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().decode_text_with(data.tokenizer.vocab_size)
    return model, data, query


def engine_of(model, data, **kwargs) -> InferenceEngine:
    settings = dict(max_new_tokens=40, temperature=0.0, environment=data.environment())
    return InferenceEngine(model, **{**settings, **kwargs})


def test_the_engine_stops_at_the_call_feeds_the_result_and_the_policy_continues(trained):
    model, data, query = trained
    rollout = engine_of(model, data).generate([data.base_prompt_ids(query)], [query])[0]
    text = data.decode(rollout.response_ids)
    call = call_of(text)
    assert call is not None and call.strip() == call_of(query.solution).strip(), text
    result = data.encode_text(result_text(call))
    end = len(data.encode_text(text[: text.index(CLOSE) + len(CLOSE)]))
    # The result the environment owes follows the call, marked injected, with l_inf 0 placeholders ...
    assert rollout.response_ids[end : end + len(result)] == result
    after = len(rollout.injected) - end - len(result)
    assert rollout.injected == [False] * end + [True] * len(result) + [False] * after
    assert rollout.inf_logprobs[end : end + len(result)].eq(0).all()
    assert rollout.inf_logprobs[:end].lt(0).all()
    # ... the model had learnt "<result>7</result>": the right value is the environment's ...
    assert f"<result>{query.answer}</result>" in text and "<result>7</result>" not in text
    # ... and the policy samples again after it (at least one token of its own).
    assert len(rollout.response_ids) > end + len(result) and not rollout.injected[-1]
    assert rollout.finished or rollout.truncated


def test_without_an_environment_the_same_model_writes_its_own_wrong_result(trained):
    model, data, query = trained
    rollout = engine_of(model, data, environment=None).generate([data.base_prompt_ids(query)], [query])[0]
    assert "<result>7</result>" in data.decode(rollout.response_ids) and rollout.injected == []


def test_an_injection_interrupted_halfway_resumes_exactly(trained):
    model, data, query = trained
    prompt = data.base_prompt_ids(query)
    whole = engine_of(model, data).generate([prompt], [query])[0]
    first_injected = whole.injected.index(True)
    engine = engine_of(model, data)
    engine.start([prompt], [query])
    for _ in range(first_injected + 2):  # the prefill samples the first token; then one token a step
        engine.step(1)
    (partial,) = engine.interrupt()
    assert partial.injected and partial.injected[-1] and not partial.done  # in the middle of the result
    resumed = engine_of(model, data)
    resumed.resume([partial])
    while resumed.pending:
        resumed.step(8)
    assert partial.response_ids == whole.response_ids and partial.injected == whole.injected


def test_validation_makes_the_same_transcript_with_the_trained_model(trained):
    model, data, query = trained
    prompt = data.base_prompt_ids(query)
    rollout = engine_of(model, data).generate([prompt], [query])[0]
    said = data.environment().respond(model, [prompt], data.decode, 40, Sampler(0.0))
    assert said == [data.decode(rollout.response_ids)]


def test_environment_tokens_carry_no_weight_in_the_loss(trained):
    model, data, query = trained
    engine = engine_of(model, data, temperature=1.0, seed=3, record_routing=False)
    rollouts = engine.generate([data.base_prompt_ids(query)] * 4, [query] * 4)
    assert all(any(r.injected) for r in rollouts)
    config = UpdateConfig(batch_size=1, group_size=4, micro_batch_size=4, router_replay=False)
    update = PolicyUpdate(model, PolicyLossConfig(algorithm="grpo"), config, 1.0)
    for r, reward in zip(rollouts, [1.0, 0.0, 0.0, 1.0], strict=True):
        r.reward = reward
    scored = update.advantages([rollouts], torch.tensor([[1.0, 0.0, 0.0, 1.0]]), 0, False)

    def loss_and_stats() -> tuple[list[float], dict]:
        losses = []
        backward = lambda x: losses.append(float(x.detach()))  # noqa: E731
        stats = update.train(rollouts, scored, data.token_modality, backward, lambda: None, 0)
        return losses, stats

    losses, stats = loss_and_stats()
    policy_tokens = sum(sum(r.policy_mask) for r in rollouts)
    assert stats["trained_tokens"] == policy_tokens < sum(len(r.response_ids) for r in rollouts)
    for r in rollouts:  # an absurd l_inf at the injected tokens would change every mismatch statistic ...
        absurd = torch.full_like(r.inf_logprobs, -30.0)
        r.inf_logprobs = torch.where(torch.tensor(r.injected), absurd, r.inf_logprobs)
    again, stats_again = loss_and_stats()
    assert again == losses  # ... were those tokens in the loss
    assert stats_again["masked_fraction"] == stats["masked_fraction"]
    assert stats_again["mismatch_kl"] == stats["mismatch_kl"]


@pytest.mark.parametrize("budget, warned", [(4, True), (96, False)])
def test_rl_warns_when_reference_answers_do_not_fit_the_response_budget(budget, warned):
    """A tool answer cut before its `Answer:` scores 0 in every rollout, so GRPO would learn nothing: setup
    says so, naming the budget to raise; a budget that holds every reference passes silently."""
    import warnings

    from zoo.rl.scoring import ScoringConfig
    from zoo.rl.task import RLTask, RolloutConfig

    model = create_model("tiny", **TINY)
    data = ToolRLDataModule(vocab=model.vocab, train_size=8, heldout_size=2, tokenizer_size=300)
    task = RLTask(model, rollout=RolloutConfig(max_new_tokens=budget),
                  scoring=ScoringConfig(val_max_new_tokens=budget))  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    trainer.strategy.connect(task)
    task.trainer = trainer
    trainer.datamodule = data  # what fit() does before setup
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        task.setup("fit")
    said = [str(w.message) for w in caught if "reference answers" in str(w.message)]
    assert bool(said) == warned
    if warned:
        assert any(f"rollout.max_new_tokens={budget}" in m for m in said)
