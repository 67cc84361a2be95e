"""Response kinds: what the policy writes after a prompt (text, an image, a video, speech) and everything RL
does that depends on it, one class a kind (issue 15: dispatch on types, not on flags).

`response_kind(model, prompt)` reads the kind from the prompt's last id: `<boi>` to a model with a visual
tokenizer asks for an image, `<bov>` to one whose visual tokenizer is the causal 3D one for a video, `<boa>`
to one with an audio codec for speech; anything else, and any prompt with media (it is captioned), asks for
text. Each kind owns, for its responses:

- `budget`: how much a rollout may generate (text: tokens; an image or a video: all its codes or none;
  speech: frames), given the token budget and the `MediaLengths`;
- `positions`: the positions the response takes in the sequence (one a token; one a frame for speech);
- `generate` (media, `whole = True`): the whole response at admission, by the `zoo.models.media_generation`
  loops with a `Recording` of log-probs and routing; text instead continues in the engine's running batch;
- `layout`: the trainer's document of prompt + response, as pretraining laid it out: an image is the
  `VisualSegment` of its codes (one group a scale on the finest grid; a video's latent frames in order,
  each its scales, t advancing a frame), speech the `AudioSegment` of its frames; the closing `<eoi>` /
  `<eov>` / `<eoa>` the layout writes is no decision of the policy and is masked out;
- `logprobs`: the trainer's log-probs of its decisions under `zoo.models.sampling.log_probs`, as the engine
  scored them: text from `UnifiedModel.sampling_logits` at the position before each token, image and video
  codes from the NFSP head where each code sits, speech from the NCP depth head per level of each frame,
  then END;
- `verifier_input`: what a verifier reads (the completion text, decoded pixels or frames, a decoded
  waveform);
- `reading_segment` (media): the response as understanding reads it, the input of a reading reward
  (`zoo.rl.reading_reward`): decoded pixels as the data reads images, speech as its codec codes;
- `respond`: what validation generates with the trained model (not the engine) for such prompts.

An image response is its NFSP codes as unified visual ids, coarse scale to fine; a video response is the
codes of its latent frames one frame after the other (`MediaLengths.video_frames` frames decode from
`1 + (video_frames - 1) / temporal_stride` latent frames), drawn as `zoo.inference.pipeline` draws a video;
a speech response is its frames, each frame's Q codes as unified audio ids (level q in its own block), then
`<eoa>` when level 1 sampled END (Q decisions a frame, one for END). A new kind is one more class in
`RESPONSE_KINDS`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from zoo.batch import PAD_DOC, GroupBatch, Modality
from zoo.datamodules.sequence import AudioSegment, Document, Segment, TextSegment, VisualSegment
from zoo.models.decode import Recording
from zoo.models.generation import generate_text
from zoo.models.media_generation import draw_visual, generate_text_after, speak
from zoo.models.nfsp import flatten_scales, unflatten_scales
from zoo.models.sampling import Sampler, chosen, entropy, log_probs
from zoo.rl.prompts import PromptLayout, Row, is_document, text_rows

if TYPE_CHECKING:
    from zoo.models.unified import UnifiedModel
    from zoo.rl.records import Rollout

# Per rollout scored: (log-probs of its decisions, their entropies or None).
Scored = tuple[Tensor, Tensor | None]


@dataclass(frozen=True)
class MediaLengths:
    """How long generated media are.

    Args:
        audio_frames: most codec frames of a speech response (it ends sooner when level 1 samples END).
        video_frames: frames of a video response, `1 + temporal_stride * k` (all of them are drawn: the
            clips the verifiers read have a fixed length, as the data's `video_frames`).
    """

    audio_frames: int = 128
    video_frames: int = 5

    def __post_init__(self) -> None:
        if self.audio_frames < 1 or self.video_frames < 1:
            raise ValueError(f"audio_frames and video_frames must be >= 1, got {self}")

    @classmethod
    def of(cls, model: UnifiedModel, audio_frames: int, video_frames: int | None) -> MediaLengths:
        """`model`'s lengths: `video_frames` checked against its causal 3D tokenizer's stride (None:
        `1 + temporal_stride`, two latent frames); a model that draws no video ignores it."""
        tokenizer = model.visual_tokenizer
        if tokenizer is None or not tokenizer.temporal:
            return cls(audio_frames, video_frames or 1)
        frames = video_frames or 1 + tokenizer.temporal_stride
        tokenizer.latent_frames(frames)  # refuses a length that does not fit the stride, naming both
        return cls(audio_frames, frames)


@dataclass
class Generated:
    """Responses a media kind generated whole: their unified ids, whether each ended by itself (else its
    budget cut it), and the decode steps it took (steps, and rows fed over them)."""

    responses: list[list[int]]
    finished: list[bool]
    steps: int
    row_steps: int


class ResponseKind:
    """The interface of a response kind (see the module docstring); `TextResponse` is the default one."""

    name: ClassVar[str]
    modality: ClassVar[Modality]
    whole: ClassVar[bool] = False  # generated whole at admission (never waits in the engine's batch)

    def asked_by(self, model: UnifiedModel, prompt_ids: list[int]) -> bool:
        raise NotImplementedError

    def budget(self, model: UnifiedModel, tokens: int, lengths: MediaLengths, room: int) -> int:
        """What a rollout may generate given a token budget, the media lengths and `room` positions left."""
        raise NotImplementedError

    def positions(self, model: UnifiedModel, response_ids: list[int]) -> int:
        return len(response_ids)

    def generate(
        self,
        model: UnifiedModel,
        prompts: list[list[int]],
        budgets: list[int],
        sampler: Sampler,
        recording: Recording,
    ) -> Generated:
        raise NotImplementedError(f"{self.name} responses continue in the engine's batch")

    def layout(
        self, model: UnifiedModel, document: Document | None, prompt_ids: list[int], response_ids: list[int]
    ) -> tuple[Document, bool]:
        """The trainer's document of prompt + response, and whether the position after the response is a
        closing token of the layout (no decision of the policy: it is masked out)."""
        raise NotImplementedError

    def logprobs(
        self, model: UnifiedModel, hidden: Tensor, rows: list[tuple[int, Rollout]], temperature: float,
        with_entropy: bool,
    ) -> list[Scored]:  # fmt: skip
        """The trainer's log-probs (and entropies) of the rollouts' decisions; `hidden` `[B, L, D]` of the
        right-padded trainer batch, `rows`: (row of `hidden`, rollout) of this kind."""
        raise NotImplementedError

    def verifier_input(self, model: UnifiedModel, rollout: Rollout, source: object) -> object:
        raise NotImplementedError

    def reading_segment(self, model: UnifiedModel, rollout: Rollout, source: object) -> Segment | None:
        """The response as an input segment of an understanding document (None: nothing to read)."""
        raise ValueError(
            f"a {self.name} response has no reading: a reading reward scores drawn media (images, videos, "
            "speech) by how the model reads them back as their caption; text needs a verifier"
        )

    def loss_modalities(self, by_id: list[int]) -> list[int]:
        """The `Modality` of each decision for the loss (per-modality IcePop bounds), given the one its id
        says (`QueryDataModule.token_modality`: specials count as text)."""
        return by_id

    def respond(
        self, model: UnifiedModel, prompts: list, decode: Callable[[list[int]], str], max_new_tokens: int,
        sampler: Sampler, lengths: MediaLengths,
    ) -> list[object]:  # fmt: skip
        """What verifiers read of `model`'s responses to `prompts` (validation)."""
        raise NotImplementedError


def _head_logprobs(
    logits_of: Callable[[Tensor], Tensor],
    hidden: Tensor,
    rows: list[tuple[int, list[int], int]],
    temperature: float,
    with_entropy: bool,
) -> list[Scored]:
    """Scores of decisions one a position: rows of (row of `hidden`, targets, first predicting position).
    Right padding keeps each row's predictors contiguous, so a row-major selection is row after row."""
    picked = torch.zeros(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
    targets: list[int] = []
    for row, ids, start in rows:
        picked[row, start : start + len(ids)] = True
        targets += ids
    logp = log_probs(logits_of(hidden[picked]), temperature)
    scores = chosen(logp, torch.tensor(targets, dtype=torch.long, device=hidden.device))
    sizes = [len(ids) for _, ids, _ in rows]
    entropies = entropy(logp).split(sizes) if with_entropy else [None] * len(rows)
    return list(zip(scores.split(sizes), entropies, strict=True))


class TextResponse(ResponseKind):
    """Text: any prompt that asks for no media. Tokens are sampled and scored from `sampling_logits`."""

    name, modality = "text", Modality.TEXT

    def asked_by(self, model: UnifiedModel, prompt_ids: list[int]) -> bool:
        return True

    def budget(self, model: UnifiedModel, tokens: int, lengths: MediaLengths, room: int) -> int:
        return min(tokens, room)

    def layout(
        self, model: UnifiedModel, document: Document | None, prompt_ids: list[int], response_ids: list[int]
    ) -> tuple[Document, bool]:
        if document is None:
            return [TextSegment(prompt_ids + response_ids, predict=False)], False
        tail = [TextSegment(list(response_ids), predict=False)] if response_ids else []
        return [*document, *tail], False

    def logprobs(
        self, model: UnifiedModel, hidden: Tensor, rows: list[tuple[int, Rollout]], temperature: float,
        with_entropy: bool,
    ) -> list[Scored]:  # fmt: skip
        # Position P-1+t predicts response token t.
        spans = [(row, r.response_ids, len(r.prompt_ids) - 1) for row, r in rows]
        return _head_logprobs(model.sampling_logits, hidden, spans, temperature, with_entropy)

    def verifier_input(self, model: UnifiedModel, rollout: Rollout, source: object) -> object:
        return source.completion_text(rollout.prompt_ids, rollout.response_ids, rollout.hint_len)

    def respond(
        self, model: UnifiedModel, prompts: list, decode: Callable[[list[int]], str], max_new_tokens: int,
        sampler: Sampler, lengths: MediaLengths,
    ) -> list[object]:  # fmt: skip
        if any(is_document(p) for p in prompts):
            documents = [p if is_document(p) else [TextSegment(p, predict=False)] for p in prompts]
            batch = PromptLayout(model).builder.collate_prompts(documents).to(next(model.parameters()).device)
            responses = generate_text_after(
                model, batch, max_new_tokens, sampler.temperature, sampler.top_k, sampler.top_p,
                generator=sampler.generator,
            )  # fmt: skip
        else:
            responses = generate_text(
                model, prompts, max_new_tokens, sampler.temperature, sampler.top_k, sampler.top_p,
                generator=sampler.generator,
            )  # fmt: skip
        return [decode(ids) for ids in responses]


class ImageResponse(ResponseKind):
    """An image (NFSP), asked for by a prompt ending with `<boi>`: whole or nothing, whatever the budget."""

    name, modality, whole = "image", Modality.IMAGE, True
    opener: ClassVar[str] = "<boi>"

    def asked_by(self, model: UnifiedModel, prompt_ids: list[int]) -> bool:
        opens = bool(prompt_ids) and prompt_ids[-1] == model.vocab.special(self.opener)
        return model.nfsp is not None and opens

    def latent_frames(self, model: UnifiedModel, lengths: MediaLengths) -> int:
        return 1

    def budget(self, model: UnifiedModel, tokens: int, lengths: MediaLengths, room: int) -> int:
        codes = self.latent_frames(model, lengths) * model.nfsp.tokens_per_frame
        return codes if room >= codes else 0

    def generate(
        self,
        model: UnifiedModel,
        prompts: list[list[int]],
        budgets: list[int],
        sampler: Sampler,
        recording: Recording,
    ) -> Generated:
        # A row's budget is the whole medium, the same for every row (rows without room never get here).
        if len(set(budgets)) != 1:
            raise ValueError(f"{self.name} responses are drawn whole: expected one budget, got {budgets}")
        frames = budgets[0] // model.nfsp.tokens_per_frame
        codes = draw_visual(model, prompts, frames, sampler, recording=recording)
        responses = model.vocab.visual_ids(flatten_scales(codes)).tolist()
        steps = frames * len(model.nfsp.scales)
        return Generated(responses, [True] * len(prompts), steps, steps * len(prompts))

    def codes(self, model: UnifiedModel, response_ids: list[int]) -> list[Tensor]:
        """A response -> the tokenizer's codes per scale `[1, latent frames, s, s]`."""
        flat = model.vocab.visual_codes(response_ids)
        return unflatten_scales(flat[None], model.nfsp.scales, len(flat) // model.nfsp.tokens_per_frame)

    def layout(
        self, model: UnifiedModel, document: Document | None, prompt_ids: list[int], response_ids: list[int]
    ) -> tuple[Document, bool]:
        if not response_ids:  # the prompt left no room: nothing was drawn
            return TEXT.layout(model, document, prompt_ids, response_ids)
        # The VisualSegment writes the prompt's closing <boi> / <bov> itself.
        video = self.modality == Modality.VIDEO
        visual = VisualSegment(codes=model.vocab.visual_codes(response_ids), video=video)
        return [TextSegment(prompt_ids[:-1], predict=False), visual], True

    def logprobs(
        self, model: UnifiedModel, hidden: Tensor, rows: list[tuple[int, Rollout]], temperature: float,
        with_entropy: bool,
    ) -> list[Scored]:  # fmt: skip
        # Code t sits at, and is predicted at, position P+t (from the coarser scales, the earlier frames and
        # the prompt).
        codes = [model.vocab.visual_codes(r.response_ids).tolist() for _, r in rows]
        spans = [(row, ids, len(r.prompt_ids)) for (row, r), ids in zip(rows, codes, strict=True)]
        return _head_logprobs(model.nfsp.logits, hidden, spans, temperature, with_entropy)

    @torch.no_grad()
    def verifier_input(self, model: UnifiedModel, rollout: Rollout, source: object) -> object:
        """The pixels (float `[3, H, W]` numpy in [-1, 1]); no codes (no room) decode to a blank canvas."""
        if not rollout.response_ids:
            size = model.visual_tokenizer.image_size
            return torch.full((3, size, size), -1.0).numpy()
        return self.pixels(model, [self.codes(model, rollout.response_ids)])[0]

    def reading_segment(self, model: UnifiedModel, rollout: Rollout, source: object) -> Segment | None:
        """The decoded pixels as the data reads an image (or video) for understanding (`source.read`:
        through the vision encoder or as codes); nothing drawn, nothing to read."""
        if not rollout.response_ids:
            return None
        return source.read(torch.from_numpy(self.verifier_input(model, rollout, source)))

    def pixels(self, model: UnifiedModel, codes: list[list[Tensor]]) -> list[object]:
        """Decoded responses (each its codes per scale) as float numpy in [-1, 1], `[3, H, W]` an image."""
        device = next(model.parameters()).device
        joined = [torch.cat(scale).to(device) for scale in zip(*codes, strict=True)]
        return list(model.nfsp.decode(joined).float().cpu().numpy())

    def respond(
        self, model: UnifiedModel, prompts: list, decode: Callable[[list[int]], str], max_new_tokens: int,
        sampler: Sampler, lengths: MediaLengths,
    ) -> list[object]:  # fmt: skip
        codes = draw_visual(model, prompts, self.latent_frames(model, lengths), sampler)
        return self.pixels(model, [codes])


class VideoResponse(ImageResponse):
    """A video (NFSP over latent frames, frame after frame, each its scales coarse to fine), asked for by a
    prompt ending with `<bov>` to a model whose visual tokenizer is the causal 3D one: `lengths.video_frames`
    frames, whole or nothing."""

    name, modality = "video", Modality.VIDEO
    opener = "<bov>"

    def asked_by(self, model: UnifiedModel, prompt_ids: list[int]) -> bool:
        return super().asked_by(model, prompt_ids) and bool(model.nfsp.tokenizer.temporal)

    def latent_frames(self, model: UnifiedModel, lengths: MediaLengths) -> int:
        return model.nfsp.tokenizer.latent_frames(lengths.video_frames)

    def loss_modalities(self, by_id: list[int]) -> list[int]:
        # Images and videos share the visual ids: a video's codes are VIDEO decisions all the same.
        image, video = int(Modality.IMAGE), int(Modality.VIDEO)
        return [video if m == image else m for m in by_id]

    @torch.no_grad()
    def verifier_input(self, model: UnifiedModel, rollout: Rollout, source: object) -> object:
        """The frames (float `[3, T, H, W]` numpy in [-1, 1]); no codes (no room): one blank frame."""
        if not rollout.response_ids:
            size = model.visual_tokenizer.image_size
            return torch.full((3, 1, size, size), -1.0).numpy()
        return self.pixels(model, [self.codes(model, rollout.response_ids)])[0]

    def pixels(self, model: UnifiedModel, codes: list[list[Tensor]]) -> list[object]:
        # One latent frame decodes to one frame, which NFSP.decode gives as an image: a video all the same.
        return [x if x.ndim == 4 else x[:, None] for x in super().pixels(model, codes)]


class SpeechResponse(ResponseKind):
    """Speech (NCP), asked for by a prompt ending with `<boa>`: codec frames until END or the frame budget."""

    name, modality, whole = "speech", Modality.AUDIO, True

    def asked_by(self, model: UnifiedModel, prompt_ids: list[int]) -> bool:
        return model.ncp is not None and bool(prompt_ids) and prompt_ids[-1] == model.vocab.special("<boa>")

    def budget(self, model: UnifiedModel, tokens: int, lengths: MediaLengths, room: int) -> int:
        return min(lengths.audio_frames, room)

    def ended(self, model: UnifiedModel, response_ids: list[int]) -> bool:
        return bool(response_ids) and response_ids[-1] == model.vocab.special("<eoa>")

    def frames(self, model: UnifiedModel, response_ids: list[int]) -> Tensor:
        """A speech response -> its codec codes `[F, Q]` (END, if any, left out)."""
        return model.vocab.audio_codes(response_ids[: len(response_ids) - self.ended(model, response_ids)])

    def positions(self, model: UnifiedModel, response_ids: list[int]) -> int:
        return (len(response_ids) - self.ended(model, response_ids)) // model.ncp.levels

    def generate(
        self,
        model: UnifiedModel,
        prompts: list[list[int]],
        budgets: list[int],
        sampler: Sampler,
        recording: Recording,
    ) -> Generated:
        # Every sampled frame is fed (its routing recorded), so a response cut by its budget has a position
        # per frame too.
        frames, ended = speak(model, prompts, budgets, sampler, recording, feed_last=True)
        eoa = model.vocab.special("<eoa>")
        said = list(zip(frames, ended, strict=True))
        responses = [model.vocab.audio_ids(f).flatten().tolist() + [eoa] * e for f, e in said]
        steps = max(len(f) + e for f, e in said)
        return Generated(responses, ended, steps, sum(len(f) for f in frames))

    def layout(
        self, model: UnifiedModel, document: Document | None, prompt_ids: list[int], response_ids: list[int]
    ) -> tuple[Document, bool]:
        if not response_ids:
            return TEXT.layout(model, document, prompt_ids, response_ids)
        frames = self.frames(model, response_ids)
        # The AudioSegment writes the prompt's closing <boa> itself; END at once leaves the prompt as it is.
        speech = [AudioSegment(codes=frames)] if len(frames) else []
        return [TextSegment(prompt_ids[: len(prompt_ids) - bool(speech)], predict=False), *speech], True

    def logprobs(
        self, model: UnifiedModel, hidden: Tensor, rows: list[tuple[int, Rollout]], temperature: float,
        with_entropy: bool,
    ) -> list[Scored]:  # fmt: skip
        """Frame f is decided at position P - 1 + f (`<boa>` for f = 0), level by level; END at the last
        frame's position."""
        ncp = model.ncp
        states, codes, counts = [], [], []
        for row, r in rows:
            frames = self.frames(model, r.response_ids).to(hidden.device)
            ended = self.ended(model, r.response_ids)
            if ended:
                end = torch.zeros(1, ncp.levels, dtype=torch.long, device=hidden.device)
                end[0, 0] = ncp.end_id
                frames = torch.cat([frames, end])
            start = len(r.prompt_ids) - 1
            states.append(hidden[row, start : start + len(frames)])
            codes.append(frames)
            counts.append((len(frames) - ended, ended))
        logp, entropies = ncp.logprobs(torch.cat(states), torch.cat(codes), temperature)
        scored: list[Scored] = []
        at = 0
        for frames, ended in counts:
            span = slice(at, at + frames)
            decisions = torch.cat([logp[span].flatten(), logp[at + frames :][:ended, 0]])
            spread = torch.cat([entropies[span].flatten(), entropies[at + frames :][:ended, 0]])
            scored.append((decisions, spread if with_entropy else None))
            at += frames + ended
        return scored

    @torch.no_grad()
    def verifier_input(self, model: UnifiedModel, rollout: Rollout, source: object) -> object:
        """The waveform (float numpy) the codec decodes from the frames; no frames decode to an empty one."""
        frames = self.frames(model, rollout.response_ids)
        if not len(frames):
            return torch.zeros(0).numpy()
        return model.ncp.decode(frames[None].to(next(model.parameters()).device))[0].float().cpu().numpy()

    def reading_segment(self, model: UnifiedModel, rollout: Rollout, source: object) -> Segment | None:
        """The frames as their codec codes (understanding reads speech so); END at once: nothing to read."""
        frames = self.frames(model, rollout.response_ids)
        return AudioSegment(codes=frames, predict=False) if len(frames) else None

    def respond(
        self, model: UnifiedModel, prompts: list, decode: Callable[[list[int]], str], max_new_tokens: int,
        sampler: Sampler, lengths: MediaLengths,
    ) -> list[object]:  # fmt: skip
        frames, _ = speak(model, prompts, [lengths.audio_frames] * len(prompts), sampler)
        waves = [model.ncp.decode(f[None]) if len(f) else torch.zeros(1, 0) for f in frames]
        return [wave[0].float().cpu().numpy() for wave in waves]


TEXT = TextResponse()
# The media kinds, in the order the engine generates them at admission (before text continues).
RESPONSE_KINDS: tuple[ResponseKind, ...] = (ImageResponse(), VideoResponse(), SpeechResponse())


def response_kind(model: UnifiedModel, prompt: Sequence) -> ResponseKind:
    """The kind of response a prompt (unified ids, or laid-out ids of a prompt with media) asks of `model`."""
    if is_document(prompt):
        return TEXT
    return next((kind for kind in RESPONSE_KINDS if kind.asked_by(model, list(prompt))), TEXT)


def rollout_batch(layout: PromptLayout, rows: Sequence[Row], left: bool) -> GroupBatch:
    """Prompt + response of every row as its kind lays them out, one document a row, on the model's device:
    left-padded (`left`) for a prefill that continues every row (text responses), else right-padded for
    the trainer."""
    model = layout.model
    device = next(model.parameters()).device
    kinds = [response_kind(model, prompt) for _, prompt, _ in rows]
    media = [kind is not TEXT and bool(response) for kind, (_, _, response) in zip(kinds, rows, strict=True)]
    if all(document is None for document, _, _ in rows) and not any(media):
        seqs = [prompt + response for _, prompt, response in rows]
        return text_rows(seqs, model.vocab.pad_id, left, device)
    if left and any(media):
        raise ValueError("media responses are laid out for the trainer only (right padding)")
    laid = [kind.layout(model, *row) for kind, row in zip(kinds, rows, strict=True)]
    length = max(layout.builder.length(document) for document, _ in laid)
    batch = layout.builder.layout_rows([[document] for document, _ in laid], length, left_pad=left)
    for row, (kind, (_, prompt, response), (_, closing)) in enumerate(zip(kinds, rows, laid, strict=True)):
        end = len(prompt) + kind.positions(model, response)
        if closing and end < length and batch.doc_id[row, end] != PAD_DOC:
            # The closing <eoi> / <eoa> is no decision of the policy: out of the sequence.
            batch.doc_id[row, end] = PAD_DOC
            batch.modality[row, end] = int(Modality.PAD)
    return batch.to(device)
