"""ShapesWorld: the embedded synthetic world, its captions and caption verifier (DESIGN.md, "ShapesWorld").

The default data of the zoo needs no download: a seeded world draws scenes of a few objects, each with
a colour, a shape, a size, a cell of a 3x3 grid and (for video) a motion. This file holds the scene
model, the caption grammar, its parser and the verifier that scores a caption against a scene. It is
plain Python so that renderers (image, video, speech) and verifiers from pixels or audio can be added
beside it without touching it: they share the attribute tuples below and score what they read back
with `score_objects`. The verifiers double as verifiable rewards for RL (ERNIE 5.0 report, RL stage).

Composition is held out: a fixed, seeded set of (colour, shape) pairs never appears in "train", and
every "test" scene contains at least one of them, so test accuracy measures composition, not recall.

Caption grammar (closed vocabulary, see `caption_vocabulary`):

    caption  := object ("and" object)*
    object   := "a" SIZE COLOUR SHAPE location [motion]      (attributes first, the default order)
              | location "a" SIZE COLOUR SHAPE [motion]      (place first: `ShapesWorld(caption_order=...)`)
    location := "in the center" | "at the" CELL        (CELL any other phrase of CELLS)
    motion   := "moving left" | "moving right" | "moving up" | "moving down"   ("still" is left unsaid)
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

COLOURS: tuple[str, ...] = ("red", "green", "blue", "yellow", "purple", "orange", "white", "cyan")
# Shapes chosen to stay distinguishable when drawn a few pixels wide.
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond", "cross")
SIZES: tuple[str, ...] = ("small", "large")
GRID_SIZE = 3
# Cell phrases in reading order: CELLS[row * GRID_SIZE + col].
CELLS: tuple[str, ...] = (
    "top left", "top", "top right",
    "left", "center", "right",
    "bottom left", "bottom", "bottom right",
)  # fmt: skip
MOTIONS: tuple[str, ...] = ("still", "moving left", "moving right", "moving up", "moving down")
SPLITS: tuple[str, ...] = ("train", "val", "test")
ALL_PAIRS: tuple[tuple[str, str], ...] = tuple((c, s) for c in COLOURS for s in SHAPES)
# How an object's phrase is ordered: its place after its attributes ("a small red circle at the top left"),
# before them ("at the top left a small red circle"), or after attributes that name the shape before the
# colour ("a small circle red at the top left": the shape is written before a colour can veto it, see
# docs/results.md). The parser reads all three.
CAPTION_ORDERS: tuple[str, ...] = ("attributes_first", "place_first", "shape_first")
MAX_OBJECTS = GRID_SIZE * GRID_SIZE


def stable_seed(*parts: object) -> int:
    """A 64-bit seed from the `str` of `parts`, equal in every process.

    Python's `hash` of a string is salted per process (PYTHONHASHSEED), so it would make scenes differ
    between runs; sha256 does not. Renderers use this too, to seed their own per-scene noise.
    """
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big")


def _check_choice(name: str, value: object, allowed: Sequence[object]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        expected = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {expected}, got {value}")
    return value


@dataclass(frozen=True)
class ShapeObject:
    """One object of a scene.

    Args:
        colour: one of COLOURS.
        shape: one of SHAPES.
        size: one of SIZES.
        row: grid row, 0 (top) .. GRID_SIZE-1 (bottom).
        col: grid column, 0 (left) .. GRID_SIZE-1 (right).
        motion: one of MOTIONS; the object's cell is where it is at the first video frame.
    """

    colour: str
    shape: str
    size: str
    row: int
    col: int
    motion: str = "still"

    def __post_init__(self) -> None:
        _check_choice("colour", self.colour, COLOURS)
        _check_choice("shape", self.shape, SHAPES)
        _check_choice("size", self.size, SIZES)
        _check_int("row", self.row, 0, GRID_SIZE - 1)
        _check_int("col", self.col, 0, GRID_SIZE - 1)
        _check_choice("motion", self.motion, MOTIONS)

    @property
    def cell_index(self) -> int:
        """Index of the cell in reading order (index into CELLS)."""
        return self.row * GRID_SIZE + self.col

    @property
    def cell(self) -> str:
        """The cell's phrase, e.g. "top left"."""
        return CELLS[self.cell_index]

    @property
    def pair(self) -> tuple[str, str]:
        """The (colour, shape) pair, the unit of held-out composition."""
        return (self.colour, self.shape)


