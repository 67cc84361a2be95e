"""ShapesWorld understanding as RL environments: an image, a clip or speech in, a caption out (issue 5).

`ShapesCaptionDataModule` serves queries whose prompt is a `Document` with media, laid out as in
pretraining (`ShapesMultimodalDataModule.understanding_prompt`: `<bos> <boi> image <eoi>`, `<bos> <boa>
speech <eoa>`, `<bos> <bov> clip <eov>`); the policy writes the caption. The reward is the caption's
attribute accuracy against the scene (`zoo.rl.verifiers.verify_shapes_caption`: 1.0 iff every
attribute is right), so a group of G captions of one image gets graded, not only right/wrong, rewards.
One batch may mix modalities; the router is never told which is which.

The query's `answer` and `solution` are the reference caption (the verifier parses the scene from it;
AHRL hints are its prefixes); `difficulty` is the number of objects; `task` names the verifier
("image_caption", "speech_caption", "video_caption") so validation reports each modality apart.
"""

from __future__ import annotations

from zoo.datamodules.sequence import Document, MediaLayout, TextSegment
from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule
from zoo.rl.data import QueryDataModule
from zoo.rl.prompts import Prompt
from zoo.rl.verifiers import Query
from zoo.tokenizers.vocab import UnifiedVocab

# Understanding task of the pretraining data -> the verifier task its queries carry.
CAPTION_TASKS = {
    "image_to_text": "image_caption",
    "audio_to_text": "speech_caption",
    "video_to_text": "video_caption",
}
_DOCUMENT_CACHE = 4096  # rendered prompts kept (speech is ~100 KB a prompt)


class ShapesCaptionDataModule(QueryDataModule):
    """Media-to-caption RL queries on ShapesWorld scenes (see the module docstring).

    Args:
        tasks: understanding tasks among "image_to_text", "audio_to_text" and "video_to_text"; query i
            of a split is task i mod len(tasks), so each has an equal share of training and held-out queries.
        vocab: the model's unified vocabulary.
        layout: as the model was pretrained (only `video_frames` is checked against its temporal stride;
            the engine lays prompts out with the model's own tokenizers).
        image_size: rendered side in pixels (the visual tokenizer's input size).
        video_frames: frames per clip (1 + temporal_stride * k).
        image_context: images go through the vision encoder (context group) instead of the visual tokenizer.
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
        unknown = [t for t in tasks if t not in CAPTION_TASKS]
        if not tasks or unknown:
            raise ValueError(f"tasks must be among {sorted(CAPTION_TASKS)}, got {list(tasks)}")
        if heldout_split not in ("val", "test"):
            raise ValueError(f"heldout_split must be 'val' or 'test', got {heldout_split!r}")
        self.caption_tasks = tuple(tasks)
        self.heldout_split = heldout_split
        # The pretraining data module renders exactly what the model learnt from.
        self.scenes = ShapesMultimodalDataModule(
            vocab=vocab,
            layout=layout,
            image_to_text_weight=float("image_to_text" in tasks),
            video_to_text_weight=float("video_to_text" in tasks),
            audio_to_text_weight=float("audio_to_text" in tasks),
            image_context=image_context,
            image_size=image_size,
            video_frames=video_frames,
            world_seed=world_seed,
            min_objects=min_objects,
            max_objects=max_objects,
            seed=seed,
        )
        self._documents: dict[str, Document] = {}

    def _split(self, split: str) -> str:
        return "train" if split == "train" else self.heldout_split

    def make_queries(self, split: str, n: int) -> list[Query]:
        world_split = self._split(split)
        queries = []
        for index in range(n):
            task = self.caption_tasks[index % len(self.caption_tasks)]  # every modality an equal share
            world = self.scenes.motion_world if task == "video_to_text" else self.scenes.world
            scene = world.scene(index, world_split)
            caption = world.caption(scene)
            query_id = f"{task}/{world_split}/{index}"
            queries.append(Query(query_id, "", caption, caption, CAPTION_TASKS[task], len(scene.objects)))
        return queries

    def training_texts(self) -> list[str]:
        # As the pretraining module's tokenizer: motion captions are a superset of the still ones.
        world = self.scenes.motion_world
        return [world.caption(s) for s in world.scenes("train", max(self.train_size, 4096))]

    def base_prompt(self, query: Query) -> Prompt:
        """`<bos>` + the media of the query's scene, as a Document (rendered once, then cached)."""
        if query.id not in self._documents:
            task, split, index = query.id.split("/")
            world = self.scenes.motion_world if task == "video_to_text" else self.scenes.world
            scene = world.scene(int(index), split)
            if len(self._documents) >= _DOCUMENT_CACHE:
                self._documents.pop(next(iter(self._documents)))
            self._documents[query.id] = self.scenes.understanding_prompt(task, scene, int(index), split)
        return self._documents[query.id]

    def base_prompt_ids(self, query: Query) -> list[int]:
        raise TypeError(
            "ShapesCaptionDataModule prompts hold media: use base_prompt (a Document), laid out by the model"
        )

    def encode_prompt(self, query: Query) -> Prompt:
        """The media document, then the AHRL hint of the current step (a prefix of the caption) as text."""
        document = self.base_prompt(query)
        hint = self.hint_ids(query)
        return [*document, TextSegment(hint, predict=False)] if hint else document
