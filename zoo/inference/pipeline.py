"""Use a trained unified model from Python: `zoo.pipeline(source)` (issue 16, item 1).

    pipe = zoo.pipeline("runs/demo/multimodal/latest/checkpoints/last.ckpt")  # or an export, a hub id
    pipe("a small red circle")                          # text continuation -> str
    pipe("a small red circle", output="image")          # caption to image -> PIL.Image
    pipe(image=Image.open("scene.png"))                 # image to caption -> str
    pipe(audio="speech.wav")                            # speech to transcript -> str
    pipe("a small red circle", output="speech")         # caption to speech -> Speech(wave, sample_rate)
    for piece in pipe.stream("a small"): print(piece, end="")

Strings, PIL images and audio arrays with their rate go in and come out: never unified ids. The pipeline
makes the same documents training made (`DocumentMaker`: `<bos>`, an optional prompt, the media, then the
model's answer), lays them out with the same `SequenceBuilder` and decodes with the one decoding core
(`zoo.models.generation.stream_text`, `zoo.models.media_generation`). Media inputs go through `zoo.media`, the
loaders of the training data, so a PIL image, an array or a file is checked, resized and resampled alike.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np
import soundfile as sf
import torch
from PIL import Image

from zoo.batch import GroupBatch
from zoo.datamodules.bad_samples import BadSample
from zoo.datamodules.chat import ChatError, Turn, chat_document, plain_layout
from zoo.datamodules.documents import decode_text
from zoo.datamodules.media_samples import Media, MediaSpec, decode_media
from zoo.datamodules.paired_documents import DocumentMaker, MediaSupport
from zoo.datamodules.sequence import AudioSegment, MediaLayout, Segment, SequenceBuilder, VisualSegment
from zoo.hub import from_pretrained, load_lightning_checkpoint, load_tokenizer
from zoo.inference.best_of import best_of_speech, best_of_visual, check_best_of
from zoo.media import MediaSource, kind_of
from zoo.models.decode import text_prompts
from zoo.models.generation import stream_text
from zoo.models.media_generation import generate_audio, generate_visual
from zoo.models.refinement import ImageRefinement, RefinerSettings, decode_visual
from zoo.models.sampling import Sampler
from zoo.models.unified import UnifiedModel
from zoo.task_names import Task
from zoo.tokenizers.text import TextTokenizer
from zoo.tokenizers.vocab import UnifiedVocab

Output = Literal["text", "image", "video", "speech"]
_GENERATES: dict[str, Task] = {
    "image": Task.TEXT_TO_IMAGE, "video": Task.TEXT_TO_VIDEO, "speech": Task.TEXT_TO_AUDIO,
}  # fmt: skip
REPLACEMENT = "\ufffd"  # what a byte-level BPE decodes half a UTF-8 character to


@dataclass(frozen=True)
class Speech:
    """Audio out (and in): a mono float32 wave in [-1, 1] and its rate in Hz."""

    wave: np.ndarray
    sample_rate: int


ImageInput = Image.Image | MediaSource
AudioInput = Speech | tuple[np.ndarray, int] | MediaSource


class Pipeline:
    """A unified model and its text tokenizer, answering in strings, images and speech.

    Args:
        model: the unified model (put in eval mode; it stays on its device).
        tokenizer: the text tokenizer it was trained with.
        image_context: read input images through the vision encoder (as `image_context: true` training does)
            rather than as the visual tokenizer's codes. None: the encoder when the model has no visual
            tokenizer, else the codes.
        media: how input media are decoded (fit policy, clip start, ...; sizes come from the model).
        refinement: the diffusion refiner applied to generated images and video frames after the tokenizer's
            decode (`zoo.models.refinement`); None: the decode as it is.
        video_context: read input videos frame by frame through the vision encoder (as `video_context: true`
            training does) rather than as the causal 3D tokenizer's codes. None: the encoder when the model
            has one and no causal 3D tokenizer, else the codes.
    """

    def __init__(
        self,
        model: UnifiedModel,
        tokenizer: TextTokenizer,
        image_context: bool | None = None,
        media: MediaSpec = MediaSpec(),
        refinement: ImageRefinement | None = None,
        video_context: bool | None = None,
    ) -> None:
        if tokenizer.vocab_size > model.vocab.text_size:
            raise ValueError(
                f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary reserves "
                f"{model.vocab.text_size}: this is not the tokenizer the model was trained with"
            )
        self.model, self.tokenizer = model.eval(), tokenizer
        model.decode_text_with(tokenizer.vocab_size)
        if image_context is None:
            image_context = model.visual_tokenizer is None and model.vision_encoder is not None
        if video_context is None:
            temporal = model.visual_tokenizer is not None and bool(model.visual_tokenizer.temporal)
            video_context = not temporal and model.vision_encoder is not None
        self.layout = MediaLayout.of(model)
        self.spec = media.resolved_for(model)
        seq_len = model.backbone.max_seq_len
        self.maker = DocumentMaker(
            model.vocab, tokenizer, self.layout, seq_len, image_context, support=MediaSupport.of(model),
            video_context=video_context,
        )
        self.builder = SequenceBuilder(model.vocab, seq_len, layout=self.layout)
        if refinement is not None and model.nfsp is not None:
            refinement.check_fits(model.nfsp.tokenizer.image_size)
        self.refinement = refinement

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- answers --------------------------------------------------------------------------------------
    def __call__(
        self,
        text: str | None = None,
        *,
        image: ImageInput | None = None,
        audio: AudioInput | None = None,
        video: MediaSource | None = None,
        output: Output = "text",
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        cfg_scale: float = 2.0,
        max_audio_frames: int = 160,
        seed: int | None = None,
        refine: bool = True,
        best_of: int = 1,
    ) -> str | Image.Image | list[Image.Image] | Speech:
        """Text out: the continuation of `text`, or the caption (transcript) of the one medium given, `text`
        then being the prompt training put before it. `output="image"`, `"video"` or `"speech"`: the medium
        drawn for the caption `text` (classifier-free guidance `cfg_scale` for images and video).
        temperature 0 is greedy; `seed` makes sampling repeatable. `refine=False` skips the pipeline's refiner
        (when it has one) for this call: the tokenizer's decode of the same codes. `best_of` > 1 draws that
        many media and returns the one the model reads back as `text` most likely (zoo.inference.best_of)."""
        check_best_of(best_of=best_of)
        if output == "text":
            pieces = self.stream(
                text, image=image, audio=audio, video=video, max_new_tokens=max_new_tokens,
                temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            )  # fmt: skip
            return "".join(pieces)
        if output not in _GENERATES:
            raise ValueError(f"output must be one of text, image, video, speech; got {output!r}")
        if image is not None or audio is not None or video is not None:
            raise ValueError(f"output={output!r} draws a medium from a caption: give text only, no media")
        if not text or not text.strip():
            raise ValueError(f"output={output!r} needs a caption: text is empty")
        task = _GENERATES[output]
        prompt = self.maker.generation_prompt(task, text)
        generator = self._generator(seed)
        model = self.model
        if output == "speech":
            self.check_fits(len(prompt), max_audio_frames + 2, "audio frames")

            def speech(rows: list[list[int]]) -> list[torch.Tensor]:
                return generate_audio(model, rows, max_audio_frames, temperature, top_k, top_p, generator)

            if best_of > 1:
                return self._speech(best_of_speech(model, self.builder, [prompt], best_of, speech)[0][0])
            return self._speech(speech([prompt])[0])
        frames = self.layout.latent_frames(self.spec.video_frames) if output == "video" else 1
        self.check_fits(len(prompt), 2 + frames * self.layout.tokens_per_frame, "visual codes")

        def visual(rows: list[list[int]]) -> list[torch.Tensor]:
            return generate_visual(model, rows, frames, cfg_scale, temperature, top_k, top_p, generator)

        if best_of > 1:
            def read(pixels: torch.Tensor) -> Segment:  # as understanding reads an image given to it
                return self.maker.media(VisualSegment(pixels), False, "a drawn candidate", context=True)

            guided = 2 if cfg_scale > 0 else 1
            codes = best_of_visual(model, self.builder, [prompt], best_of, visual, read, guided)[0]
        else:
            codes = visual([prompt])
        refinement = self.refinement if refine else None
        pixels = decode_visual(self.model, codes, refinement)[0]  # [3, H, W] or [3, T, H, W]
        if output == "image":
            return to_pil(pixels if pixels.dim() == 3 else pixels[:, 0])  # a 3D tokenizer: one frame
        return [to_pil(frame) for frame in pixels.unbind(1)]

    def stream(
        self,
        text: str | None = None,
        *,
        image: ImageInput | None = None,
        audio: AudioInput | None = None,
        video: MediaSource | None = None,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> Iterator[str]:
        """The text answer (as `__call__` with `output="text"`) in pieces as the tokens come; joined, the
        pieces are the whole answer. A piece never ends in half a character."""
        batch = self.prompt_batch(text, image=image, audio=audio, video=video)
        return self.stream_batch(batch, max_new_tokens, temperature, top_k, top_p, seed)

    def chat(
        self,
        turns: list[Turn],
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> Iterator[str]:
        """The assistant's answer to a conversation (`zoo.datamodules.chat.Turn`s), in pieces as `stream`."""
        batch = self.conversation_batch(turns)
        return self.stream_batch(batch, max_new_tokens, temperature, top_k, top_p, seed)

    def stream_batch(
        self,
        batch: GroupBatch,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> Iterator[str]:
        """The text that follows a one-row prompt batch (`prompt_batch`, `conversation_batch`), in pieces."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.check_fits(batch.seq_len, max_new_tokens, "new tokens")
        sampler = Sampler(temperature, top_k, top_p, self._generator(seed))
        return self._pieces(batch, max_new_tokens, sampler)

    def _pieces(self, batch: GroupBatch, max_new_tokens: int, sampler: Sampler) -> Iterator[str]:
        eos = self.model.vocab.eos_id
        pieces = self.text_pieces()
        for token, _ in stream_text(self.model, batch.to(self.device), max_new_tokens, sampler, (eos,)):
            if int(token[0]) == eos:
                break
            piece = pieces.add(int(token[0]))
            if piece:
                yield piece
        rest = pieces.rest()
        if rest:
            yield rest

    def text_pieces(self) -> TextPieces:
        """An incremental decoder of this model's text ids into pieces that never split a character."""
        return TextPieces(self.tokenizer, self.model.vocab)

    # -- prompts ----------------------------------------------------------------------------------------
    def prompt_batch(
        self,
        text: str | None,
        *,
        image: ImageInput | None = None,
        audio: AudioInput | None = None,
        video: MediaSource | None = None,
    ) -> GroupBatch:
        """The one-row prompt batch of a text answer (`.to(pipe.device)` it): `<bos>` and the text, or the
        document training made for captioning the one medium given, `text` then being its prompt."""
        given = [(k, v) for k, v in (("image", image), ("audio", audio), ("video", video)) if v is not None]
        if len(given) > 1:
            raise ValueError(f"give one medium at a time, got {' and '.join(k for k, _ in given)}")
        if not given:
            if text is None:
                raise ValueError("nothing to answer: give text, or an image, audio or video to caption")
            ids = [self.model.vocab.bos_id, *self.maker.ids(text)] if text else [self.model.vocab.bos_id]
            return text_prompts(self.model, [ids])
        kind, value = given[0]
        return self._media_batch(text, self.read_media(kind, value), f"the {kind} input")

    def conversation_batch(self, turns: list[Turn]) -> GroupBatch:
        """The one-row prompt batch of a conversation: the chat format when the model has role tokens, else
        the plain layout (`zoo.datamodules.chat`). `ChatError` (a ValueError) names the turn at fault."""
        turns = [replace(t, parts=tuple(self._part(p, t.where) for p in t.parts)) for t in turns]
        if self.model.vocab.chat:
            try:
                return self.builder.collate_prompts([chat_document(self.maker, turns)])
            except BadSample as error:  # a medium the model has no tokenizer for
                raise ChatError(str(error)) from None
        text, media = plain_layout(turns)
        if media is None:
            return self.prompt_batch(text)
        return self._media_batch(text, media, "the conversation's medium")

    def _part(self, part: object, where: str) -> str | Media:
        """A turn's part as text or a decoded medium: a str is text; a PIL image, a `Speech`, a (wave, rate)
        pair or a `Path` (its kind by suffix) is read by `read_media`; segments pass as they are."""
        if isinstance(part, str | VisualSegment | AudioSegment):
            return part
        if isinstance(part, Image.Image):
            return self.read_media("image", part, where or None)
        if isinstance(part, Speech | tuple):
            return self.read_media("audio", part, where or None)
        if isinstance(part, Path) and (kind := kind_of(part)) is not None:
            return self.read_media(kind, part, str(part))
        raise TypeError(
            f"{where or 'a turn'}: a part is a str (text), a PIL image, a Speech, (wave, sample_rate), a "
            f"Path of an image, audio or video file, or a decoded segment; got {type(part).__name__}"
        )

    def _media_batch(self, text: str | None, media: Media, where: str) -> GroupBatch:
        try:
            document = self.maker.understanding_prompt(media, text or "", where=where)
        except BadSample as error:  # a medium the model has no tokenizer for: the caller's mistake
            raise ValueError(str(error)) from None
        return self.builder.collate_prompts([document])

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Unified ids of `text`, the names of special tokens in it (`<eos>`, `<|user|>`) read as their ids;
        `add_special_tokens` puts `<bos>` first, as every document of the model begins."""
        vocab = self.model.vocab
        ids = [vocab.bos_id] if add_special_tokens else []
        pattern = "(" + "|".join(re.escape(name) for name in vocab.specials) + ")"
        for i, piece in enumerate(re.split(pattern, text)):
            if i % 2:
                ids.append(vocab.special(piece))
            elif piece:
                ids += self.maker.ids(piece)
        return ids

    def detokenize(self, ids: list[int]) -> str:
        """The text of unified ids, special tokens dropped."""
        return decode_text(self.tokenizer, self.model.vocab, ids)

    def with_bos(self, ids: list[int]) -> list[int]:
        """Unified text ids (`tokenize`'s) checked, `<bos>` put first if missing (every document of the model
        begins with it). ValueError naming an id outside the text head's range."""
        vocab = self.model.vocab
        vocab.check_ids(torch.tensor(ids, dtype=torch.long), range(0, vocab.text_head_size))
        return ids if ids[:1] == [vocab.bos_id] else [vocab.bos_id, *ids]

    def ids_batch(self, ids: list[int]) -> GroupBatch:
        """A prompt of unified text ids as a one-row batch (`with_bos`)."""
        return text_prompts(self.model, [self.with_bos(ids)])

    def read_media(self, kind: str, value: ImageInput | AudioInput, name: str | None = None) -> Media:
        """An input medium as a segment at the model's sizes, through `zoo.media` whatever its form; errors
        call it `name` (default: "the <kind> input")."""
        if kind == "image" and isinstance(value, Image.Image):
            buffer = io.BytesIO()
            value.save(buffer, format="PNG")  # PNG keeps every mode; the loader makes it RGB and upright
            value = buffer.getvalue()
        if kind == "audio" and isinstance(value, Speech):
            value = (value.wave, value.sample_rate)
        if kind == "audio" and isinstance(value, tuple):
            wave, rate = value
            buffer = io.BytesIO()
            sf.write(buffer, np.asarray(wave, dtype=np.float32), int(rate), format="WAV", subtype="FLOAT")
            value = buffer.getvalue()
        if not isinstance(value, str | Path | bytes | bytearray | memoryview):
            raise TypeError(f"{kind} must be a path, bytes{self._forms(kind)}; got {type(value).__name__}")
        return decode_media(kind, value, self.spec, name=name or f"the {kind} input")

    @staticmethod
    def _forms(kind: str) -> str:
        return {"image": " or a PIL image", "audio": ", a Speech or (wave, sample_rate)"}.get(kind, "")

    def check_fits(self, prompt: int, answer: int, what: str) -> None:
        """Refuse (ValueError naming both numbers) a prompt and an answer that exceed the context."""
        limit = self.model.backbone.max_seq_len
        if prompt + answer > limit:
            raise ValueError(
                f"the prompt takes {prompt} positions and the answer up to {answer} {what}: "
                f"{prompt + answer} exceed the model's context of {limit}; shorten the prompt or ask for less"
            )

    def _generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        return torch.Generator(self.device).manual_seed(seed)

    def _speech(self, codes: torch.Tensor) -> Speech:
        codec = self.model.audio_codec
        wave = self.model.ncp.decode(codes[None])[0] if len(codes) else torch.zeros(0)
        return Speech(wave.detach().float().cpu().numpy(), int(codec.sample_rate))


class TextPieces:
    """Text ids decoded as they come: `add` returns the new piece (empty while a character is incomplete),
    `rest` what is left at the end. Joined, the pieces are the decoding of all the ids."""

    def __init__(self, tokenizer: TextTokenizer, vocab: UnifiedVocab) -> None:
        self.tokenizer, self.vocab = tokenizer, vocab
        self.ids: list[int] = []
        self.shown = ""

    def add(self, token: int) -> str:
        self.ids.append(token)
        decoded = decode_text(self.tokenizer, self.vocab, self.ids)
        if decoded.endswith(REPLACEMENT) or not decoded.startswith(self.shown):
            return ""  # half a character so far: wait for its other bytes
        piece, self.shown = decoded[len(self.shown) :], decoded
        return piece

    def rest(self) -> str:
        decoded = decode_text(self.tokenizer, self.vocab, self.ids)
        piece, self.shown = decoded[len(self.shown) :], decoded
        return piece


def to_pil(pixels: torch.Tensor) -> Image.Image:
    """float [3, H, W] in [-1, 1] -> an RGB PIL image."""
    array = ((pixels.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return Image.fromarray(array.permute(1, 2, 0).numpy(), mode="RGB")


def pipeline(
    source: str | Path,
    *,
    device: str | torch.device = "cpu",
    image_context: bool | None = None,
    media: MediaSpec = MediaSpec(),
    revision: str | None = None,
    local_files_only: bool = False,
    refiner: str | RefinerSettings | None = None,
    video_context: bool | None = None,
) -> Pipeline:
    """A `Pipeline` over a Lightning checkpoint of `UnifiedPretraining` (a `.ckpt` file or an FSDP2 folder), a
    folder `zoo export` / `save_pretrained` wrote, or a Hugging Face Hub repo id. Loading executes nothing:
    weights-only checkpoints and safetensors, allow-listed classes (`zoo.hub`). refiner: a diffusion refiner's
    folder or Hub id (or its `RefinerSettings`: steps, seed) that refines generated images."""
    path = Path(source)
    if path.is_file() or (path / "meta.pt").is_file():
        model, tokenizer = load_lightning_checkpoint(path)
        model.to(device)
    else:
        model = from_pretrained(source, revision, device=device, local_files_only=local_files_only)
        tokenizer = load_tokenizer(source, revision, local_files_only=local_files_only)
    if tokenizer is None:
        raise ValueError(
            f"{source} holds no text tokenizer (tokenizer.json, or one stored in the checkpoint): the "
            "pipeline needs the tokenizer the model was trained with"
        )
    settings = RefinerSettings(refiner) if isinstance(refiner, str) else refiner
    refinement = None if settings is None else settings.load(device)
    return Pipeline(model, tokenizer, image_context, media, refinement, video_context)
