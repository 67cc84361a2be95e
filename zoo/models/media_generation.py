"""Generation of images, video and audio, and of text about media: loops over `zoo.models.decode`'s steps.

Generation goes group by group, as training laid the sequence out (DESIGN.md, "backbone"):
- NFSP (`draw_visual`): one backbone step per scale of a frame; all s*s positions of the scale are
  sampled in parallel from the head (top-k / top-p), optionally with classifier-free guidance
  `logits = l_uncond + g * (l_cond - l_uncond)` against the caption-less prompt `<bos><boi>`.
  `raster=True` instead runs one position per step (the token-by-token baseline of `benchmarks/nfsp.py`).
- NCP (`speak`): one backbone step per codec frame; the depth head samples the frame's levels in order
  and stops a row when level 1 samples END; optionally guided as NFSP is, against `<bos><boa>` (each level
  drawn from the guided mix of both rows' depth logits, and the frame drawn fed to both).
- Text about media (`generate_text_after`): the prompt batch (media groups included) is prefilled once,
  then text continues one token per step (`zoo.models.generation.stream_text`).

`generate_visual` and `generate_audio` are the loops with plain sampling arguments; the RL engine and RL
validation call `draw_visual` and `speak` with their `Sampler` and, for rollouts, a `Recording`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from zoo.batch import GroupBatch, Modality
from zoo.models.decode import (
    Recording,
    audio_frame_step,
    prefill,
    text_prompts,
    visual_scale_step,
)
from zoo.models.generation import collect, stream_text
from zoo.models.sampling import Sampler, guided_logits

if TYPE_CHECKING:
    from zoo.models.decodable import DecodingModel


def _check_prompt_ends(model: DecodingModel, prompts: list[list[int]], allowed: tuple[str, ...]) -> None:
    if not prompts:
        raise ValueError("no prompts given")
    ends = {model.vocab.special(name) for name in allowed}
    for i, prompt in enumerate(prompts):
        if not prompt or prompt[-1] not in ends:
            opener = " or ".join(allowed)
            raise ValueError(f"prompt {i} must end with {opener} (the token that opens the media)")
        model.vocab.check_ids(torch.tensor(prompt), range(0, model.vocab.text_head_size))


@torch.no_grad()
def draw_visual(
    model: DecodingModel,
    prompts: list[list[int]],
    frames: int,
    sampler: Sampler,
    guidance: float = 0.0,
    raster: bool = False,
    recording: Recording | None = None,
) -> list[Tensor]:
    """Codes per scale `[B, frames, s, s]` for prompts (unified ids) ending with `<boi>` (or `<bov>`).

    frames: latent frames (1 for an image). guidance: the weight g (0 disables guidance). recording: the
    log-prob of every code (conditional rows) and the routing of every position fed (all rows).
    """
    nfsp = model.nfsp
    if nfsp is None:
        raise ValueError("this model has no visual tokenizer: it cannot generate images")
    if frames < 1 or (frames > 1 and not nfsp.tokenizer.temporal):
        raise ValueError(f"frames must be 1 for a 2D tokenizer (>= 1 with a 3D one), got {frames}")
    if guidance < 0:
        raise ValueError(f"cfg_scale must be >= 0, got {guidance}")
    _check_prompt_ends(model, prompts, ("<boi>", "<bov>"))
    b = len(prompts)
    rows = list(prompts)
    if guidance > 0:
        rows += [[model.vocab.bos_id, p[-1]] for p in prompts]
    _, cursor, cache = prefill(model, text_prompts(model, rows), frames * nfsp.tokens_per_frame, recording)
    t0, group = cursor.t, cursor.group
    codes = [torch.zeros(len(rows), frames, s, s, dtype=torch.long, device=t0.device) for s in nfsp.scales]
    video = frames > 1 or prompts[0][-1] == model.vocab.special("<bov>")
    modality = Modality.VIDEO if video else Modality.IMAGE
    for f in range(frames):
        for k, side in enumerate(nfsp.scales):
            hidden = visual_scale_step(model, cache, codes, f, k, t0, group, modality, raster, recording)
            group = group + (side * side if raster else 1)
            logits = guided_logits(nfsp.logits(hidden).float(), guidance, b).flatten(0, 1)
            token = sampler.sample(logits)
            if recording is not None:
                recording.sampled(range(b), sampler.logprob(logits, token).view(b, -1))
            token = token.view(-1, side, side)
            codes[k][:, f] = token.repeat(len(rows) // token.shape[0], 1, 1)
    return [c[:b] for c in codes]


@torch.no_grad()
def generate_visual(
    model: DecodingModel,
    prompts: list[list[int]],
    frames: int = 1,
    cfg_scale: float = 0.0,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    raster: bool = False,
) -> list[Tensor]:
    """Codes per scale `[B, frames, s, s]` for prompts (unified ids) ending with `<boi>` (or `<bov>`).

    frames: latent frames (1 for an image). cfg_scale: guidance weight g (0 disables guidance).
    """
    sampler = Sampler(temperature, top_k, top_p, generator)
    return draw_visual(model, prompts, frames, sampler, cfg_scale, raster)


@torch.no_grad()
def speak(
    model: DecodingModel,
    prompts: list[list[int]],
    max_frames: list[int],
    sampler: Sampler,
    recording: Recording | None = None,
    feed_last: bool = False,
    guidance: float = 0.0,
) -> tuple[list[Tensor], list[bool]]:
    """NCP: codec codes `[F_i, Q]` per prompt (unified ids ending with `<boa>`) and whether level 1 sampled
    END, which stops row i (else `max_frames[i]` frames do).

    Per step the depth head samples every row's frame from its last state (`NCP.sample_frame`), then the
    frames are fed, one group each. feed_last: feed each row's last frame too, so that every frame has a
    position (RL records its routing). recording: per row the log-probs of its decisions, Q a frame, then
    END's; the routing of the positions fed for it. guidance: classifier-free guidance weight g against the
    caption-less prompt `<bos><boa>` (0: off; for a model trained with caption-less speech documents, such
    as ShapesWorld's `audio_uncond_prob` makes).
    """
    ncp = model.ncp
    if ncp is None:
        raise ValueError("this model has no audio codec: it cannot generate audio")
    if len(max_frames) != len(prompts) or min(max_frames, default=0) < 1:
        raise ValueError(f"max_frames must be >= 1, got {max_frames}")
    if guidance < 0:
        raise ValueError(f"cfg_scale must be >= 0, got {guidance}")
    _check_prompt_ends(model, prompts, ("<boa>",))
    b = len(prompts)
    rows = list(prompts)
    if guidance > 0:  # the unconditional rows follow the conditional ones and are fed the same frames
        rows += [[model.vocab.bos_id, p[-1]] for p in prompts]
    out, cursor, cache = prefill(model, text_prompts(model, rows), max(max_frames), recording)
    hidden = out.hidden[:, -1]
    frames: list[list[Tensor]] = [[] for _ in range(b)]
    ended, live = [False] * b, [True] * b
    for _ in range(max(max_frames)):
        codes, end, logprobs = ncp.sample_frame(hidden, sampler, guidance)
        stopped = [i for i, e in enumerate(end.tolist()) if e and live[i]]
        spoken = [i for i in range(b) if live[i] and i not in stopped]
        for i in stopped:  # END sampled: nothing more to feed for this row
            ended[i], live[i] = True, False
        for i in spoken:
            frames[i].append(codes[i])
        if recording is not None:
            recording.sampled(stopped, logprobs[stopped, :1])
            recording.sampled(spoken, logprobs[spoken])
        fed = [i for i in spoken if feed_last or len(frames[i]) < max_frames[i]]
        if not fed:
            break
        out = audio_frame_step(model, cache, codes.repeat(len(rows) // b, 1), cursor, recording, fed)
        for i in spoken:
            live[i] = len(frames[i]) < max_frames[i]
        hidden, cursor = out.hidden[:, -1], cursor.advance()
    q, device = ncp.levels, cursor.t.device
    codes = [torch.stack(f) if f else torch.zeros(0, q, dtype=torch.long, device=device) for f in frames]
    return codes, ended


@torch.no_grad()
def generate_audio(
    model: DecodingModel,
    prompts: list[list[int]],
    max_frames: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    cfg_scale: float = 0.0,
) -> list[Tensor]:
    """Codec codes `[F_i, Q]` per prompt (unified ids ending with `<boa>`), stopping at END or max_frames.
    cfg_scale: classifier-free guidance weight (0: off; see `speak`)."""
    if max_frames < 1:
        raise ValueError(f"max_frames must be >= 1, got {max_frames}")
    sampler = Sampler(temperature, top_k, top_p, generator)
    return speak(model, prompts, [max_frames] * len(prompts), sampler, guidance=cfg_scale)[0]


@torch.no_grad()
def generate_text_after(
    model: DecodingModel,
    prompt: GroupBatch,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_ids: tuple[int, ...] | None = None,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Continue a left-padded prompt batch (any groups, e.g. `SequenceBuilder.collate_prompts`) with text;
    a row stops after a stop id (kept; default, and for an empty tuple, `<eos>`)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    b, length = prompt.input_ids.shape
    if length + max_new_tokens > model.backbone.max_seq_len:
        raise ValueError(f"prompt ({length}) + max_new_tokens ({max_new_tokens}) exceed max_seq_len")
    sampler = Sampler(temperature, top_k, top_p, generator)
    stream = stream_text(model, prompt, max_new_tokens, sampler, stop_ids or (model.vocab.eos_id,))
    return collect(stream, b)
