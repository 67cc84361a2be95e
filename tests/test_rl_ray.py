"""RL across processes on Ray as a specification: engine actors give the rollouts of the in-process
engine for the same seeds (weights pushed on the scheduler's schedule included), a verifier actor killed
mid-call is replaced and every call is scored exactly once, a verifier past its timeout scores 0, and an
engine actor that dies is recreated from the current weights without losing a rollout.

All tests share one local Ray cluster (2 CPUs, no dashboard), shut down at the end of the module."""

import os
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from zoo.registry import create_model  # noqa: E402
from zoo.rl.engines import EngineSettings, InProcessBackend  # noqa: E402
from zoo.rl.ray_backend import RayBackend  # noqa: E402
from zoo.rl.ray_engines import RayEngineGroup  # noqa: E402
from zoo.rl.ray_verifiers import RayVerifierPool  # noqa: E402
from zoo.rl.records import Query  # noqa: E402
from zoo.rl.schedulers import URBScheduler  # noqa: E402

SMALL = dict(
    dim=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, expert_hidden=16, top_k=2, max_seq_len=96
)
TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def cluster():
    # Actors import the verifiers of tests/ray_helpers.py by name: they inherit this PYTHONPATH.
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS.parent), str(TESTS), old) if p)
    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    if old is None:
        os.environ.pop("PYTHONPATH")
    else:
        os.environ["PYTHONPATH"] = old


