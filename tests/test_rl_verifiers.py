"""Text tasks and verifiers as a specification: seeded queries whose reference solutions verify, disjoint
splits, ShapesWorld captions, and a worker pool where raising, hanging, garbage-returning or dying
verifiers cost reward 0 and a logged error, never the run."""

import logging
import time

import pytest
import rl_verifier_helpers as helpers

from zoo.rl.tasks_text import GENERATORS, TextTasks, training_text
from zoo.rl.verifiers import (
    Query,
    VerifierPool,
    as_reward,
    last_integer,
    verifier_for,
    verify_integer,
    verify_shapes_caption,
    verify_sorted,
)
from zoo.world.scenes import ShapesWorld

# ------------------------------------------------------------------------------------------ text tasks


@pytest.mark.parametrize("task", sorted(GENERATORS))
@pytest.mark.parametrize("difficulty", [1, 3, 5])
def test_every_reference_solution_verifies_and_a_wrong_answer_does_not(task: str, difficulty: int):
    tasks = TextTasks(tasks=(task,), difficulties=(difficulty,), seed=3)
    for query in tasks.queries("train", 20):
        verify = verifier_for(query.task)
        assert verify(query, query.solution) == 1.0, query
        assert verify(query, " " + query.solution + "\n") == 1.0
        wrong = query.solution[: -len(query.answer)] + ("1" if task == "sort" else str(int(query.answer) + 1))
        assert verify(query, wrong) == 0.0, (query, wrong)
        assert verify(query, "") == 0.0


def test_queries_are_seeded_and_depend_on_index_split_and_seed():
    a = TextTasks(tasks=("add", "sort"), difficulties=(1, 2), seed=0)
    b = TextTasks(tasks=("add", "sort"), difficulties=(1, 2), seed=0)
    assert a.queries("train", 12) == b.queries("train", 12)
    other = TextTasks(tasks=("add", "sort"), difficulties=(1, 2), seed=1)
    assert [q.prompt for q in other.queries("train", 12)] != [q.prompt for q in a.queries("train", 12)]
    # Index order cycles through (task, difficulty) pairs evenly.
    assert [(q.task, q.difficulty) for q in a.queries("train", 4)] == [
        ("add", 1), ("add", 2), ("sort", 1), ("sort", 2)
    ]  # fmt: skip
    assert len({q.id for q in a.queries("train", 50)}) == 50


def test_train_and_heldout_never_share_a_prompt_even_in_a_small_prompt_space():
    tasks = TextTasks(tasks=("add",), difficulties=(1,), seed=0, heldout_fraction=0.2)  # 100 prompts in all
    train = {q.prompt for q in tasks.queries("train", 400)}
    heldout = {q.prompt for q in tasks.queries("heldout", 100)}
    assert train and heldout and not train & heldout
    assert all(tasks.is_heldout(p) for p in heldout)


def test_difficulty_makes_problems_longer():
    short = TextTasks(tasks=("arith",), difficulties=(1,)).query(0)
    long = TextTasks(tasks=("arith",), difficulties=(5,)).query(0)
    assert short.prompt.count("+") + short.prompt.count("-") == 1
    assert long.prompt.count("+") + long.prompt.count("-") >= 5
    assert len(long.solution.split(",")) == 5
    assert training_text(short) == short.prompt + short.solution


def test_bad_task_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="tasks"):
        TextTasks(tasks=("multiply",))
    with pytest.raises(ValueError, match="difficulties"):
        TextTasks(difficulties=(0,))
    with pytest.raises(ValueError, match="split"):
        TextTasks().query(0, "test")
    with pytest.raises(KeyError, match="no verifier"):
        verifier_for("chess")


def test_answer_extraction_reads_the_last_integer_and_sorted_lists_exactly():
    assert last_integer("12+7=19,19-3=16") == "16" and last_integer("no digits") is None
    assert last_integer("-5") == "-5"
    q = Query("q", "3-8=", "-5", "-5", "arith", 1)
    assert verify_integer(q, "3-8=-5") == 1.0 and verify_integer(q, "5") == 0.0
    s = Query("s", "sort 3 1 2:", "1 2 3", "1 2 3", "sort", 1)
    assert verify_sorted(s, "1  2 3") == 1.0 and verify_sorted(s, "1 2 3 3") == 0.0
    with pytest.raises(TypeError, match="str"):
        verify_integer(q, 5)  # type: ignore[arg-type]


