"""Built-in instruction data of ShapesWorld for SFT (issue 18 item 1): one conversation per scene, in every
modality the model speaks, generated on the fly from (seed, split, index).

    describe_image   user: <instruction> <image>     assistant: caption
    describe_speech  user: <instruction> <speech>    assistant: the words said (its caption)
    draw             user: <instruction> caption     assistant: <image>
    say              user: <instruction> caption     assistant: <speech>

The instruction is one of a few phrasings per task ("Describe this image.", "What is in the picture?"),
drawn per conversation, so the model learns the task, not one string. Splits are the world's: "train" and
"val" share the (colour, shape) compositions and never a scene, "test" holds the compositions training
never sees (`zoo.world.scenes.ShapesWorld`). Arithmetic instructions live beside RL's text tasks
(`zoo.rl.instructions`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import soxr
import torch

from zoo.datamodules.chat import Turn
from zoo.datamodules.conversations import ConversationSource
from zoo.datamodules.media_samples import Media, MediaSpec
from zoo.datamodules.sequence import AudioSegment, VisualSegment
from zoo.task_names import Task
from zoo.world.render import render_image, to_tensor
from zoo.world.scenes import ShapesWorld, stable_seed
from zoo.world.speech import SAMPLE_RATE, render_speech

INSTRUCTIONS: dict[str, tuple[str, ...]] = {
    "describe_image": ("Describe this image.", "What is in the picture?", "Caption this image."),
    "describe_speech": ("What is said here?", "Transcribe this speech.", "Write down what you hear."),
    "draw": ("Draw", "Draw this:", "Make a picture of"),
    "say": ("Say", "Say this:", "Speak the words"),
}
SHAPES_INSTRUCTIONS = tuple(INSTRUCTIONS)
# The pretraining task each instruction asks for (RL's chat prompts ask for a task this way: `user_turn`).
INSTRUCTED_TASKS = {
    "describe_image": Task.IMAGE_TO_TEXT,
    "describe_speech": Task.AUDIO_TO_TEXT,
    "draw": Task.TEXT_TO_IMAGE,
    "say": Task.TEXT_TO_AUDIO,
}


def user_turn(task: str, instruction: str, caption: str, medium: Media | None, where: str = "") -> Turn:
    """What the user says for instruction task `task`: the instruction and the medium to describe, or the
    instruction and the caption to draw or say (`medium` None)."""
    if task.startswith("describe"):
        if medium is None:
            raise ValueError(f"{task}: the user's turn needs the image or speech to describe")
        return Turn("user", (instruction, medium), where)
    return Turn("user", (f"{instruction} {caption}",), where)


class ShapesInstructions(ConversationSource):
    """ShapesWorld scenes as instruction conversations (module docstring).

    Args:
        describe_image, describe_speech, draw, say: relative frequency of each task (0 disables it); a task
            the model cannot do (no visual tokenizer, no codec) is a bad sample, so disable it instead.
        train_size, val_size, test_size: conversations per split (an epoch is this many; scenes are
            unbounded).
        world_seed: which world (held-out compositions and every scene follow from it).
        min_objects, max_objects: objects per scene.
        seed: the task and phrasing drawn per conversation.
    """

    def __init__(
        self,
        describe_image: float = 1.0,
        describe_speech: float = 0.0,
        draw: float = 1.0,
        say: float = 0.0,
        train_size: int = 4096,
        val_size: int = 64,
        test_size: int = 64,
        world_seed: int = 0,
        min_objects: int = 1,
        max_objects: int = 2,
        seed: int = 0,
    ) -> None:
        self.weights = {"describe_image": describe_image, "describe_speech": describe_speech, "draw": draw,
                        "say": say}  # fmt: skip
        if any(w < 0 for w in self.weights.values()) or not any(w > 0 for w in self.weights.values()):
            raise ValueError(f"task weights must be >= 0 with at least one positive, got {self.weights}")
        if min(train_size, val_size, test_size) < 0:
            raise ValueError("train_size, val_size and test_size must be >= 0")
        self.sizes = {"train": train_size, "val": val_size, "test": test_size}
        self.world = ShapesWorld(world_seed, min_objects, max_objects)
        self.seed = seed

    def __repr__(self) -> str:
        return f"ShapesInstructions({self.weights})"

    def count(self, split: str) -> int:
        return self.sizes[split]

    def task_of(self, split: str, index: int, epoch: int) -> tuple[str, str]:
        """The task and instruction of conversation `index` (drawn anew each training epoch)."""
        rng = random.Random(
            stable_seed("sft-shapes", self.seed, split, index, epoch if split == "train" else 0)
        )
        names = [t for t in SHAPES_INSTRUCTIONS if self.weights[t] > 0]
        task = rng.choices(names, weights=[self.weights[t] for t in names])[0]
        return task, rng.choice(INSTRUCTIONS[task])

    def conversation(self, split: str, index: int, epoch: int, spec: MediaSpec) -> list[Turn]:
        scene = self.world.scene(index, split)
        caption = self.world.caption(scene)
        task, instruction = self.task_of(split, index, epoch)
        where = f"ShapesInstructions {split} {index} ({task})"
        if task in ("describe_image", "draw"):
            assert spec.image_size is not None
            medium: VisualSegment | AudioSegment = VisualSegment(
                to_tensor(render_image(scene, spec.image_size))
            )
        else:
            assert spec.sample_rate is not None
            wave = render_speech(caption, stable_seed("sft-speech", self.seed, split, index), SAMPLE_RATE)
            if spec.sample_rate != SAMPLE_RATE:
                wave = soxr.resample(wave, SAMPLE_RATE, spec.sample_rate).astype(np.float32)
            medium = AudioSegment(torch.from_numpy(np.ascontiguousarray(wave)))
        answer = (caption,) if task.startswith("describe") else (medium,)
        return [user_turn(task, instruction, caption, medium, where), Turn("assistant", answer, where)]

    def texts(self) -> Iterator[str]:
        for index in range(min(self.sizes["train"], 4096)):
            yield self.world.caption(self.world.scene(index, "train"))
        for phrasings in INSTRUCTIONS.values():
            yield from phrasings