class Source:
    """Query k of the add task; data groups of 2 queries alternate short and long budgets, so that a long
    group keeps generating across the push after the short one before it."""

    def __init__(self) -> None:
        self.drawn = 0

    def next_queries(self, n: int) -> list[Query]:
        self.drawn += n
        return [Query(str(k), "", "0", "", "add", 1 + k % 3) for k in range(self.drawn - n, self.drawn)]

    def encode_prompt(self, query: Query) -> list[int]:
        return [1, 10 + int(query.id) % 50, 11]

    def response_budget(self, query: Query, j: int) -> int:
        return 4 + j + (16 if int(query.id) // 2 % 2 else 0)


def policy(seed: int = 0):
    torch.manual_seed(seed)
    return create_model("tiny", **SMALL).eval()


def urb_run(engine, model, iterations: int = 3) -> list[list]:
    """U-RB with N = 2 data groups: the next group keeps generating across each weight push."""
    scheduler, source, batches = URBScheduler(n_groups=2), Source(), []
    for version in range(iterations):
        batches.append(scheduler.next_batch(engine, source, 2, 2, version))
        with torch.no_grad():  # stands in for an optimizer step
            model.text_head.output.weight.add_(0.05 * torch.randn_like(model.text_head.output.weight))
        engine.sync(model, version + 1)
    return batches


def same_rollouts(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.query.id == y.query.id and x.group == y.group
        assert x.response_ids == y.response_ids and x.versions == y.versions
        assert (x.finished, x.truncated) == (y.finished, y.truncated)
        torch.testing.assert_close(x.inf_logprobs, y.inf_logprobs, rtol=0, atol=1e-6)
        assert x.routing.keys() == y.routing.keys()
        assert all(torch.equal(x.routing[k], y.routing[k]) for k in x.routing)


def test_a_ray_engine_gives_the_in_process_rollouts_of_a_urb_run_with_weight_pushes(cluster):
    settings = EngineSettings(max_new_tokens=24, stop_ids=(), seed=3)
    local_model, ray_model = policy(), policy()
    torch.manual_seed(5)  # the "optimizer steps" of urb_run
    local = urb_run(InProcessBackend().build_engine(local_model, settings, 0), local_model)
    torch.manual_seed(5)  # the same "optimizer steps"
    group = RayBackend(engines=1, num_cpus_per_engine=0.5).build_engine(ray_model, settings, 0)
    try:
        remote = urb_run(group, ray_model)
        assert group.version == 3 and group.restarts == 0 and group.stats.tokens > 0
    finally:
        group.close()
    flat = [[r for groups in run for g in groups for r in g] for run in (local, remote)]
    same_rollouts(*flat)
    assert any(min(r.versions) < max(r.versions) for r in flat[1]), "no rollout spanned a weight push"


@pytest.mark.slow
def test_two_ray_engines_sample_each_query_group_as_an_in_process_engine_of_their_seed(cluster):
    model, settings = policy(), EngineSettings(max_new_tokens=10, stop_ids=(), seed=7)
    prompts = [[1, 20 + g, 11] for g in range(4) for _ in range(2)]  # groups 0..3, two samples each
    queries = [Query(str(g), "", "0", "", "add") for g in range(4) for _ in range(2)]
    groups = [g for g in range(4) for _ in range(2)]
    group = RayEngineGroup(model, settings, engines=2, num_cpus_per_engine=0.5)
    try:
        rollouts = group.start(prompts, queries, groups=groups)
        while group.pending:
            group.step(4)
        assert group.max_batch is None and group.stats.tokens == 8 * 10
    finally:
        group.close()
    for i in range(2):  # group g goes to engine g mod 2, which samples with seed 7 + i
        engine = settings.build(model, seed=7 + i)
        picked = [k for k, g in enumerate(groups) if g % 2 == i]
        expected = engine.generate([prompts[k] for k in picked], [queries[k] for k in picked])
        for k, e in zip(picked, expected, strict=True):
            e.group = groups[k]
        same_rollouts([rollouts[k] for k in picked], expected)


@pytest.mark.slow
def test_an_engine_actor_that_dies_is_recreated_from_the_current_weights_and_loses_no_rollout(cluster):
    model, settings = policy(0), EngineSettings(max_new_tokens=16, temperature=0.0, stop_ids=())
    group = RayEngineGroup(model, settings, engines=1, num_cpus_per_engine=0.5, max_restarts=1)
    try:
        new = policy(1)  # weights far from the first: greedy answers differ
        group.sync(new, 1)
        prompts = [[1, 30 + k, 11] for k in range(4)]
        queries = [Query(str(k), "", "0", "", "add") for k in range(4)]
        rollouts = group.start(prompts, queries, groups=[0, 0, 0, 0])
        completed = group.step(3)
        ray.kill(group.actors[0])  # a crash: the actor is gone with what it generated
        while group.pending:
            completed += group.step(4)
        assert group.restarts == 1
        assert sorted(map(id, completed)) == sorted(map(id, rollouts)), "a rollout was lost or duplicated"
        with pytest.raises(RuntimeError, match="restarts are spent"):
            ray.kill(group.actors[0])
            group.step(1) if group.pending else group.sync(new, 2)
    finally:
        group.close()
    expected = settings.build(new).generate(prompts, queries)
    for r, e in zip(rollouts, expected, strict=True):
        assert r.response_ids == e.response_ids and r.versions == [1] * 16


@pytest.mark.slow
def test_a_verifier_actor_killed_mid_call_is_replaced_and_every_call_is_scored_once(cluster, tmp_path):
    from ray_helpers import sleep_then_log

    log = tmp_path / "calls.txt"
    with RayVerifierPool(actors=2, timeout_s=60.0, num_cpus_per_actor=0.25) as pool:
        tickets = [pool.submit(sleep_then_log, str(log), f"call{k}", 1.5) for k in range(4)]
        deadline = time.perf_counter() + 120
        while not pool.busy_actors and time.perf_counter() < deadline:  # the actors are starting
            pool.collect([], timeout=0.1)
        time.sleep(0.5)  # mid-call
        ray.kill(pool.busy_actors[0])
        results = pool.collect(tickets)
    assert sorted(results) == tickets and all(r.ok and r.reward == 1.0 for r in results.values())
    assert sorted(log.read_text().split()) == [f"call{k}" for k in range(4)], "a call ran twice or never"
    assert pool.counts["restarts"] == 1 and pool.counts["resent"] == 1 and pool.counts["errors"] == 0


@pytest.mark.slow
def test_a_verifier_past_its_timeout_scores_zero_and_its_actor_is_replaced(cluster):
    from ray_helpers import hang

    with RayVerifierPool(actors=1, timeout_s=2.0, num_cpus_per_actor=0.25) as pool:
        pool.collect([pool.submit(hang, 0.0)])  # the actor has started: the deadline is the call's alone
        begin = time.perf_counter()
        stuck, fine = pool.submit(hang, 120.0), pool.submit(hang, 0.0)
        results = pool.collect([stuck, fine])
    assert time.perf_counter() - begin < 60
    assert results[stuck].reward == 0.0 and results[stuck].error.startswith("timeout")
    assert results[fine].ok and results[fine].reward == 1.0
    assert pool.counts["timeouts"] == 1 and pool.counts["restarts"] == 1


@pytest.fixture(scope="module")
def warm_state() -> tuple[dict, str]:
    """test_rl_task's warm-started tiny model (its weights and tokenizer), built here on first use."""
    from test_rl_task import TINY, make_data, warm_start

    torch.manual_seed(0)
    model = create_model("tiny", **TINY)
    data = make_data(model)
    warm_start(model, data)
    return {k: v.clone() for k, v in model.state_dict().items()}, data.tokenizer.to_json()


@pytest.mark.slow
def test_an_rl_run_on_ray_trains_the_weights_of_the_same_run_in_process(cluster, warm_state, tmp_path):
    from test_rl_task import fit, make_data, warm_model

    from zoo.rl.ray_verifiers import RayVerifierPool
    from zoo.rl.task import RLTask, RolloutConfig
    from zoo.rl.update import OptimConfig, UpdateConfig
    from zoo.tokenizers.text import TextTokenizer

    def run(backend, path):
        torch.manual_seed(1)
        model = warm_model(warm_state)
        data = make_data(model)
        data.use_tokenizer(TextTokenizer.from_json(warm_state[1]))
        task = RLTask(
            model, scheduler=URBScheduler(n_groups=2), rollout=RolloutConfig(max_new_tokens=6, seed=0),
            update=UpdateConfig(batch_size=4, group_size=8, micro_batch_size=16), optim=OptimConfig(lr=1e-3),
            rollout_backend=backend,
        )  # fmt: skip
        fit(task, data, path, limit_val_batches=0)
        return task, {k: v.clone() for k, v in model.state_dict().items()}

    start = warm_model(warm_state).state_dict()
    local, local_weights = run(None, tmp_path / "local")
    backend = RayBackend(engines=1, num_cpus_per_engine=0.5, verifier_actors=1)
    remote, remote_weights = run(backend, tmp_path / "ray")
    assert isinstance(remote.scorer.pool, RayVerifierPool)
    assert remote.scorer.pool.counts["calls"] == 2 * 4 * 8 and remote.scorer.pool.counts["errors"] == 0
    assert remote.version == local.version == 2
    assert any(not torch.equal(start[k], local_weights[k]) for k in start), "no signal: nothing to compare"
    assert all(torch.equal(local_weights[k], remote_weights[k]) for k in local_weights), "the runs differ"
