"""AHRL hints as a specification: the decay formula by hand, never-solved queries still lose their hints,
pass_init is measured once, and the hint is a prefix of the reference solution."""

import math

import pytest

from zoo.rl.hints import HintController, HintSchedule, hint_prefix_length
from zoo.rl.tasks_text import TextTasks
from zoo.tokenizers.text import TextTokenizer


def test_hint_ratio_follows_the_formula():
    s = HintSchedule(p_init=0.5, gamma=0.1, pass_floor=0.05, min_ratio=0.0)
    assert s.ratio(0, 0.7) == 0.5
    assert s.ratio(10, 0.7) == pytest.approx(0.5 * math.exp(-0.1 * 10 * 0.7))
    # Easier queries (higher pass_init) lose their hints faster.
    assert s.ratio(10, 0.9) < s.ratio(10, 0.3)


def test_never_solved_queries_lose_their_hints_through_the_floor_or_the_global_decay():
    floor = HintSchedule(p_init=0.5, gamma=0.1, pass_floor=0.2, min_ratio=0.05)
    assert floor.ratio(10, 0.0) == pytest.approx(0.5 * math.exp(-0.1 * 10 * 0.2))
    assert floor.ratio(200, 0.0) == 0.0  # below min_ratio: no hint at all
    decay = HintSchedule(p_init=0.5, gamma=0.1, pass_floor=0.0, global_decay=0.01, min_ratio=0.0)
    assert decay.ratio(100, 0.0) == pytest.approx(0.5 * math.exp(-1.0))
    with pytest.raises(ValueError, match="forever"):
        HintSchedule(pass_floor=0.0, global_decay=0.0)


def test_schedule_arguments_are_checked():
    with pytest.raises(ValueError, match="p_init"):
        HintSchedule(p_init=1.0)
    with pytest.raises(ValueError, match="gamma"):
        HintSchedule(gamma=-1.0)
    with pytest.raises(ValueError, match="pass_init"):
        HintSchedule().ratio(0, 1.5)
    assert not HintSchedule(p_init=0.0).enabled


def test_pass_init_is_measured_once_and_unmeasured_queries_count_as_never_solved():
    c = HintController(HintSchedule(p_init=0.4, gamma=0.5, pass_floor=0.1, min_ratio=0.0))
    assert c.unmeasured(["a", "b", "a"]) == ["a", "b"]
    c.set_pass_init("a", 1.0)
    with pytest.raises(ValueError, match="already measured"):
        c.set_pass_init("a", 0.0)
    assert c.unmeasured(["a", "b"]) == ["b"]
    assert c.ratio("b", 4) == pytest.approx(0.4 * math.exp(-0.5 * 4 * 0.1))
    assert c.ratio("a", 4) < c.ratio("b", 4)
    restored = HintController(c.schedule)
    restored.load_state_dict(c.state_dict())
    assert restored.pass_init == {"a": 1.0}


def test_hint_is_a_prefix_of_the_reference_solution_in_tokens_or_characters():
    query = TextTasks(tasks=("arith",), difficulties=(4,)).query(0)
    tokenizer = TextTokenizer.byte_level()
    tokens = HintController(HintSchedule(p_init=0.5, unit="tokens"))
    ids = tokenizer.encode(query.solution)
    hint = tokens.hint(query.id, query.solution, 0, tokenizer.encode)
    assert hint == ids[: len(ids) // 2] and 0 < len(hint) < len(ids)
    chars = HintController(HintSchedule(p_init=0.25, unit="characters"))
    text = chars.hint_text(query.id, query.solution, 0)
    assert query.solution.startswith(text) and len(text) == math.floor(0.25 * len(query.solution))
    assert chars.hint(query.id, query.solution, 0, tokenizer.encode) == tokenizer.encode(text)
    # Hints shrink over steps and vanish; a disabled schedule never gives one.
    assert len(tokens.hint(query.id, query.solution, 100, tokenizer.encode)) < len(hint)
    assert HintController(HintSchedule(p_init=0.0)).hint(query.id, query.solution, 0, tokenizer.encode) == []


def test_hint_prefix_length_never_gives_the_whole_solution():
    assert hint_prefix_length(10, 0.99) == 9 and hint_prefix_length(10, 0.0) == 0
    with pytest.raises(ValueError, match="ratio"):
        hint_prefix_length(10, 1.0)
