"""ShapesWorld in every modality for the unified model: captions, images, videos and speech as documents.

Each training document is one scene seen through one task (`zoo.task_names.Task`), drawn per (seed, epoch,
index) with the task weights below, so one batch mixes modalities and the router sees all of them:

    caption          <bos> caption <eos>
    text_to_image    <bos> caption <boi> image <eoi> <eos>       (caption dropped with p = uncond_prob)
    image_to_text    <bos> <boi> image <eoi> caption <eos>       (the image as codes, or through the
                                                                   vision encoder when `image_context`)
    text_to_video    <bos> caption <bov> video <eov> <eos>       (captions name motion)
    video_to_text    <bos> <bov> video <eov> caption <eos>       (codes, or frame by frame through the
                                                                   vision encoder when `video_context`)
    text_to_audio    <bos> caption <boa> speech <eoa> <eos>       (caption dropped with p = audio_uncond_prob)
    audio_to_text    <bos> <boa> speech <eoa> caption <eos>

In generation tasks the caption is the condition (not a target); in understanding tasks the caption is
the target. Dropping the caption in a share of text-to-image (and, with `audio_uncond_prob`, text-to-speech)
documents teaches the unconditional model that classifier-free guidance needs (`<bos> <boi>`, `<bos> <boa>`
are its prompts).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Literal

import torch
from torch.utils.data import DataLoader

from zoo.datamodules.documents import DocumentDataModule
from zoo.datamodules.requests import MediaRequest, MediaRequests
from zoo.datamodules.sequence import (
    AudioSegment,
    ContextSegment,
    Document,
    MediaLayout,
    Packing,
    TextSegment,
    VisualSegment,
)
from zoo.task_names import SHAPES_TASKS, UNDERSTANDING, Task
from zoo.tokenizers.text import TextTokenizer
from zoo.tokenizers.vocab import UnifiedVocab
from zoo.world.render import render_image, render_video, to_tensor
from zoo.world.scenes import COLOURS, Scene, ShapesWorld, parse_caption, stable_seed
from zoo.world.speech import SAMPLE_RATE, render_speech


class ShapesMultimodalDataModule(DocumentDataModule):
    """ShapesWorld scenes as multimodal documents for `UnifiedPretraining`.

    Args:
        vocab: the model's unified vocabulary.
        layout: positions per visual frame / audio frame / context image; must match the model's
            tokenizers and encoder (the model checks).
        caption_weight .. audio_to_text_weight: relative frequency of each task (0 disables it).
        uncond_prob: share of text-to-image/video documents whose caption is dropped (for guidance).
        audio_uncond_prob: the same for text-to-speech documents (0: none; guided speech needs them).
        colour_swap_prob: in training understanding documents (image, video, speech to caption), the share
            of objects whose colour word is fed as another colour, as context without a target, before the
            shape, which stays a target: the shape must then be read from the medium, not from the colour
            written before it (held-out pairs fail as a colour written with a shape seen beside it,
            `benchmarks/colour_swap.py`). 0: off. Measured: it does not help (docs/results.md, "Colour words
            swapped in training").
        colour_swap_pairs: which colours a swap may feed. "trained": one whose pair with the object's shape
            is trained, so no held-out pair is read, even as text. "any": every other colour, so held-out
            pairs are read as text (never as images): a probe of what text that names every pair would do,
            not a held-out evaluation any more.
        caption_pairs: which colour-shape pairs the training documents of the captions task (text only)
            name. "trained": the media's pairs, so the test split's pairs are held out of everything.
            "all": every pair, as a text corpus names them: the test split is then held out of every
            medium (no image, clip or utterance of its pairs is seen, nor a caption beside one) but its
            pairs are named in text, which asks whether what text says transfers to reading images.
            Measured on three seeds: held-out image and speech captions come within 0.05 of val, val's image
            attributes falling from 0.84 to 0.77 (docs/results.md, "Text that names every pair").
        caption_order: how every caption orders an object's words (`zoo.world.scenes.CAPTION_ORDERS`):
            its place after its attributes ("a small red circle at the top left", the default) or before
            them ("at the top left a small red circle"), which has the model choose the place it reads next
            before writing what it sees there. Measured on two seeds: binding in two-object scenes moves
            with the seed, not the order, and caption to speech loses (docs/results.md, "Place before
            attributes"). Or "shape_first" ("a small circle red at the top left"): the shape is written
            from the image before a colour can veto it (docs/results.md, "The shape before the colour").
        image_context: image-to-text reads the image through the vision encoder (context group)
            instead of the visual tokenizer's codes.
        video_context: video-to-text reads the clip's frames through the vision encoder (one context group
            a frame) instead of the causal 3D tokenizer's codes.
        image_size: rendered image side in pixels (the visual tokenizer's input size).
        video_frames: frames per video (1 + temporal_stride * k).
        world_seed: which world (held-out pairs and every scene follow from it).
        min_objects: fewest objects per scene.
        max_objects: most objects per scene.
        train_object_weights: relative weights of the object counts min_objects..max_objects in training
            scenes (None: equally likely, as in validation and test, which it never changes).
        train_size: training scenes per epoch.
        val_size: validation scenes (val split) and test scenes (test split, held-out pairs).
        tokenizer: a tokenizer JSON; None trains a BPE of `tokenizer_size` ids on training captions.
        tokenizer_size: vocabulary of the trained tokenizer.
        seq_len: packed row length.
        batch_size: documents per batch.
        packing: how a batch's documents fill its rows (`SequenceBuilder`): "first_fit_decreasing" lays the
            demo's mixed-length documents in fewer rows than "in_order" (docs/benchmarks.md, packing).
        num_workers: dataloader workers (rendering happens in them).
        tokenize_in_loader: where the loader makes documents (its workers, with `num_workers` >= 1), images
            and speech are tokenized by CPU copies of the fitted model's frozen visual tokenizer and audio
            codec, so the training step reads codes (`zoo.datamodules.loader_tokenizing`); for CPU runs,
            where those encoders take a sixth of the step. Without a Trainer the model tokenizes as before.
        seed: task draws, speech variation and shuffling.
        predict_scenes: `zoo predict` answers every enabled task for this many val scenes (scored).
        predict_captions: extra captions that `zoo predict` renders as images (and speech, when enabled).
        predict_files: images (.png), videos (.gif or a folder of frames) and audio (.wav, .flac) that
            `zoo predict` captions.
    """

    def __init__(
        self,
        vocab: UnifiedVocab = UnifiedVocab(),
        layout: MediaLayout = MediaLayout(),
        caption_weight: float = 1.0,
        text_to_image_weight: float = 2.0,
        image_to_text_weight: float = 1.0,
        text_to_video_weight: float = 0.0,
        video_to_text_weight: float = 0.0,
        text_to_audio_weight: float = 0.0,
        audio_to_text_weight: float = 0.0,
        uncond_prob: float = 0.1,
        image_context: bool = False,
        video_context: bool = False,
        audio_uncond_prob: float = 0.0,
        colour_swap_prob: float = 0.0,
        colour_swap_pairs: Literal["trained", "any"] = "trained",
        caption_pairs: Literal["trained", "all"] = "trained",
        caption_order: Literal["attributes_first", "place_first", "shape_first"] = "attributes_first",
        image_size: int = 32,
        video_frames: int = 5,
        world_seed: int = 0,
        min_objects: int = 1,
        max_objects: int = 2,
        train_object_weights: list[float] | None = None,
        train_size: int = 8192,
        val_size: int = 256,
        tokenizer: str | None = None,
        tokenizer_size: int = 320,
        seq_len: int = 256,
        batch_size: int = 16,
        packing: Packing = "in_order",
        num_workers: int = 0,
        tokenize_in_loader: bool = False,
        seed: int = 0,
        predict_scenes: int = 4,
        predict_captions: list[str] | None = None,
        predict_files: list[str] | None = None,
    ) -> None:
        super().__init__(vocab, seq_len, batch_size, 0.0, False, num_workers, seed, None)
        self.predict_scenes = predict_scenes
        self.predict_captions = list(predict_captions or [])
        self.predict_files = list(predict_files or [])
        self.tokenize_in_loader = tokenize_in_loader
        self.builder.layout = layout
        self.builder.packing = packing
        weights = (
            caption_weight,
            text_to_image_weight,
            image_to_text_weight,
            text_to_video_weight,
            video_to_text_weight,
            text_to_audio_weight,
            audio_to_text_weight,
        )
        if min(weights) < 0 or sum(weights) <= 0:
            named = dict(zip(map(str, SHAPES_TASKS), weights, strict=True))
            raise ValueError(f"task weights must be >= 0 with a positive sum, got {named}")
        if not 0.0 <= colour_swap_prob <= 1.0:
            raise ValueError(f"colour_swap_prob must lie in [0, 1], got {colour_swap_prob}")
        if colour_swap_pairs not in ("trained", "any"):
            raise ValueError(f"colour_swap_pairs must be 'trained' or 'any', got {colour_swap_pairs!r}")
        if caption_pairs not in ("trained", "all"):
            raise ValueError(f"caption_pairs must be 'trained' or 'all', got {caption_pairs!r}")
        if not (0.0 <= uncond_prob < 1.0 and 0.0 <= audio_uncond_prob < 1.0):
            raise ValueError(
                f"uncond_prob and audio_uncond_prob must lie in [0, 1), got {uncond_prob} and "
                f"{audio_uncond_prob}"
            )
        if train_size < 1 or val_size < 1:
            raise ValueError(f"train_size and val_size must be >= 1, got {train_size} and {val_size}")
        layout.latent_frames(video_frames)  # refuses a frame count that does not fit the stride
        self.layout = layout
        self.weights: dict[str, float] = dict(zip(SHAPES_TASKS, weights, strict=True))
        self.uncond_prob, self.image_context, self.video_context = uncond_prob, image_context, video_context
        self.audio_uncond_prob, self.colour_swap_prob = audio_uncond_prob, colour_swap_prob
        self.colour_swap_pairs = colour_swap_pairs
        self.image_size, self.video_frames = image_size, video_frames
        world_args = {
            "seed": world_seed, "min_objects": min_objects, "max_objects": max_objects,
            "train_object_weights": train_object_weights,
        }  # fmt: skip
        self.world = ShapesWorld(**world_args, caption_order=caption_order)
        self.motion_world = ShapesWorld(**world_args, include_motion=True, caption_order=caption_order)
        # The captions task's training scenes: this world's, or a world that holds no pair out.
        self.caption_world = self.world if caption_pairs == "trained" else ShapesWorld(
            **world_args, heldout_fraction=0.0, caption_order=caption_order
        )  # fmt: skip
        self.train_size, self.val_size = train_size, val_size
        self.tokenizer_path, self.tokenizer_size = tokenizer, tokenizer_size
        self._captions: dict[str, list[str]] = {}

    # -- checkpoint state: the tokenizer, and the order its captions were written in ------------------
    def state_dict(self) -> dict[str, str]:
        # Stored so that a benchmark prompting a checkpoint writes captions as it was trained on them.
        return {**super().state_dict(), "caption_order": self.world.caption_order}

    def load_state_dict(self, state_dict: dict[str, str]) -> None:
        trained = state_dict.get("caption_order", "attributes_first")  # older checkpoints: the only order
        if trained != self.world.caption_order:
            raise ValueError(
                f"the checkpoint's captions were written {trained!r}, this datamodule writes them "
                f"{self.world.caption_order!r}: set data.init_args.caption_order to {trained!r}"
            )
        super().load_state_dict(state_dict)

    # -- texts and tokenizer ----------------------------------------------------------------------
    def texts(self, split: str) -> list[str]:
        if split not in self._captions:
            n = self.train_size if split == "train" else self.val_size
            self._captions[split] = [self.world.caption(s) for s in self.world.scenes(split, n)]
        return self._captions[split]

    def make_tokenizer(self) -> TextTokenizer:
        if self.tokenizer_path:
            return TextTokenizer.load(self.tokenizer_path)
        scenes = self.motion_world.scenes("train", 4096)
        # Motion captions are a superset of the still ones: one tokenizer serves every task.
        texts = [self.motion_world.caption(s) for s in scenes]
        return TextTokenizer.train(texts, vocab_size=self.tokenizer_size, min_frequency=2)

    # -- documents ----------------------------------------------------------------------------------
    def task_of(self, split: str, index: int, epoch: int) -> Task:
        rng = random.Random(
            stable_seed("multimodal-task", self.seed, split, index, epoch if split == "train" else 0)
        )
        names = [t for t in SHAPES_TASKS if self.weights[t] > 0]
        return rng.choices(names, weights=[self.weights[t] for t in names])[0]

    def caption_ids(self, text: str) -> list[int]:
        assert self.tokenizer is not None
        return self.vocab.text_to_unified(self.tokenizer.encode(text)).tolist()

    def colour_swapped(self, scene: Scene, caption: str, rng: random.Random) -> list[TextSegment]:
        """A training understanding document's caption and `<eos>`, as targets, but each object's colour word
        swapped with p = `colour_swap_prob` for another (`colour_swap_pairs`), fed as context: the swapped
        colour has no target, and the shape after it keeps its own."""
        held = self.world.heldout_pairs if self.colour_swap_pairs == "trained" else frozenset()
        objects = iter(scene.objects)  # the caption names them in order, one colour word each
        chunks: list[tuple[list[str], bool]] = [([], True)]
        for word in caption.split():
            if word in COLOURS:
                shape = next(objects).shape
                if rng.random() < self.colour_swap_prob:
                    allowed = [c for c in COLOURS if c != word and (c, shape) not in held]
                    chunks += [([rng.choice(allowed)], False), ([], True)]
                    continue
            chunks[-1][0].append(word)
        segments = []
        for k, (chunk, predict) in enumerate(chunks):
            text = " ".join(chunk) if k == 0 else " " + " ".join(chunk)  # byte-level BPE keeps the space
            ids = self.caption_ids(text) if chunk else []
            if k == len(chunks) - 1:
                ids.append(self.vocab.eos_id)
            if ids:
                segments.append(TextSegment(ids, predict))
        return segments

    def image(self, scene: Scene) -> torch.Tensor:
        return to_tensor(render_image(scene, self.image_size))

    def video(self, scene: Scene) -> torch.Tensor:
        return to_tensor(render_video(scene, self.video_frames, self.image_size))

    def speech(self, text: str, split: str, index: int, epoch: int) -> torch.Tensor:
        seed = stable_seed("multimodal-speech", self.seed, split, index, epoch if split == "train" else 0)
        return torch.from_numpy(render_speech(text, seed, SAMPLE_RATE))

    def read(self, pixels: torch.Tensor) -> ContextSegment | VisualSegment:
        """An image `[3, H, W]` or a video `[3, T, H, W]` as understanding reads it: through the vision
        encoder (`image_context` / `video_context`) or as the visual tokenizer's codes."""
        through_encoder = self.video_context if pixels.dim() == 4 else self.image_context
        return ContextSegment(pixels) if through_encoder else VisualSegment(pixels, predict=False)

    def make_document(self, split: str, index: int, epoch: int) -> Document:
        task = self.task_of(split, index, epoch)
        return self.task_document(task, split, index, epoch)

    def task_document(self, task: str, split: str, index: int, epoch: int = 0) -> Document:
        """The document of `task` (a `Task`) for scene `index` of `split`."""
        vocab = self.vocab
        video = task in (Task.TEXT_TO_VIDEO, Task.VIDEO_TO_TEXT)
        world = self.motion_world if video else self.world
        scene = world.scene(index, split)
        caption = self.caption_ids(world.caption(scene))
        bos, eos = TextSegment([vocab.bos_id]), TextSegment([vocab.eos_id])
        rng = random.Random(stable_seed("multimodal-uncond", self.seed, split, index, epoch))
        if task == Task.CAPTION:
            if split == "train" and self.caption_world is not self.world:
                caption = self.caption_ids(self.caption_world.caption(self.caption_world.scene(index, split)))
            return [TextSegment([vocab.bos_id, *caption, vocab.eos_id])]
        if task in (Task.TEXT_TO_IMAGE, Task.TEXT_TO_VIDEO):
            media = VisualSegment(self.video(scene) if video else self.image(scene))
            if split == "train" and rng.random() < self.uncond_prob:
                return [bos, media, eos]
            return [TextSegment([vocab.bos_id, *caption], predict=False), media, eos]
        target = [TextSegment([*caption, vocab.eos_id])]
        if split == "train" and self.colour_swap_prob > 0 and task in UNDERSTANDING:
            target = self.colour_swapped(scene, world.caption(scene), rng)
        if task in (Task.IMAGE_TO_TEXT, Task.VIDEO_TO_TEXT):
            media = self.read(self.video(scene) if video else self.image(scene))
            return [bos, media, *target]
        spoken = self.speech(world.caption(scene), split, index, epoch)
        if task == Task.TEXT_TO_AUDIO:
            if split == "train" and rng.random() < self.audio_uncond_prob:
                return [bos, AudioSegment(spoken), eos]
            return [TextSegment([vocab.bos_id, *caption], predict=False), AudioSegment(spoken), eos]
        if task == Task.AUDIO_TO_TEXT:
            return [bos, AudioSegment(spoken, predict=False), *target]
        raise ValueError(f"unknown task {task!r}; known: {', '.join(SHAPES_TASKS)}")

    def score_text(self, text: str) -> dict[str, float]:
        """A generated caption is grammatical when the ShapesWorld parser reads a scene from it."""
        return {"grammatical": float(parse_caption(text) is not None)}

    # -- zoo predict --------------------------------------------------------------------------------
    def predict_requests(self) -> list[MediaRequest]:
        """What `zoo predict` answers: val scenes per enabled task, the extra captions, the files."""
        from zoo.media import MediaError

        if self.tokenizer is None:
            self.setup("predict")
        requests = []
        for task in (t for t in SHAPES_TASKS if t is not Task.CAPTION and self.weights[t] > 0):
            world = self.motion_world if task.media == "video" else self.world
            for i, scene in enumerate(world.scenes("val", self.predict_scenes)):
                name = f"val{i:03d}"
                if task.generates:
                    prompt = self.generation_prompt(task, scene)
                    requests.append(MediaRequest(task, name, prompt, scene=scene))
                else:
                    document = self.understanding_prompt(task, scene, i)
                    requests.append(MediaRequest(task, name, document=document, scene=scene))
        for i, text in enumerate(self.predict_captions):
            ids = [self.vocab.bos_id, *self.caption_ids(text)]
            for task in (Task.TEXT_TO_IMAGE, Task.TEXT_TO_AUDIO):
                if self.weights[task] > 0:
                    prompt = [*ids, self.vocab.special(task.opener)]
                    requests.append(MediaRequest(task, f"caption{i:03d}", prompt))
        for path in self.predict_files:
            try:
                requests.append(self.file_request(path))
            except (MediaError, OSError) as error:  # one bad file is reported; the others are answered
                requests.append(MediaRequest(self.file_task(path), Path(path).stem, error=str(error)))
        return requests

    @staticmethod
    def file_task(path: str) -> Task:
        """The understanding task a file asks for, by its kind (`zoo.media.kind_of`; unknown: an image)."""
        from zoo.media import kind_of

        return Task.understanding(kind_of(path) or "image")

    def file_request(self, path: str) -> MediaRequest:
        """A caption request for an image, a video or an audio file."""
        from zoo.media import load_audio, load_image, load_video

        bos, task = TextSegment([self.vocab.bos_id]), self.file_task(path)
        if task == Task.AUDIO_TO_TEXT:
            media = AudioSegment(load_audio(path), predict=False)
        elif task == Task.VIDEO_TO_TEXT:
            media = self.read(load_video(path, frames=self.video_frames, size=self.image_size))
        else:
            media = self.read(load_image(path, size=self.image_size))
        return MediaRequest(task, Path(path).stem, document=[bos, media])

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.predict_requests(), batch_size=self.batch_size, collate_fn=MediaRequests)

    # -- prompts for evaluation and the gallery ------------------------------------------------------
    def generation_prompt(self, task: str, scene: Scene) -> list[int]:
        """Unified ids of a caption-to-media prompt ending with the media's opening token."""
        world = self.motion_world if task == Task.TEXT_TO_VIDEO else self.world
        opener = Task(task).opener
        return [self.vocab.bos_id, *self.caption_ids(world.caption(scene)), self.vocab.special(opener)]

    def understanding_prompt(self, task: str, scene: Scene, index: int = 0, split: str = "val") -> Document:
        """A media-to-caption prompt document (media then nothing: the model writes the caption)."""
        bos = TextSegment([self.vocab.bos_id])
        if task == Task.IMAGE_TO_TEXT:
            return [bos, self.read(self.image(scene))]
        if task == Task.VIDEO_TO_TEXT:
            return [bos, self.read(self.video(scene))]
        if task == Task.AUDIO_TO_TEXT:
            return [bos, AudioSegment(self.speech(self.world.caption(scene), split, index, 0), predict=False)]
        raise ValueError(f"{task!r} is not an understanding task")
