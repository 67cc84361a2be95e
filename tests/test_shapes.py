"""Specifications of ShapesWorld: determinism, held-out composition, captions, parser and verifier."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from dataclasses import replace

import pytest

from zoo.world.scenes import (
    ALL_PAIRS,
    CELLS,
    COLOURS,
    MOTIONS,
    SHAPES,
    SIZES,
    CaptionScore,
    Scene,
    ShapeObject,
    ShapesWorld,
    caption,
    caption_vocabulary,
    parse_caption,
    score_objects,
    verify_caption,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def obj(colour: str, shape: str, size: str, cell: str, motion: str = "still") -> ShapeObject:
    row, col = divmod(CELLS.index(cell), 3)
    return ShapeObject(colour, shape, size, row, col, motion)


def make_scene(*objects: ShapeObject) -> Scene:
    return Scene(objects=objects, index=0, split="train")


# ---------------------------------------------------------------- determinism


def test_same_seed_split_and_index_give_the_same_scene():
    a, b = ShapesWorld(seed=3), ShapesWorld(seed=3)
    for split in ("train", "val", "test"):
        for i in (0, 1, 17, 10**12):
            assert a.scene(i, split) == b.scene(i, split)


def test_a_scene_does_not_depend_on_which_scenes_were_drawn_before():
    forward = ShapesWorld(seed=1).scenes("train", 20)
    world = ShapesWorld(seed=1)
    backward = [world.scene(i, "train") for i in reversed(range(20))][::-1]
    assert forward == backward


def test_scenes_returns_the_requested_index_range():
    world = ShapesWorld(seed=2)
    got = world.scenes("val", 5, start=10)
    assert got == [world.scene(i, "val") for i in range(10, 15)]
    assert [s.index for s in got] == list(range(10, 15))
    assert all(s.split == "val" for s in got)


def test_different_seeds_give_different_scenes():
    a, b = ShapesWorld(seed=0), ShapesWorld(seed=1)
    same = sum(a.scene(i) == b.scene(i) for i in range(200))
    assert same < 5


def test_train_and_val_are_different_streams():
    world = ShapesWorld(seed=0)
    same = sum(world.scene(i, "train").objects == world.scene(i, "val").objects for i in range(200))
    assert same < 5


def test_scenes_and_heldout_pairs_are_the_same_under_every_python_hash_seed():
    code = (
        "from zoo.world.scenes import ShapesWorld, caption\n"
        "w = ShapesWorld(seed=5, include_motion=True)\n"
        "print(sorted(w.heldout_pairs))\n"
        "print([caption(w.scene(i, s), True) for s in ('train', 'val', 'test') for i in range(10)])\n"
    )
    outputs = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": REPO}
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outputs.append(result.stdout)
    assert outputs[0] == outputs[1]
    here = ShapesWorld(seed=5, include_motion=True)
    assert outputs[0].splitlines()[0] == str(sorted(here.heldout_pairs))


# ---------------------------------------------------------------- held-out composition


def test_heldout_pairs_are_about_the_requested_fraction_and_deterministic():
    for fraction in (0.05, 0.15, 0.3, 0.5):
        world = ShapesWorld(seed=4, heldout_fraction=fraction)
        assert len(world.heldout_pairs) == max(1, round(fraction * len(ALL_PAIRS)))
        assert world.heldout_pairs <= set(ALL_PAIRS)
        assert world.heldout_pairs == ShapesWorld(seed=4, heldout_fraction=fraction).heldout_pairs
    assert ShapesWorld(heldout_fraction=0.0).heldout_pairs == frozenset()


def test_heldout_pairs_depend_on_the_seed():
    assert len({ShapesWorld(seed=s).heldout_pairs for s in range(10)}) > 1


@pytest.mark.parametrize("fraction", [0.15, 0.5])
def test_every_colour_and_every_shape_still_appears_in_training(fraction):
    world = ShapesWorld(seed=0, heldout_fraction=fraction)
    assert {c for c, _ in world.train_pairs} == set(COLOURS)
    assert {s for _, s in world.train_pairs} == set(SHAPES)


@pytest.mark.parametrize("split", ["train", "val"])
def test_train_and_val_never_contain_a_heldout_pair(split):
    world = ShapesWorld(seed=0)
    seen = set()
    for scene in world.scenes(split, 2000):
        assert not set(scene.pairs) & world.heldout_pairs
        seen.update(scene.pairs)
    assert seen == set(world.train_pairs)  # and they do use every other pair


def test_every_test_scene_contains_a_heldout_pair():
    world = ShapesWorld(seed=0)
    seen = set()
    for scene in world.scenes("test", 2000):
        assert set(scene.pairs) & world.heldout_pairs
        seen.update(set(scene.pairs) & world.heldout_pairs)
    assert seen == world.heldout_pairs


def test_the_heldout_object_of_a_test_scene_is_not_always_first():
    world = ShapesWorld(seed=0, min_objects=3, max_objects=3)
    first_is_heldout = [world.scene(i, "test").pairs[0] in world.heldout_pairs for i in range(300)]
    assert 0 < sum(first_is_heldout) < 300


def test_test_split_without_heldout_pairs_is_an_error():
    with pytest.raises(ValueError, match="heldout_fraction is 0"):
        ShapesWorld(heldout_fraction=0.0).scene(0, "test")


# ---------------------------------------------------------------- scene structure


@pytest.mark.parametrize(("low", "high"), [(1, 3), (2, 2), (4, 9)])
def test_objects_occupy_distinct_cells_and_their_count_is_within_bounds(low, high):
    world = ShapesWorld(seed=0, min_objects=low, max_objects=high)
    counts = Counter()
    for split in ("train", "test"):
        for scene in world.scenes(split, 300):
            cells = [o.cell for o in scene.objects]
            assert len(set(cells)) == len(cells)
            assert low <= len(scene.objects) <= high
            counts[len(scene.objects)] += 1
    assert set(counts) == set(range(low, high + 1))


def test_train_object_weights_change_train_scene_counts_only():
    weighted = ShapesWorld(seed=0, min_objects=1, max_objects=2, train_object_weights=(1, 3))
    plain = ShapesWorld(seed=0, min_objects=1, max_objects=2)
    for split in ("val", "test"):
        assert weighted.scenes(split, 200) == plain.scenes(split, 200)
    share = {w: sum(len(s.objects) == 2 for s in w.scenes("train", 4000)) / 4000 for w in (weighted, plain)}
    assert share[weighted] == pytest.approx(0.75, abs=0.03) and share[plain] == pytest.approx(0.5, abs=0.03)
    only_two = ShapesWorld(seed=0, max_objects=2, train_object_weights=[0, 1])
    assert all(len(s.objects) == 2 for s in only_two.scenes("train", 100))


@pytest.mark.parametrize("weights", [(1,), (1, 2, 3), (-1, 2), (0, 0)])
def test_bad_train_object_weights_are_refused(weights):
    with pytest.raises(ValueError, match="train_object_weights must be 2 weights"):
        ShapesWorld(seed=0, min_objects=1, max_objects=2, train_object_weights=weights)


def test_objects_are_stored_in_reading_order_of_their_cells():
    for scene in ShapesWorld(seed=0, min_objects=3, max_objects=6).scenes("train", 100):
        indices = [o.cell_index for o in scene.objects]
        assert indices == sorted(indices)
    a = obj("red", "circle", "small", "bottom")
    b = obj("blue", "square", "large", "top left")
    assert make_scene(a, b) == make_scene(b, a)


def test_objects_are_still_unless_the_world_includes_motion():
    still = ShapesWorld(seed=0)
    moving = ShapesWorld(seed=0, include_motion=True)
    motions = Counter()
    for i in range(300):
        a, b = still.scene(i), moving.scene(i)
        assert all(o.motion == "still" for o in a.objects)
        # Motion is the only thing the flag changes.
        assert [replace(o, motion="still") for o in b.objects] == list(a.objects)
        motions.update(o.motion for o in b.objects)
    assert set(motions) == set(MOTIONS)


def test_every_attribute_value_occurs():
    seen = {"colour": set(), "shape": set(), "size": set(), "cell": set()}
    for scene in ShapesWorld(seed=0).scenes("train", 1000):
        for o in scene.objects:
            for name in seen:
                seen[name].add(getattr(o, name))
    assert seen == {"colour": set(COLOURS), "shape": set(SHAPES), "size": set(SIZES), "cell": set(CELLS)}


# ---------------------------------------------------------------- captions and parser


def test_caption_reads_like_the_design_example():
    scene = make_scene(obj("blue", "square", "large", "center"), obj("red", "circle", "small", "top left"))
    assert caption(scene) == "a small red circle at the top left and a large blue square in the center"


def test_caption_names_motion_only_when_asked():
    scene = make_scene(
        obj("red", "circle", "small", "left", "moving up"), obj("cyan", "cross", "large", "right")
    )
    assert caption(scene) == "a small red circle at the left and a large cyan cross at the right"
    assert caption(scene, include_motion=True) == (
        "a small red circle at the left moving up and a large cyan cross at the right"
    )


@pytest.mark.parametrize("include_motion", [False, True])
@pytest.mark.parametrize("split", ["train", "test"])
def test_caption_parses_back_to_the_scene_objects(split, include_motion):
    world = ShapesWorld(seed=0, max_objects=9, include_motion=include_motion)
    for scene in world.scenes(split, 500):
        assert parse_caption(world.caption(scene)) == scene.objects


@pytest.mark.parametrize(
    ("order", "plain", "moving"),
    [
        (
            "place_first",
            "at the top left a small red circle and in the center a large blue square",
            "at the top left a small red circle moving up and in the center a large blue square",
        ),
        (
            "shape_first",
            "a small circle red at the top left and a large square blue in the center",
            "a small circle red at the top left moving up and a large square blue in the center",
        ),
    ],
)
def test_another_order_rearranges_the_same_words(order, plain, moving):
    scene = make_scene(
        obj("blue", "square", "large", "center"), obj("red", "circle", "small", "top left", "moving up")
    )
    assert caption(scene, order=order) == plain
    assert caption(scene, include_motion=True, order=order) == moving
    assert sorted(caption(scene, order=order).split()) == sorted(caption(scene).split())


@pytest.mark.parametrize("order", ["place_first", "shape_first"])
@pytest.mark.parametrize("include_motion", [False, True])
def test_a_world_in_another_order_has_the_same_scenes_and_its_captions_parse_back(order, include_motion):
    other = ShapesWorld(seed=0, max_objects=9, include_motion=include_motion, caption_order=order)
    default = ShapesWorld(seed=0, max_objects=9, include_motion=include_motion)
    for split in ("train", "test"):
        for a, b in zip(other.scenes(split, 300), default.scenes(split, 300), strict=True):
            assert a == b
            assert other.caption(a) != default.caption(a)
            assert parse_caption(other.caption(a)) == a.objects
            assert other.verify(other.caption(a), a).exact and other.verify(default.caption(a), a).exact


def test_parser_reads_every_order_in_one_caption():
    text = (
        "at the top left a small red circle moving down and a large blue square in the center"
        " and a small cross green at the bottom"
    )
    assert parse_caption(text) == (
        obj("red", "circle", "small", "top left", "moving down"),
        obj("blue", "square", "large", "center"),
        obj("green", "cross", "small", "bottom"),
    )


def test_parser_refuses_two_colours_or_two_shapes():
    assert parse_caption("a small red green at the top left") is None
    assert parse_caption("a small circle square at the top left") is None


def test_parser_ignores_case_and_whitespace():
    text = "  A Small RED circle at the TOP left\n and   a large blue square in the center \t"
    assert parse_caption(text) == (
        obj("red", "circle", "small", "top left"),
        obj("blue", "square", "large", "center"),
    )


def test_parser_accepts_objects_in_any_order_and_returns_reading_order():
    text = "a large blue square in the center and a small red circle at the top left"
    assert parse_caption(text) == (
        obj("red", "circle", "small", "top left"),
        obj("blue", "square", "large", "center"),
    )


def test_parser_defaults_motion_to_still():
    assert parse_caption("a small red circle at the top")[0].motion == "still"
    assert parse_caption("a small red circle at the top moving down")[0].motion == "moving down"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "hello world",
        "a",
        "a small red",
        "a small red circle",
        "a small red circle at the",
        "a small red circle at",
        "a red small circle at the top",
        "a small red circle at the middle",
        "a small red circle at the center",
        "a small red circle in the top",
        "a small red circle at the top and",
        "and a small red circle at the top",
        "a small red circle at the top a large blue square at the left",
        "a small red circle at the top left and a large blue square at the top left",
        "a small red circle at the top left.",
        "a small red circle at the top left moving",
        "a small red circle at the top left still",
        "a small pink circle at the top",
        "a small red hexagon at the top",
        "a medium red circle at the top",
        "the small red circle at the top",
        "at the top",
        "at the top a small red",
        "at the top a small red circle at the left",
        "at the top left at the top a small red circle",
        "in the center a small red circle and",
        "moving up at the top a small red circle",
    ],
)
def test_garbage_and_partial_captions_parse_to_none(text):
    assert parse_caption(text) is None


def test_parser_rejects_non_strings():
    with pytest.raises(TypeError, match="expects a str"):
        parse_caption(None)


def test_caption_vocabulary_is_closed_and_sorted():
    vocab = caption_vocabulary()
    assert list(vocab) == sorted(set(vocab))
    used = set()
    for include_motion in (False, True):
        world = ShapesWorld(seed=0, max_objects=9, include_motion=include_motion)
        for split in ("train", "test"):
            for scene in world.scenes(split, 500):
                used.update(world.caption(scene).split())
    assert used <= set(vocab)
    assert used == set(vocab)  # and the vocabulary holds no word a caption never uses


# ---------------------------------------------------------------- verifier


THREE = make_scene(
    obj("red", "circle", "small", "top left"),
    obj("blue", "square", "large", "center"),
    obj("green", "cross", "small", "bottom right"),
)


def test_true_caption_verifies_exactly():
    world = ShapesWorld(seed=0)
    for scene in world.scenes("test", 100):
        assert world.verify(world.caption(scene), scene) == CaptionScore(True, True, 1.0, 1.0)


def test_one_wrong_colour_gives_partial_scores():
    text = caption(THREE).replace("blue", "yellow")
    score = verify_caption(text, THREE)
    assert score.parsed and not score.exact
    assert score.object_f1 == pytest.approx(2 / 3)  # 2 of 3 objects right on both sides
    assert score.attribute_accuracy == pytest.approx(8 / 9)  # one attribute of nine wrong


def test_an_object_in_the_wrong_cell_costs_all_its_attributes():
    text = caption(THREE).replace("in the center", "at the bottom")
    score = verify_caption(text, THREE)
    assert score.object_f1 == pytest.approx(2 / 3)
    assert score.attribute_accuracy == pytest.approx(6 / 9)


def test_missing_and_extra_objects_lower_the_scores():
    missing = verify_caption("a small red circle at the top left", THREE)
    assert missing.object_f1 == pytest.approx(2 * 1 / (1 + 3))
    assert missing.attribute_accuracy == pytest.approx(3 / 9)
    extra = verify_caption(caption(THREE) + " and a large white diamond at the top", THREE)
    assert extra.object_f1 == pytest.approx(2 * 3 / (4 + 3))
    assert extra.attribute_accuracy == pytest.approx(9 / 12)
    assert not missing.exact and not extra.exact


def test_unparsable_caption_scores_zero():
    assert verify_caption("a small red circle somewhere", THREE) == CaptionScore(False, False, 0.0, 0.0)


def test_motion_counts_only_when_asked():
    scene = make_scene(obj("red", "circle", "small", "left", "moving up"))
    assert verify_caption("a small red circle at the left", scene).exact
    strict = verify_caption("a small red circle at the left", scene, include_motion=True)
    assert not strict.exact
    assert strict.attribute_accuracy == pytest.approx(3 / 4)
    assert verify_caption("a small red circle at the left moving up", scene, include_motion=True).exact


def test_score_objects_serves_verifiers_that_read_objects_from_other_modalities():
    assert score_objects(list(THREE.objects), THREE.objects).exact
    assert score_objects([], THREE.objects) == CaptionScore(True, False, 0.0, 0.0)
    with pytest.raises(ValueError, match="distinct cells"):
        score_objects([THREE.objects[0], THREE.objects[0]], THREE.objects)


# ---------------------------------------------------------------- size of the world


def test_distinct_scene_count_matches_enumeration():
    world = ShapesWorld(seed=0, min_objects=1, max_objects=1)
    assert world.num_distinct_scenes("train") == 9 * len(world.train_pairs) * len(SIZES)
    assert world.num_distinct_scenes("test") == 9 * len(world.heldout_pairs) * len(SIZES)
    # Sampling far beyond the count reaches every scene and nothing more.
    train = {s.objects for s in world.scenes("train", 10000)}
    test = {s.objects for s in world.scenes("test", 3000)}
    assert len(train) == world.num_distinct_scenes("train")
    assert len(test) == world.num_distinct_scenes("test")


def test_description_shows_the_world_is_too_large_to_memorise():
    world = ShapesWorld(seed=0)
    assert world.num_distinct_scenes("train") > 10**7
    moving = ShapesWorld(include_motion=True)
    assert moving.num_distinct_scenes("train") > 100 * world.num_distinct_scenes("train")
    text = str(world)
    assert f"{world.num_distinct_scenes('train'):,}" in text
    assert f"{len(world.heldout_pairs)} of {len(ALL_PAIRS)}" in text
    assert repr(world).startswith("ShapesWorld(seed=0,")


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_objects": 0}, "min_objects must be in"),
        ({"max_objects": 10}, "max_objects must be in"),
        ({"min_objects": 3, "max_objects": 2}, "must not exceed"),
        ({"heldout_fraction": 0.9}, "heldout_fraction must be"),
        ({"seed": -1}, "seed must be"),
        ({"caption_order": "backwards"}, "caption_order must be one of"),
    ],
)
def test_bad_world_arguments_are_rejected_with_a_clear_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ShapesWorld(**kwargs)


def test_bad_scene_requests_are_rejected():
    world = ShapesWorld()
    with pytest.raises(ValueError, match="split must be one of"):
        world.scene(0, "validation")
    with pytest.raises(ValueError, match="index must be"):
        world.scene(-1)
    with pytest.raises(TypeError, match="index must be an int"):
        world.scene(1.5)


def test_invalid_objects_and_scenes_are_rejected():
    with pytest.raises(ValueError, match="colour must be one of"):
        ShapeObject("pink", "circle", "small", 0, 0)
    with pytest.raises(ValueError, match="row must be in"):
        ShapeObject("red", "circle", "small", 3, 0)
    with pytest.raises(ValueError, match="distinct cells"):
        make_scene(obj("red", "circle", "small", "top"), obj("blue", "square", "large", "top"))
    with pytest.raises(ValueError, match="1 to 9 objects"):
        Scene(objects=(), index=0, split="train")