def _check_distinct_cells(objects: Sequence[ShapeObject], what: str) -> None:
    cells = [o.cell for o in objects]
    repeated = sorted({c for c in cells if cells.count(c) > 1})
    if repeated:
        raise ValueError(f"{what} must occupy distinct cells, but cells {repeated} hold more than one object")


@dataclass(frozen=True)
class Scene:
    """A scene: 1..9 objects in distinct cells, stored in reading order of their cells.

    Args:
        objects: the objects, in any order; they are sorted into reading order (canonical form, so two
            scenes with the same objects compare equal).
        index: the scene's index in its split.
        split: one of SPLITS.
    """

    objects: tuple[ShapeObject, ...]
    index: int
    split: str

    def __post_init__(self) -> None:
        objects = tuple(self.objects)
        if not 1 <= len(objects) <= MAX_OBJECTS:
            raise ValueError(f"a scene holds 1 to {MAX_OBJECTS} objects, got {len(objects)}")
        for o in objects:
            if not isinstance(o, ShapeObject):
                raise TypeError(f"scene objects must be ShapeObject, got {type(o).__name__}")
        _check_distinct_cells(objects, "scene objects")
        _check_int("index", self.index, 0)
        _check_choice("split", self.split, SPLITS)
        object.__setattr__(self, "objects", tuple(sorted(objects, key=lambda o: o.cell_index)))

    @property
    def pairs(self) -> tuple[tuple[str, str], ...]:
        """The (colour, shape) pairs of the objects, in reading order."""
        return tuple(o.pair for o in self.objects)


# ---------------------------------------------------------------- captions


def _location_words(cell: str) -> tuple[str, ...]:
    return ("in", "the", "center") if cell == "center" else ("at", "the", *cell.split())


def caption(scene: Scene, include_motion: bool = False, order: str = "attributes_first") -> str:
    """The caption of a scene.

    For example "a small red circle at the top left and a large blue square in the center". It is a
    function of the scene: objects are listed in reading order of their cells. With `include_motion` a
    moving object's phrase ends with its motion ("... at the left moving up"); still objects say nothing
    about motion either way. `order="place_first"` names each object's place before its attributes ("at
    the top left a small red circle and in the center a large blue square"), `order="shape_first"` the
    shape before the colour ("a small circle red at the top left and ..."), the same words.
    """
    _check_choice("order", order, CAPTION_ORDERS)
    phrases = []
    for o in scene.objects:
        colour_shape = [o.shape, o.colour] if order == "shape_first" else [o.colour, o.shape]
        attributes, place = ["a", o.size, *colour_shape], list(_location_words(o.cell))
        words = place + attributes if order == "place_first" else attributes + place
        if include_motion and o.motion != "still":
            words += o.motion.split()
        phrases.append(" ".join(words))
    return " and ".join(phrases)


def caption_vocabulary() -> tuple[str, ...]:
    """Every word any caption can contain, sorted (motion words included)."""
    words = {"a", "and", *COLOURS, *SHAPES, *SIZES}
    for cell in CELLS:
        words.update(_location_words(cell))
    for motion in MOTIONS[1:]:
        words.update(motion.split())
    return tuple(sorted(words))


# Longest phrases first, so that "at the top left" wins over "at the top".
_LOCATIONS = sorted(((_location_words(c), i) for i, c in enumerate(CELLS)), key=lambda t: -len(t[0]))
_MOTION_PHRASES = [(tuple(m.split()), m) for m in MOTIONS if m != "still"]


def _match(words: list[str], pos: int, phrase: tuple[str, ...]) -> bool:
    return tuple(words[pos : pos + len(phrase)]) == phrase


def _parse_attributes(words: list[str], pos: int) -> tuple[tuple[str, str, str], int] | None:
    if len(words) < pos + 4 or words[pos] != "a":
        return None
    size, colour, shape = words[pos + 1 : pos + 4]
    if colour in SHAPES and shape in COLOURS:  # the shape_first order: "a small circle red"
        colour, shape = shape, colour
    if size not in SIZES or colour not in COLOURS or shape not in SHAPES:
        return None
    return (size, colour, shape), pos + 4


def _parse_location(words: list[str], pos: int) -> tuple[int, int] | None:
    location = next(((p, i) for p, i in _LOCATIONS if _match(words, pos, p)), None)
    if location is None:
        return None
    phrase, cell_index = location
    return cell_index, pos + len(phrase)


