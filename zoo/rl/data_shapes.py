"""ShapesWorld as RL environments: image, clip or speech to caption, caption to image, clip or speech
(issues 5 and 18).

`ShapesRLDataModule` serves, per task:

- understanding ("image_to_text", "audio_to_text", "video_to_text"): the prompt is a `Document` with
  media laid out as in pretraining (`ShapesMultimodalDataModule.understanding_prompt`: `<bos> <boi> image
  <eoi>`, `<bos> <boa> speech <eoa>`, `<bos> <bov> clip <eov>`); the policy writes the caption, rewarded
  with its attribute accuracy against the scene (`zoo.rl.verifiers.verify_shapes_caption`);
- generation ("text_to_image"): the prompt is `<bos> caption <boi>`; the policy draws the image by NFSP
  (`zoo.rl.rollout`), rewarded with the attribute accuracy of what `zoo.world.render.verify_image` reads
  back from the decoded pixels (`verify_shapes_image`);
- video ("text_to_video", issue 18): the prompt is `<bos> caption <bov>` with a caption of a scene that
  moves (the clips of "video_to_text"); the policy draws `video_frames` frames by NFSP over latent frames
  with the causal 3D tokenizer, rewarded with the attribute accuracy, motion included, of what
  `zoo.world.render.verify_video` reads back from the decoded frames (`verify_shapes_video`);
- speech ("text_to_audio"): the prompt is `<bos> caption <boa>`; the policy speaks by NCP, rewarded with
  the share of the caption's words `zoo.world.speech.read_speech` hears in place in the decoded waveform
  (`verify_shapes_speech_words`: graded, where a whole scene read back from tiny-model speech is rare).

A chat model (role tokens in the vocabulary) is prompted as SFT taught it: the user's turn of
`zoo.datamodules.instructions.ShapesInstructions` for the same scene, in the task's first phrasing, then
`<|assistant|>` (`<bos> <|user|> Describe this image. <boi> image <eoi> <|assistant|>`; `<bos> <|user|> Draw
caption <|assistant|> <boi>`). SFT has no video conversations, so a chat model takes no video task here.

Rewards are graded (1.0 iff every attribute is right), so the G responses of a query rarely tie. One
batch mixes tasks; the router is never told which modality is which.

The query's `answer` and `solution` are the reference caption (the verifiers parse the scene from it;
AHRL hints, for captions only, are its prefixes); `difficulty` is the number of objects; `task` names
the verifier ("image_caption", "speech_caption", "video_caption", "caption_to_image",
"caption_to_video", "caption_to_speech") so that validation reports each apart. The permuted-reward
control (`UpdateConfig.permute_rewards`) applies to every task alike.
"""

from __future__ import annotations

from torch import Tensor

from zoo.datamodules.chat import chat_document
from zoo.datamodules.instructions import INSTRUCTED_TASKS, INSTRUCTIONS, user_turn
from zoo.datamodules.media_samples import Media
from zoo.datamodules.paired_documents import DocumentMaker
from zoo.datamodules.sequence import AudioSegment, MediaLayout, Segment, TextSegment, VisualSegment
from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule
from zoo.rl.data import QueryDataModule
from zoo.rl.prompts import Prompt, is_document
from zoo.rl.records import Query
from zoo.task_names import Task
from zoo.tokenizers.vocab import UnifiedVocab

# Task of the pretraining data -> the verifier task its queries carry.
TASKS = {
    Task.IMAGE_TO_TEXT: "image_caption",
    Task.AUDIO_TO_TEXT: "speech_caption",
    Task.VIDEO_TO_TEXT: "video_caption",
    Task.TEXT_TO_IMAGE: "caption_to_image",
    Task.TEXT_TO_VIDEO: "caption_to_video",
    Task.TEXT_TO_AUDIO: "caption_to_speech",
}
# Tasks whose scenes move (their captions say how): the clips, read or drawn.
MOVING = (Task.VIDEO_TO_TEXT, Task.TEXT_TO_VIDEO)
_PROMPT_CACHE = 4096  # prompts kept (rendered speech is ~100 KB a prompt)
_CHAT_PROMPT_LIMIT = 1 << 16  # positions; prompts are not packed rows, the model's context bounds them
# Task -> the ShapesInstructions task whose user turn a chat model's prompt is.
CHAT_INSTRUCTIONS = {task: name for name, task in INSTRUCTED_TASKS.items()}


