"""The tasks a training document can serve (`caption`, `text_to_image`, ...): one enum for the whole zoo.

A task says what a document shows the model and what it predicts. ShapesWorld (`zoo.datamodules.
shapes_multimodal`) and real paired data (`zoo.datamodules.paired_documents`) make the same document for the
same task, the evaluation (`zoo.tasks.multimodal_eval`), `zoo predict` and the RL environments
(`zoo.rl.data_shapes`) ask for tasks by these names, and metrics are keyed by them (`text_to_image/exact`):

    caption          <bos> caption <eos>
    text_to_image    <bos> caption <boi> image <eoi> <eos>       generation: the caption is the condition
    image_to_text    <bos> <boi> image <eoi> caption <eos>       understanding: the caption is the target
    text_to_video    <bos> caption <bov> video <eov> <eos>
    video_to_text    <bos> <bov> video <eov> caption <eos>
    text_to_audio    <bos> caption <boa> audio <eoa> <eos>
    audio_to_text    <bos> <boa> audio <eoa> caption <eos>
    interleaved      <bos> part part ... <eos>                   (real data: texts and media in any order)

`Task` is a `StrEnum`: a member equals its name as a string, so YAML, checkpoints and metric keys keep
plain strings. The order of the members is the order tasks are drawn and evaluated in (seeded draws depend
on it): do not reorder them; add a new task at the end.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

Media = Literal["image", "video", "audio"]  # as `zoo.media.kinds.MediaKind`

_OPENERS: dict[str, str] = {"image": "<boi>", "video": "<bov>", "audio": "<boa>"}


class Task(StrEnum):
    """A document's task (module docstring); `media`, `generates`, `understands`, `opener` describe it."""

    CAPTION = "caption"
    TEXT_TO_IMAGE = "text_to_image"
    IMAGE_TO_TEXT = "image_to_text"
    TEXT_TO_VIDEO = "text_to_video"
    VIDEO_TO_TEXT = "video_to_text"
    TEXT_TO_AUDIO = "text_to_audio"
    AUDIO_TO_TEXT = "audio_to_text"
    INTERLEAVED = "interleaved"

    @property
    def media(self) -> Media | None:
        """The medium a media task generates or reads (None: caption, interleaved)."""
        source, _, target = self.value.partition("_to_")
        medium = target if source == "text" else source
        return medium if medium in _OPENERS else None  # type: ignore[return-value]

    @property
    def generates(self) -> bool:
        """Text to a medium: the caption is the condition, the medium the target."""
        return self.value.startswith("text_to_")

    @property
    def understands(self) -> bool:
        """A medium to text: the medium is input only, the caption the target."""
        return self.value.endswith("_to_text")

    @property
    def guided(self) -> bool:
        """Visual generation, whose captions drop out of a share of documents for classifier-free guidance."""
        return self in (Task.TEXT_TO_IMAGE, Task.TEXT_TO_VIDEO)

    @property
    def opener(self) -> str:
        """The special token that opens this task's medium (`<boi>`, `<bov>`, `<boa>`): a generation prompt
        ends with it."""
        if self.media is None:
            raise ValueError(f"task {self.value!r} has no medium, hence no opening token")
        return _OPENERS[self.media]

    @classmethod
    def generating(cls, media: Media) -> Task:
        """The task that generates `media` from text."""
        return cls(f"text_to_{media}")

    @classmethod
    def understanding(cls, media: Media) -> Task:
        """The task that captions `media`."""
        return cls(f"{media}_to_text")


GENERATION = tuple(t for t in Task if t.generates)  # text_to_image, text_to_video, text_to_audio
UNDERSTANDING = tuple(t for t in Task if t.understands)  # image_to_text, video_to_text, audio_to_text
SHAPES_TASKS = tuple(t for t in Task if t is not Task.INTERLEAVED)  # what ShapesWorld documents serve