def _parse_object(words: list[str], pos: int) -> tuple[ShapeObject, int] | None:
    # An object starts with its attributes ("a ...") or with its place (CAPTION_ORDERS).
    if pos < len(words) and words[pos] == "a":
        attributes = _parse_attributes(words, pos)
        location = attributes and _parse_location(words, attributes[1])
    else:
        location = _parse_location(words, pos)
        attributes = location and _parse_attributes(words, location[1])
    if not attributes or not location:
        return None
    (size, colour, shape), cell_index = attributes[0], location[0]
    pos = max(attributes[1], location[1])
    motion = "still"
    for phrase, name in _MOTION_PHRASES:
        if _match(words, pos, phrase):
            motion, pos = name, pos + len(phrase)
            break
    row, col = divmod(cell_index, GRID_SIZE)
    return ShapeObject(colour, shape, size, row, col, motion), pos


def parse_caption(text: str) -> tuple[ShapeObject, ...] | None:
    """Read a caption back into objects, or None if it is not a caption of the grammar.

    Case and whitespace (around and between words) are ignored; nothing else is forgiven: an unknown
    word, a missing part, a trailing "and" or two objects in one cell give None. Objects may come in
    any order, each with its place after or before its attributes and its shape after or before its colour
    (CAPTION_ORDERS); they are returned
    in reading order of their cells, like `Scene.objects`. Motion is "still" where the caption names none.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_caption expects a str, got {type(text).__name__}")
    words = text.lower().split()
    objects: list[ShapeObject] = []
    pos = 0
    while True:
        parsed = _parse_object(words, pos)
        if parsed is None:
            return None
        obj, pos = parsed
        objects.append(obj)
        if pos == len(words):
            break
        if words[pos] != "and":
            return None
        pos += 1
    if len({o.cell_index for o in objects}) != len(objects):
        return None
    return tuple(sorted(objects, key=lambda o: o.cell_index))


# ---------------------------------------------------------------- verification


@dataclass(frozen=True)
class CaptionScore:
    """How well predicted objects (from a caption, or read back from pixels or audio) match a scene.

    Fields:
        parsed: the prediction could be read at all; when False every other field is False / 0.
        exact: the predicted objects equal the scene's (same attributes in the same cells).
        object_f1: F1 over object tuples (colour, shape, size, row, col[, motion]); with P predicted and
            T true tuples, F1 = 2 |P ∩ T| / (|P| + |T|).
        attribute_accuracy: objects are matched by cell; with attributes A = (colour, shape, size
            [, motion]), accuracy = sum over true objects o of #{a in A: a(o) = a(pred at o's cell)}
            / (|A| * max(|P|, |T|)). A true object with no prediction in its cell scores 0; the max
            makes extra predicted objects cost too. It is 1 exactly when `exact` is True.
    """

    parsed: bool
    exact: bool
    object_f1: float
    attribute_accuracy: float


def score_objects(
    predicted: Sequence[ShapeObject] | None, target: Sequence[ShapeObject], include_motion: bool = False
) -> CaptionScore:
    """Score predicted objects against the true ones (formulas in `CaptionScore`).

    Args:
        predicted: objects read from a model's output, None when unreadable.
        target: the scene's objects (non-empty, distinct cells).
        include_motion: count motion as an attribute (video tasks); otherwise it is ignored.
    """
    if len(target) == 0:
        raise ValueError("target must hold at least one object, got none")
    _check_distinct_cells(target, "target objects")
    if predicted is None:
        return CaptionScore(parsed=False, exact=False, object_f1=0.0, attribute_accuracy=0.0)
    _check_distinct_cells(predicted, "predicted objects")
    attributes = ("colour", "shape", "size") + (("motion",) if include_motion else ())

    def key(o: ShapeObject) -> tuple:
        return (o.row, o.col, *(getattr(o, a) for a in attributes))

    pred_keys = {key(o) for o in predicted}
    true_keys = {key(o) for o in target}
    f1 = 2 * len(pred_keys & true_keys) / (len(pred_keys) + len(true_keys))
    pred_by_cell = {o.cell_index: o for o in predicted}
    matches = 0
    for t in target:
        p = pred_by_cell.get(t.cell_index)
        if p is not None:
            matches += sum(getattr(p, a) == getattr(t, a) for a in attributes)
    accuracy = matches / (len(attributes) * max(len(predicted), len(target)))
    return CaptionScore(parsed=True, exact=pred_keys == true_keys, object_f1=f1, attribute_accuracy=accuracy)


def verify_caption(text: str, scene: Scene, include_motion: bool = False) -> CaptionScore:
    """Score a caption against a scene: `score_objects(parse_caption(text), scene.objects)`."""
    return score_objects(parse_caption(text), scene.objects, include_motion=include_motion)


# ---------------------------------------------------------------- the world


def _choose_heldout(seed: int, count: int) -> frozenset[tuple[str, str]]:
    """`count` pairs spread evenly over colours and shapes, so each stays in training with other partners."""
    rng = random.Random(stable_seed("shapesworld", seed, "heldout"))
    per_colour = dict.fromkeys(COLOURS, 0)
    per_shape = dict.fromkeys(SHAPES, 0)
    chosen: list[tuple[str, str]] = []
    for _ in range(count):
        remaining = [p for p in ALL_PAIRS if p not in chosen]

        def load(p: tuple[str, str]) -> tuple[int, int]:
            c, s = per_colour[p[0]], per_shape[p[1]]
            return (max(c, s), c + s)

        best = min(load(p) for p in remaining)
        pick = rng.choice([p for p in remaining if load(p) == best])
        chosen.append(pick)
        per_colour[pick[0]] += 1
        per_shape[pick[1]] += 1
    return frozenset(chosen)


class ShapesWorld:
    """A seeded, unbounded stream of scenes per split, with held-out (colour, shape) compositions.

    `scene(index, split)` depends only on (seed, split, index) and the constructor arguments; indices
    are unbounded. "train" and "val" draw pairs outside `heldout_pairs` from separate seed streams;
    every "test" scene has at least one held-out pair (its other objects use any pair).

    Args:
        seed: selects the held-out pairs and every scene (>= 0).
        min_objects: fewest objects per scene (>= 1).
        max_objects: most objects per scene (<= 9, one per cell).
        heldout_fraction: share of the 40 (colour, shape) pairs held out of training, in [0, 0.5];
            any positive fraction holds out at least one pair. 0 leaves the "test" split empty.
        include_motion: draw a motion per object and caption it (video); otherwise all objects are
            still. The other attributes of a scene are the same either way.
        caption_order: how `caption` orders each object's words (CAPTION_ORDERS): "attributes_first"
            ("a small red circle at the top left"), "place_first" ("at the top left a small red
            circle") or "shape_first" ("a small circle red at the top left"). Scenes do not depend on it.
        train_object_weights: relative weights of the object counts min_objects..max_objects in "train"
            scenes (None: every count equally likely, as in "val" and "test", which it never changes).
    """

    def __init__(
        self,
        seed: int = 0,
        min_objects: int = 1,
        max_objects: int = 3,
        heldout_fraction: float = 0.15,
        include_motion: bool = False,
        caption_order: str = "attributes_first",
        train_object_weights: Sequence[float] | None = None,
    ) -> None:
        _check_choice("caption_order", caption_order, CAPTION_ORDERS)
        self.caption_order = caption_order
        self.seed = _check_int("seed", seed, 0)
        self.min_objects = _check_int("min_objects", min_objects, 1, MAX_OBJECTS)
        self.max_objects = _check_int("max_objects", max_objects, 1, MAX_OBJECTS)
        if min_objects > max_objects:
            raise ValueError(f"min_objects ({min_objects}) must not exceed max_objects ({max_objects})")
        if train_object_weights is not None:
            counts = max_objects - min_objects + 1
            weights = tuple(float(w) for w in train_object_weights)
            if len(weights) != counts or min(weights) < 0 or sum(weights) <= 0:
                raise ValueError(
                    f"train_object_weights must be {counts} weights >= 0 with a positive sum (one per object "
                    f"count {min_objects}..{max_objects}), got {train_object_weights!r}"
                )
            train_object_weights = weights
        self.train_object_weights = train_object_weights
        if not isinstance(heldout_fraction, int | float) or not 0.0 <= heldout_fraction <= 0.5:
            raise ValueError(f"heldout_fraction must be a number in [0, 0.5], got {heldout_fraction!r}")
        self.heldout_fraction = float(heldout_fraction)
        self.include_motion = bool(include_motion)
        count = 0 if heldout_fraction == 0 else max(1, round(heldout_fraction * len(ALL_PAIRS)))
        self._heldout = _choose_heldout(seed, count)
        # Sorted tuples: iterating a set of strings would depend on the per-process hash salt.
        self._heldout_list = tuple(p for p in ALL_PAIRS if p in self._heldout)
        self._train_pairs = tuple(p for p in ALL_PAIRS if p not in self._heldout)

    @property
    def heldout_pairs(self) -> frozenset[tuple[str, str]]:
        """The (colour, shape) pairs that never appear in "train" or "val"."""
        return self._heldout

    @property
    def train_pairs(self) -> tuple[tuple[str, str], ...]:
        """The (colour, shape) pairs "train" and "val" draw from."""
        return self._train_pairs

    def scene(self, index: int, split: str = "train") -> Scene:
        """The scene at `index` of `split` (one of SPLITS)."""
        _check_choice("split", split, SPLITS)
        _check_int("index", index, 0)
        if split == "test" and not self._heldout_list:
            raise ValueError("the 'test' split needs held-out pairs, but heldout_fraction is 0")
        rng = random.Random(stable_seed("shapesworld", self.seed, split, index))
        if split == "train" and self.train_object_weights is not None:
            counts = range(self.min_objects, self.max_objects + 1)
            n = rng.choices(counts, weights=self.train_object_weights)[0]
        else:
            n = rng.randint(self.min_objects, self.max_objects)
        cells = rng.sample(range(MAX_OBJECTS), n)
        if split == "test":
            pairs = [rng.choice(self._heldout_list)] + [rng.choice(ALL_PAIRS) for _ in range(n - 1)]
        else:
            pairs = [rng.choice(self._train_pairs) for _ in range(n)]
        objects = []
        for cell, (colour, shape) in zip(cells, pairs, strict=True):
            size = rng.choice(SIZES)
            # Drawn either way, so that include_motion changes nothing but the motion.
            drawn = rng.choice(MOTIONS)
            motion = drawn if self.include_motion else "still"
            row, col = divmod(cell, GRID_SIZE)
            objects.append(ShapeObject(colour, shape, size, row, col, motion))
        return Scene(objects=tuple(objects), index=index, split=split)

    def scenes(self, split: str, n: int, start: int = 0) -> list[Scene]:
        """Scenes `start .. start+n-1` of `split`."""
        _check_int("n", n, 0)
        _check_int("start", start, 0)
        return [self.scene(i, split) for i in range(start, start + n)]

    def caption(self, scene: Scene) -> str:
        """`caption(scene)` in this world's order, naming motion when this world has it."""
        return caption(scene, include_motion=self.include_motion, order=self.caption_order)

    def verify(self, text: str, scene: Scene) -> CaptionScore:
        """`verify_caption(text, scene)`, counting motion when this world has it."""
        return verify_caption(text, scene, include_motion=self.include_motion)

    def num_distinct_scenes(self, split: str) -> int:
        """How many different scenes `split` can produce.

        With D object descriptions per cell (allowed pairs x sizes x motions) a scene of k objects is a
        choice of k cells and a description for each: C(9, k) * D^k. "test" counts scenes with at least
        one held-out pair: C(9, k) * (D_all^k - D_train^k).
        """
        _check_choice("split", split, SPLITS)
        per_pair = len(SIZES) * (len(MOTIONS) if self.include_motion else 1)
        d_train = len(self._train_pairs) * per_pair
        d_all = len(ALL_PAIRS) * per_pair
        total = 0
        for k in range(self.min_objects, self.max_objects + 1):
            ways = d_all**k - d_train**k if split == "test" else d_train**k
            total += math.comb(MAX_OBJECTS, k) * ways
        return total

    def describe(self) -> str:
        """A summary of the world's size, to show that it cannot be memorised."""
        heldout = ", ".join(f"{c} {s}" for c, s in self._heldout_list) or "none"
        return (
            f"{self!r}: {self.num_distinct_scenes('train'):,} distinct train/val scenes, "
            f"{self.num_distinct_scenes('test'):,} distinct test scenes; "
            f"{len(self._heldout)} of {len(ALL_PAIRS)} colour-shape pairs held out of training ({heldout})"
        )

    def __str__(self) -> str:
        return self.describe()

    def __repr__(self) -> str:
        return (
            f"ShapesWorld(seed={self.seed}, min_objects={self.min_objects}, max_objects={self.max_objects}, "
            f"heldout_fraction={self.heldout_fraction}, include_motion={self.include_motion}, "
            f"caption_order={self.caption_order!r})"
        )