class ShapesRLDataModule(QueryDataModule):
    """ShapesWorld RL queries: media to caption and caption to media (see the module docstring).

    Args:
        tasks: among "image_to_text", "audio_to_text", "video_to_text", "text_to_image", "text_to_video"
            and "text_to_audio"; query i of a split is task i mod len(tasks), so each has an equal share of
            training and held-out queries.
        vocab: the model's unified vocabulary.
        layout: as the model was pretrained (only `video_frames` is checked against its temporal stride;
            the engine lays prompts out with the model's own tokenizers).
        image_size: rendered side in pixels (the visual tokenizer's input size).
        video_frames: frames per clip (1 + temporal_stride * k), read or drawn (the RL engine draws
            video responses of this length: `RLTask.video_frames`).
        image_context: images go through the vision encoder (context group) instead of the visual tokenizer.
        video_context: videos go frame by frame through the vision encoder instead of the 3D tokenizer.
        world_seed: which ShapesWorld (as in pretraining: the demo's is 0).
        min_objects: fewest objects per scene.
        max_objects: most objects per scene (as in pretraining: the demo's is 2).
        heldout_split: "val" (unseen scenes) or "test" (unseen colour-shape pairs) for held-out queries.
        train_size .. val_batch_size: as `QueryDataModule` (`seed` also varies the speech voice).
    """

    def __init__(
        self,
        tasks: tuple[str, ...] = ("image_to_text",),
        vocab: UnifiedVocab = UnifiedVocab(),
        layout: MediaLayout = MediaLayout(),
        image_size: int = 32,
        video_frames: int = 5,
        image_context: bool = False,
        video_context: bool = False,
        world_seed: int = 0,
        min_objects: int = 1,
        max_objects: int = 2,
        heldout_split: str = "val",
        train_size: int = 1024,
        heldout_size: int = 128,
        seed: int = 0,
        tokenizer: str | None = None,
        tokenizer_size: int = 320,
        steps_per_epoch: int = 1000,
        val_batch_size: int = 64,
    ) -> None:
        super().__init__(
            vocab, train_size, heldout_size, seed, tokenizer, tokenizer_size, steps_per_epoch, val_batch_size
        )
        unknown = [t for t in tasks if t not in TASKS]
        if not tasks or unknown:
            raise ValueError(f"tasks must be among {sorted(map(str, TASKS))}, got {list(tasks)}")
        if heldout_split not in ("val", "test"):
            raise ValueError(f"heldout_split must be 'val' or 'test', got {heldout_split!r}")
        self.task_names = tuple(tasks)
        self.heldout_split = heldout_split
        self.video_frames = video_frames
        # The pretraining data module renders exactly what the model learnt from.
        self.scenes = ShapesMultimodalDataModule(
            vocab=vocab,
            layout=layout,
            text_to_image_weight=float(Task.TEXT_TO_IMAGE in tasks),
            text_to_video_weight=float(Task.TEXT_TO_VIDEO in tasks),
            text_to_audio_weight=float(Task.TEXT_TO_AUDIO in tasks),
            image_to_text_weight=float(Task.IMAGE_TO_TEXT in tasks),
            video_to_text_weight=float(Task.VIDEO_TO_TEXT in tasks),
            audio_to_text_weight=float(Task.AUDIO_TO_TEXT in tasks),
            image_context=image_context,
            video_context=video_context,
            image_size=image_size,
            video_frames=video_frames,
            world_seed=world_seed,
            min_objects=min_objects,
            max_objects=max_objects,
            seed=seed,
        )
        if vocab.chat and (unasked := [t for t in tasks if t not in CHAT_INSTRUCTIONS]):
            raise ValueError(
                f"tasks {unasked}: a chat model is prompted as SFT's ShapesInstructions asks, and those have "
                "no video conversations; use a vocabulary without role tokens, or tasks among "
                f"{sorted(map(str, CHAT_INSTRUCTIONS))}"
            )
        self._prompts: dict[str, Prompt] = {}
        self._maker: DocumentMaker | None = None

    def _split(self, split: str) -> str:
        return "train" if split == "train" else self.heldout_split

    def make_queries(self, split: str, n: int) -> list[Query]:
        world_split = self._split(split)
        queries = []
        for index in range(n):
            task = self.task_names[index % len(self.task_names)]  # every modality an equal share
            world = self.scenes.motion_world if task in MOVING else self.scenes.world
            scene = world.scene(index, world_split)
            caption = world.caption(scene)
            query_id = f"{task}/{world_split}/{index}"
            queries.append(Query(query_id, "", caption, caption, TASKS[task], len(scene.objects)))
        return queries

    def training_texts(self) -> list[str]:
        # As the pretraining module's tokenizer: motion captions are a superset of the still ones.
        world = self.scenes.motion_world
        return [world.caption(s) for s in world.scenes("train", max(self.train_size, 4096))]

    def base_prompt(self, query: Query) -> Prompt:
        """Understanding: `<bos>` + the media of the query's scene, as a Document. Generation: the unified
        ids of `<bos> caption <boi>` (or `<bov>`, `<boa>`). Made once, then cached."""
        if query.id not in self._prompts:
            task, split, index = query.id.split("/")
            if len(self._prompts) >= _PROMPT_CACHE:
                self._prompts.pop(next(iter(self._prompts)))
            if self.vocab.chat:
                self._prompts[query.id] = self.chat_prompt(Task(task), query.answer, split, int(index))
            elif Task(task).generates:
                opener = self.vocab.special(Task(task).opener)
                self._prompts[query.id] = [self.vocab.bos_id, *self.encode_text(query.answer), opener]
            else:
                world = self.scenes.motion_world if task == Task.VIDEO_TO_TEXT else self.scenes.world
                scene = world.scene(int(index), split)
                self._prompts[query.id] = self.scenes.understanding_prompt(task, scene, int(index), split)
        return self._prompts[query.id]

    def chat_prompt(self, task: Task, caption: str, split: str, index: int) -> Prompt:
        """With role tokens: the user's turn as SFT's `ShapesInstructions` writes it, in the first phrasing
        of the task, then `<|assistant|>` (`chat_document`); a generation prompt then opens the medium."""
        instruction_task = CHAT_INSTRUCTIONS[task]
        instruction = INSTRUCTIONS[instruction_task][0]
        medium: Media | None = None
        if task == Task.IMAGE_TO_TEXT:
            medium = VisualSegment(self.scenes.image(self.scenes.world.scene(index, split)), predict=False)
        elif task == Task.AUDIO_TO_TEXT:
            medium = AudioSegment(self.scenes.speech(caption, split, index, 0), predict=False)
        document = chat_document(self.maker(), [user_turn(instruction_task, instruction, caption, medium)])
        if not task.generates:
            return document
        return [*(i for segment in document for i in segment.ids), self.vocab.special(task.opener)]

    def read(self, pixels: Tensor) -> Segment:
        """As the pretraining data reads images and clips: through the vision encoder or as codes."""
        return self.scenes.read(pixels)

    def maker(self) -> DocumentMaker:
        """Lays chat prompts out as SFT's conversations are (images read as pretraining reads them)."""
        if self._maker is None:
            self._maker = DocumentMaker(
                self.vocab, self.ensure_tokenizer(), self.scenes.layout, _CHAT_PROMPT_LIMIT,
                image_context=self.scenes.image_context, video_context=self.scenes.video_context,
            )  # fmt: skip
        return self._maker

    def base_prompt_ids(self, query: Query) -> list[int]:
        prompt = self.base_prompt(query)
        if is_document(prompt):
            raise TypeError(f"query {query.id}: its prompt holds media; use base_prompt (a Document)")
        return prompt

    def encode_prompt(self, query: Query) -> Prompt:
        """The base prompt; for a caption, then the AHRL hint of the current step (a prefix of the caption)
        as text. Images and speech get no hint."""
        prompt = self.base_prompt(query)
        if not is_document(prompt):
            return prompt
        hint = self.hint_ids(query)
        return [*prompt, TextSegment(hint, predict=False)] if hint else prompt
