"""Generation of images, video and audio, and of text about media, with the KV cache (DESIGN.md, "backbone").

Generation goes group by group, as training laid the sequence out:
- NFSP: one backbone step per scale of a frame; all s*s positions of the scale are sampled in parallel
  from the head (top-k / top-p), optionally with classifier-free guidance
  `logits = l_uncond + g * (l_cond - l_uncond)` against the caption-less prompt `<bos><boi>`.
  `raster=True` instead runs one position per step (the token-by-token baseline of `benchmarks/nfsp.py`).
- NCP: one backbone step per codec frame; the depth head samples the frame's levels in order and stops
  a row when level 1 samples END.
- Text about media: the prompt batch (media groups included) is prefilled once, then text continues
  one token per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from zoo.batch import GroupBatch, Modality
from zoo.models.generation import left_pad, text_batch
from zoo.models.sampling import sample

if TYPE_CHECKING:
    from zoo.models.unified import UnifiedModel


def _device(model: UnifiedModel) -> torch.device:
    return next(model.parameters()).device


def _step_batch(modality: Modality, t: Tensor, h: Tensor, w: Tensor, group: Tensor) -> GroupBatch:
    """A decode step of `[R, n]` new positions of one document per row."""
    return GroupBatch(
        input_ids=torch.zeros_like(t),
        modality=torch.full_like(t, int(modality)),
        group_id=group,
        doc_id=torch.zeros_like(t),
        positions=torch.stack([t, h, w]),
    )


def _prefill(model: UnifiedModel, prompts: list[list[int]], extra: int) -> tuple[Tensor, Tensor, object]:
    """Run text prompts through the backbone into a new cache; (last hidden [R, D], next index [R], cache)."""
    device = _device(model)
    ids, doc, index = left_pad(prompts, model.vocab.pad_id, device)
    longest = ids.shape[1] + extra
    if longest > model.backbone.max_seq_len:
        raise ValueError(f"prompt ({ids.shape[1]}) + generated positions ({extra}) exceed max_seq_len")
    cache = model.backbone.new_cache(len(prompts), longest)
    batch = text_batch(ids, doc, index)
    hidden = model.forward_hidden(batch, cache=cache).hidden
    return hidden[:, -1], index[:, -1] + 1, cache


def _check_prompt_ends(model: UnifiedModel, prompts: list[list[int]], allowed: tuple[str, ...]) -> None:
    if not prompts:
        raise ValueError("no prompts given")
    ends = {model.vocab.special(name) for name in allowed}
    for i, prompt in enumerate(prompts):
        if not prompt or prompt[-1] not in ends:
            opener = " or ".join(allowed)
            raise ValueError(f"prompt {i} must end with {opener} (the token that opens the media)")
        model.vocab.check_ids(torch.tensor(prompt), range(0, model.vocab.text_head_size))


@torch.no_grad()
def generate_visual(
    model: UnifiedModel,
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
    nfsp = model.nfsp
    if nfsp is None:
        raise ValueError("this model has no visual tokenizer: it cannot generate images")
    if frames < 1 or (frames > 1 and not nfsp.tokenizer.temporal):
        raise ValueError(f"frames must be 1 for a 2D tokenizer (>= 1 with a 3D one), got {frames}")
    if cfg_scale < 0:
        raise ValueError(f"cfg_scale must be >= 0, got {cfg_scale}")
    _check_prompt_ends(model, prompts, ("<boi>", "<bov>"))
    b = len(prompts)
    rows = list(prompts)
    if cfg_scale > 0:
        rows += [[model.vocab.bos_id, p[-1]] for p in prompts]
    scales = nfsp.scales
    _, t0, cache = _prefill(model, rows, frames * nfsp.tokens_per_frame)
    device = t0.device
    r = len(rows)
    codes = [torch.zeros(r, frames, s, s, dtype=torch.long, device=device) for s in scales]
    group = t0.clone()  # text groups equal the token index, so the next free group is the next index
    finest = scales[-1]
    video = frames > 1 or prompts[0][-1] == model.vocab.special("<bov>")
    modality = Modality.VIDEO if video else Modality.IMAGE
    for f in range(frames):
        for k, s in enumerate(scales):
            known = codes[:k] + [torch.zeros_like(codes[k])]
            features = nfsp.tokenizer.scale_inputs(known)[k][:, f].flatten(1, 2)  # [R, s*s, C]
            x = nfsp.embed_features(features, torch.full((r, s * s), k, device=device))
            coords = torch.tensor([(i * finest + finest // 2) // s for i in range(s)], device=device)
            h = (t0[:, None] + coords.repeat_interleave(s)[None]).expand(r, -1)
            w = (t0[:, None] + coords.repeat(s)[None]).expand(r, -1)
            t = (t0 + f)[:, None].expand(r, s * s)
            if raster:
                steps = []
                for j in range(s * s):
                    one = slice(j, j + 1)
                    batch = _step_batch(modality, t[:, one], h[:, one], w[:, one], group[:, None])
                    steps.append(model.forward_hidden(batch, cache=cache, inputs=x[:, j : j + 1]).hidden)
                    group = group + 1
                hidden = torch.cat(steps, dim=1)
            else:
                batch = _step_batch(modality, t, h, w, group[:, None].expand(r, s * s))
                hidden = model.forward_hidden(batch, cache=cache, inputs=x).hidden
                group = group + 1
            logits = nfsp.logits(hidden).float()
            if cfg_scale > 0:
                logits = logits[b:] + cfg_scale * (logits[:b] - logits[b:])
            token = sample(logits.flatten(0, 1), temperature, top_k, top_p, generator).view(-1, s, s)
            codes[k][:, f] = token.repeat(r // token.shape[0], 1, 1)
    return [c[:b] for c in codes]


@torch.no_grad()
def generate_audio(
    model: UnifiedModel,
    prompts: list[list[int]],
    max_frames: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> list[Tensor]:
    """Codec codes `[F_i, Q]` per prompt (unified ids ending with `<boa>`), stopping at END or max_frames."""
    ncp = model.ncp
    if ncp is None:
        raise ValueError("this model has no audio codec: it cannot generate audio")
    if max_frames < 1:
        raise ValueError(f"max_frames must be >= 1, got {max_frames}")
    _check_prompt_ends(model, prompts, ("<boa>",))
    hidden, t, cache = _prefill(model, prompts, max_frames)
    b = len(prompts)
    done = torch.zeros(b, dtype=torch.bool, device=t.device)
    frames: list[list[Tensor]] = [[] for _ in range(b)]
    for step in range(max_frames):
        codes, ended = ncp.sample(hidden, temperature, top_k, top_p, generator)
        done |= ended
        for row in range(b):
            if not done[row]:
                frames[row].append(codes[row])
        if bool(done.all()) or step + 1 == max_frames:
            break
        batch = _step_batch(Modality.AUDIO, t[:, None], t[:, None], t[:, None], t[:, None])
        inputs = ncp.embed_codes(codes)[:, None]
        hidden = model.forward_hidden(batch, cache=cache, inputs=inputs).hidden[:, -1]
        t = t + 1
    q = ncp.levels
    return [torch.stack(f) if f else torch.zeros(0, q, dtype=torch.long, device=t.device) for f in frames]


@torch.no_grad()
def generate_text_after(
    model: UnifiedModel,
    prompt: GroupBatch,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_ids: tuple[int, ...] | None = None,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Continue a left-padded prompt batch (any groups, e.g. `SequenceBuilder.collate_prompts`) with text."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    stop = torch.tensor(stop_ids or (model.vocab.eos_id,), device=prompt.input_ids.device)
    b, length = prompt.input_ids.shape
    if length + max_new_tokens > model.backbone.max_seq_len:
        raise ValueError(f"prompt ({length}) + max_new_tokens ({max_new_tokens}) exceed max_seq_len")
    cache = model.backbone.new_cache(b, length + max_new_tokens)
    hidden = model.forward_hidden(prompt, cache=cache).hidden[:, -1]
    t = prompt.positions.amax(dim=(0, 2)) + 1
    group = prompt.group_id.amax(dim=1) + 1
    done = torch.zeros(b, dtype=torch.bool, device=t.device)
    out: list[list[int]] = [[] for _ in range(b)]
    for _ in range(max_new_tokens):
        token = sample(model.sampling_logits(hidden), temperature, top_k, top_p, generator)
        for row in range(b):
            if not done[row]:
                out[row].append(int(token[row]))
        done |= torch.isin(token, stop)
        if bool(done.all()):
            break
        batch = _step_batch(Modality.TEXT, t[:, None], t[:, None], t[:, None], group[:, None])
        batch.input_ids = token[:, None]
        hidden = model.forward_hidden(batch, cache=cache).hidden[:, -1]
        t, group = t + 1, group + 1
    return out