def test_shapes_caption_reward_is_attribute_accuracy_and_one_only_when_exact():
    world = ShapesWorld(seed=0, min_objects=2, max_objects=2)
    scene = world.scene(0)
    reference = world.caption(scene)
    q = Query("shapes/0", "describe:", reference, reference, "shapes_caption", 2)
    assert verify_shapes_caption(q, reference) == 1.0
    first = scene.objects[0]
    other_colour = next(c for c in ("red", "green", "blue") if c != first.colour)
    wrong = reference.replace(
        f"{first.size} {first.colour} {first.shape}", f"{first.size} {other_colour} {first.shape}", 1
    )
    assert 0.0 < verify_shapes_caption(q, wrong) < 1.0
    assert verify_shapes_caption(q, "gibberish") == 0.0


def test_as_reward_accepts_finite_reals_and_names_garbage():
    assert as_reward(True) == (1.0, None) and as_reward(3) == (3.0, None)
    for garbage in ("1", None, float("inf"), [1.0]):
        reward, error = as_reward(garbage)
        assert reward == 0.0 and error.startswith("garbage")


# ---------------------------------------------------------------------------------------------- pool


def test_inline_pool_turns_raising_and_garbage_verifiers_into_reward_zero_with_a_logged_error(caplog):
    pool = VerifierPool(workers=0)
    with caplog.at_level(logging.WARNING, logger="zoo.rl.verifiers"):
        results = (
            pool.map(helpers.correct, [(None, "a")])
            + pool.map(helpers.raises, [(None, "b")])
            + pool.map(helpers.returns_nan, [(None, "c")])
        )
    assert [r.reward for r in results] == [1.0, 0.0, 0.0]
    assert results[0].ok and "RuntimeError" in results[1].error and "non-finite" in results[2].error
    assert sum("reward 0" in r.message for r in caplog.records) == 2
    assert pool.counts["errors"] == 2 and pool.counts["garbage"] == 1


def test_worker_pool_survives_raising_hanging_garbage_and_dying_verifiers(caplog):
    queries = TextTasks(tasks=("add",), difficulties=(2,)).queries("train", 4)
    with VerifierPool(workers=2, timeout_s=1.5) as pool, caplog.at_level(logging.WARNING):
        start = time.perf_counter()
        tickets = {
            "hang": pool.submit(helpers.hangs, None, "x"),
            "raise": pool.submit(helpers.raises, None, "x"),
            "text": pool.submit(helpers.returns_text, None, "x"),
            "none": pool.submit(helpers.returns_none, None, "x"),
            "die": pool.submit(helpers.dies, None, "x"),
            "good": pool.submit(helpers.echo_length, None, "abcd"),
        }
        results = pool.collect(tickets.values())
        elapsed = time.perf_counter() - start
        by_name = {name: results[t] for name, t in tickets.items()}
        assert by_name["good"].reward == 4.0 and by_name["good"].ok
        for name in ("hang", "raise", "text", "none", "die"):
            assert by_name[name].reward == 0.0 and not by_name[name].ok, name
        assert by_name["hang"].error.startswith("timeout")
        assert "RuntimeError" in by_name["raise"].error
        assert by_name["text"].error.startswith("garbage") and by_name["none"].error.startswith("garbage")
        assert "died" in by_name["die"].error
        assert pool.counts["timeouts"] == 1 and pool.counts["restarts"] >= 2
        assert elapsed < 60
        # The pool keeps working after the failures: real task verifiers, by task name.
        scored = pool.score(queries, [q.solution for q in queries[:2]] + ["nonsense", "-1"])
        assert [r.reward for r in scored] == [1.0, 1.0, 0.0, 0.0]
    assert any("timeout" in r.message for r in caplog.records)


def test_collect_refuses_unknown_tickets_and_bad_pool_arguments():
    pool = VerifierPool(workers=0)
    with pytest.raises(KeyError, match="unknown"):
        pool.collect([7])
    with pytest.raises(ValueError, match="workers"):
        VerifierPool(workers=-1)
    with pytest.raises(ValueError, match="timeout_s"):
        VerifierPool(timeout_s=0)


def test_generated_media_are_rewarded_by_the_shapesworld_readers():
    render = pytest.importorskip("zoo.world.render")
    speech = pytest.importorskip("zoo.world.speech")
    world = ShapesWorld(seed=0, min_objects=2, max_objects=2)
    scene, other = world.scene(0), world.scene(1)
    reference = world.caption(scene)
    for task, make in (
        ("shapes_image", render.render_image),
        ("shapes_video", render.render_video),
        ("shapes_speech", lambda s: speech.render_speech(world.caption(s), seed=0)),
    ):
        q = Query("media/0", "draw:", reference, reference, task, 2)
        verify = verifier_for(task)
        assert verify(q, make(scene)) == 1.0, task
        assert verify(q, make(other)) < 1.0, task
