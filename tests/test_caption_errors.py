"""`benchmarks/generation_errors.object_errors`, which `caption_errors.py` and `generation_errors.py` share:
every true object checked in its cell, then attribute by attribute, over the objects a group keeps."""

from __future__ import annotations

import importlib
import sys
from dataclasses import replace
from pathlib import Path

from pytest import approx

from zoo.world.scenes import ShapesWorld

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # where it finds _common
object_errors = importlib.import_module("generation_errors").object_errors


def two_object_scenes(n: int) -> list:
    scenes = (ShapesWorld(seed=0).scene(i, "val") for i in range(256))
    return [s for s in scenes if len(s.objects) == 2][:n]


def test_each_object_is_found_in_its_cell_then_checked_attribute_by_attribute():
    right, wrong_shape, unreadable = two_object_scenes(3)
    other = "circle" if wrong_shape.objects[1].shape != "circle" else "square"
    predicted = [right.objects, (wrong_shape.objects[0], replace(wrong_shape.objects[1], shape=other)), None]
    errors = object_errors(predicted, [right, wrong_shape, unreadable])
    assert errors["objects"] == 6 and errors["cell"] == approx(4 / 6, abs=1e-4)  # none read from None
    assert (errors["colour"], errors["shape"], errors["size"]) == (1.0, 3 / 4, 1.0)  # of the objects found
    assert errors["exact"] == errors["exact_objects_2"] == approx(1 / 3, abs=1e-4)
    assert errors["scenes_objects_2"] == 3


def test_a_group_counts_its_objects_only_and_exact_stays_per_scene():
    (scene,) = two_object_scenes(1)
    first, second = scene.objects
    free = next(
        (r, c) for r in range(3) for c in range(3) if (r, c) not in {(o.row, o.col) for o in scene.objects}
    )
    moved = replace(second, row=free[0], col=free[1])  # right attributes, the wrong cell
    predicted = [(first, replace(second, colour="red" if second.colour != "red" else "blue"))]
    only_first = object_errors(predicted, [scene], lambda obj: obj == first)
    assert only_first["objects"] == 1 and only_first["colour"] == 1.0 and only_first["exact"] == 0.0
    only_second = object_errors(predicted, [scene], lambda obj: obj == second)
    assert only_second["colour"] == 0.0 and only_second["shape"] == 1.0
    assert object_errors([(first, moved)], [scene])["cell"] == 0.5
    nothing = object_errors(predicted, [scene], lambda obj: False)
    assert nothing["objects"] == 0 and nothing["cell"] == 0.0  # no division by zero, and the caller skips it
