"""Queries and rollouts as records (zoo/rl/records.py): their checkpoint form is tensors and plain values,
it is the form checkpoints had before the RL package was rebuilt (tests/golden/rl_states.pt, written by
that code), and such a checkpoint still loads weights-only and continues."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "golden"))
from make_generations import text_model  # noqa: E402
from make_rl_states import STATES  # noqa: E402

from zoo.rl.records import Query, Rollout, document_from_state  # noqa: E402
from zoo.rl.rollout import InferenceEngine  # noqa: E402
from zoo.rl.schedulers import URBScheduler  # noqa: E402

SCHEDULER_KEYS = ("complete", "queued")


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.fixture(scope="module")
def saved() -> dict:
    return torch.load(STATES, map_location="cpu", weights_only=True)


def test_rollout_states_written_before_the_rebuild_load_weights_only_and_round_trip(saved):
    scheduled = [item for group in saved["scheduler"]["groups"].values() for item in group]
    for item in scheduled + saved["media_rollouts"]:
        rollout = Rollout.from_state(item)
        assert isinstance(rollout.query, Query) and rollout.query.id == item["query"]["id"]
        assert rollout.response_ids == item["response_ids"] and rollout.versions == item["versions"]
        assert same(rollout.to_state(), {k: v for k, v in item.items() if k not in SCHEDULER_KEYS})
    image_prompt = Rollout.from_state(saved["media_rollouts"][0]).prompt_document
    assert image_prompt[1].codes is not None and image_prompt[1].pixels is None  # tokenized once, at start


def test_a_scheduler_checkpoint_written_before_the_rebuild_continues_its_in_flight_rollouts(saved):
    model = text_model()
    engine = InferenceEngine(model, max_new_tokens=30, stop_ids=(), seed=0)
    engine.version = 2
    scheduler = URBScheduler(n_groups=2)
    scheduler.load_checkpoint_state(saved["scheduler"])
    in_flight = [r for group in scheduler._groups.values() for r in group]
    assert in_flight and all(r.response_ids and not r.done for r in in_flight)
    engine.resume(scheduler._to_resume)
    while engine.pending:
        engine.step(8)
    for r in in_flight:
        assert r.truncated and len(r.response_ids) == r.max_new_tokens
        assert all(t.shape[0] == len(r.prompt_ids) + len(r.response_ids) for t in r.routing.values())
        assert r.versions[0] == 1 and r.versions[-1] == 2  # sampled before the checkpoint, then after it


def test_only_records_of_plain_values_are_written_and_unknown_segments_are_refused():
    rollout = Rollout(object(), [1], [], torch.zeros(0), None, [], False, False)
    with pytest.raises(TypeError, match="Query"):
        rollout.to_state()
    query = Query("q", "1+1=", "2", "1+1=2", "add", 2)
    assert Query.from_state(query.to_state()) == query
    with pytest.raises(ValueError, match="segment of kind 'sound'"):
        document_from_state([{"kind": "sound", "wave": None}])
