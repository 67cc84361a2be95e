"""The rollout schedulers as a specification: sync trains the data in order with no lag; U-RB trains the
data groups in their order (no length or difficulty bias) with lag below N while needing fewer engine
steps; APRIL returns the first finished groups (short ones), recycles partial rollouts that then carry
two policy versions, and loses no query; all three build from a config."""

import math

import pytest
import torch

from zoo.config import to_config
from zoo.hub import build_from_config
from zoo.registry import create_model
from zoo.rl.rollout import InferenceEngine
from zoo.rl.schedulers import AprilScheduler, SyncScheduler, URBScheduler
from zoo.rl.verifiers import Query as ZooQuery

SMALL = dict(
    dim=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, expert_hidden=16, top_k=2, max_seq_len=96
)
B, G = 3, 2


class Query:
    def __init__(self, k: int) -> None:
        self.id, self.difficulty = str(k), 1 + k % 3
        self.prompt = self.answer = self.solution = ""
        self.task = "test"


class LongTailSource:
    """Query k; the response length grows with difficulty and has a long tail (one in five is long)."""

    def __init__(self) -> None:
        self.drawn = 0

    def next_queries(self, n: int) -> list[Query]:
        self.drawn += n
        return [Query(k) for k in range(self.drawn - n, self.drawn)]

    def encode_prompt(self, query: Query) -> list[int]:
        return [1, 10 + int(query.id) % 50, 11]

    def response_budget(self, query: Query, j: int) -> int:
        k = int(query.id)
        return 2 + 2 * query.difficulty + (24 if (k + j) % 5 == 0 else 0)


def run(scheduler, iterations: int, max_batch: int | None = None):
    torch.manual_seed(0)
    model = create_model("tiny", **SMALL)
    engine = InferenceEngine(model, max_new_tokens=40, stop_ids=(), max_batch=max_batch, seed=0)
    source = LongTailSource()
    batches = []
    for version in range(iterations):
        groups = scheduler.next_batch(engine, source, B, G, version)
        batches.append(groups)
        with torch.no_grad():  # stands in for an optimizer step
            model.text_head.output.weight.add_(0.01)
        engine.sync(model, version + 1)
    return batches, engine, source


def check_groups(groups) -> None:
    assert len(groups) == B
    for group in groups:
        assert len(group) == G and len({r.query.id for r in group}) == 1
        assert all(r.done and len(r.inf_logprobs) == len(r.response_ids) for r in group)
        for r in group:
            assert all(t.shape[0] == len(r.prompt_ids) + len(r.response_ids) for t in r.routing.values())


def trained_ids(batches) -> list[int]:
    return [int(g[0].query.id) for groups in batches for g in groups]


def test_sync_trains_the_data_in_order_with_no_policy_lag():
    batches, engine, _ = run(SyncScheduler(), 3)
    for groups in batches:
        check_groups(groups)
    assert trained_ids(batches) == list(range(3 * B))
    assert all(set(r.versions) == {t} for t, groups in enumerate(batches) for g in groups for r in g)


def test_urb_keeps_the_data_order_bounds_lag_and_needs_fewer_engine_steps():
    iterations = 5
    sync_batches, sync_engine, _ = run(SyncScheduler(), iterations)
    scheduler = URBScheduler(n_groups=2)
    batches, engine, source = run(scheduler, iterations)
    for groups in batches:
        check_groups(groups)
    # Only D_t is trained at t: the same queries as sync in the same order, so no composition bias.
    assert trained_ids(batches) == trained_ids(sync_batches)
    stats = scheduler.statistics()
    assert stats["order_error_mean"] == 0.0 and stats["policy_lag_max"] <= 1
    assert stats["difficulty_bias"] == pytest.approx(1.0)
    assert stats["offpolicy_token_frac"] > 0  # D_t+1 generated partly under the previous weights
    resumed = [r for groups in batches for g in groups for r in g if len(set(r.versions)) == 2]
    assert resumed and all(r.versions == sorted(r.versions) for r in resumed)
    assert source.drawn == (iterations + 1) * B  # D_t+N admitted after D_t is trained
    assert engine.stats.steps < 0.8 * sync_engine.stats.steps


def test_april_trains_the_first_finished_groups_and_recycles_partial_rollouts():
    scheduler = AprilScheduler(over_provision=2.0)
    batches, engine, source = run(scheduler, 4)
    for groups in batches:
        check_groups(groups)
    first = [len(r.response_ids) for g in batches[0] for r in g]
    # Completion order picks short responses first: the first step is biased to short ones.
    budgets = [LongTailSource().response_budget(Query(k), j) for k in range(2 * B) for j in range(G)]
    assert sum(first) / len(first) < sum(budgets) / len(budgets)
    recycled = [r for groups in batches[1:] for g in groups for r in g if len(set(r.versions)) > 1]
    assert recycled, "a partial rollout should continue under newer weights"
    assert scheduler.statistics()["policy_lag_max"] >= 1
    # Nothing is lost: every drawn query is trained or still waiting in the buffer.
    waiting = {int(scheduler._groups[g][0].query.id) for g in scheduler._buffer}
    assert sorted(trained_ids(batches) + sorted(waiting)) == list(range(source.drawn))
    assert engine.pending == 0


def test_statistics_report_lag_utilisation_and_bias():
    scheduler = URBScheduler(n_groups=2)
    run(scheduler, 2, max_batch=2 * B * G)
    stats = scheduler.statistics()
    assert stats["trained_samples"] == 2 * B * G
    assert 0 < stats["slot_utilisation"] <= 1 and stats["engine_busy_s"] > 0
    assert not math.isnan(stats["length_bias"]) and stats["policy_lag_mean"] >= 0


def test_overlap_keeps_only_the_urb_pool_generating_while_the_trainer_trains():
    torch.manual_seed(0)
    model = create_model("tiny", **SMALL)
    for scheduler, expect_steps in ((SyncScheduler(), False), (URBScheduler(n_groups=2), True)):
        engine = InferenceEngine(model, max_new_tokens=40, stop_ids=(), seed=0)
        scheduler.next_batch(engine, LongTailSource(), B, G, 0)
        steps = engine.stats.steps
        scheduler.overlap(engine, seconds=0.3)
        assert (engine.stats.steps > steps) == expect_steps


@pytest.mark.parametrize(
    "config",
    [
        {"class_path": "zoo.rl.schedulers.SyncScheduler", "init_args": {}},
        {"class_path": "zoo.rl.schedulers.AprilScheduler", "init_args": {"over_provision": 1.5}},
        {"class_path": "zoo.rl.schedulers.URBScheduler", "init_args": {"n_groups": 3}},
    ],
)
def test_schedulers_build_from_a_config_and_round_trip(config):
    scheduler = build_from_config(config)
    assert to_config(scheduler) == config


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="over_provision"):
        AprilScheduler(over_provision=0.5)
    with pytest.raises(ValueError, match="n_groups"):
        URBScheduler(n_groups=0)
    with pytest.raises(ValueError, match="batch_size and group_size"):
        SyncScheduler().next_batch(None, LongTailSource(), 0, 2, 0)


class CheckpointableSource(LongTailSource):
    """The same long-tailed lengths with `zoo.rl.verifiers.Query` items (what a checkpoint can store)."""

    def next_queries(self, n: int) -> list[ZooQuery]:
        return [
            ZooQuery(id=q.id, prompt="", answer="", solution="", task="test", difficulty=q.difficulty)
            for q in super().next_queries(n)
        ]


def advance(scheduler, engine, model, source, versions: range) -> list:
    batches = []
    for version in versions:
        batches.append(scheduler.next_batch(engine, source, B, G, version))
        with torch.no_grad():
            model.text_head.output.weight.add_(0.01)
        engine.sync(model, version + 1)
    return batches


def start(seed_model: int = 0):
    torch.manual_seed(seed_model)
    model = create_model("tiny", **SMALL)
    return model, InferenceEngine(model, max_new_tokens=40, stop_ids=(), seed=0)


@pytest.mark.parametrize(
    "make",
    [lambda: URBScheduler(n_groups=2), lambda: AprilScheduler(over_provision=2.0)],
    ids=["urb", "april"],
)
def test_a_checkpointed_scheduler_continues_after_a_restart_exactly_as_without_one(make, tmp_path):
    model, engine = start()
    straight = advance(make(), engine, model, CheckpointableSource(), range(4))

    model, engine = start()
    scheduler, source = make(), CheckpointableSource()
    advance(scheduler, engine, model, source, range(2))
    path = tmp_path / "scheduler.pt"
    torch.save(
        {"scheduler": scheduler.checkpoint_state(engine), "rng": engine.generator.get_state(),
         "weights": model.state_dict(), "drawn": source.drawn},
        path,
    )  # fmt: skip
    saved = torch.load(path, weights_only=True)
    partial = [r for g in saved["scheduler"]["groups"].values() for r in g if not r["complete"]]
    assert any(r["response_ids"] for r in partial), "no partial rollout to carry over: this proves nothing"

    model = create_model("tiny", **SMALL)  # a fresh process: new model, engine and scheduler
    model.load_state_dict(saved["weights"])
    engine = InferenceEngine(model, max_new_tokens=40, stop_ids=(), seed=123)
    engine.version = 2
    engine.generator.set_state(saved["rng"])
    restored, source = make(), CheckpointableSource()
    restored.load_checkpoint_state(saved["scheduler"])
    source.drawn = saved["drawn"]
    resumed = advance(restored, engine, model, source, range(2, 4))

    for before, after in zip(straight[2:], resumed, strict=True):
        for g0, g1 in zip(before, after, strict=True):
            for r0, r1 in zip(g0, g1, strict=True):
                assert r0.query.id == r1.query.id and r0.response_ids == r1.response_ids
                assert r0.versions == r1.versions  # tokens sampled before the restart keep their version
                assert torch.equal(r0.inf_logprobs, r1.inf_logprobs)
                assert all(torch.equal(r0.routing[k], r1.routing[k]) for k in r0.routing)


def test_a_checkpoint_of_another_scheduler_is_refused():
    model, engine = start()
    state = URBScheduler(n_groups=2).checkpoint_state(engine)
    with pytest.raises(ValueError, match="URBScheduler"):
        AprilScheduler().load_checkpoint_state(state)
