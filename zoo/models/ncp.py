"""Next-Codec Prediction (NCP): the audio embedder and depth head of the unified model (ERNIE 5.0, 3.3).

One group per codec frame. The input of a frame position is the sum of the embeddings of all RVQ levels
of that frame, and its output predicts the next frame (so a frame is predicted from the frames before
it); the `<boa>` position predicts frame 0 and the last frame predicts "end of audio".

The backbone state h of a position feeds a small depth transformer over the levels (Moshi's depth
transformer): step q sees proj(h) plus the embedding of level q-1's code and predicts level q,

    L_NCP = sum_q w_q CE(head_q(depth(h, c_<q))_q, c_q) / sum_q w_q

teacher-forced in training, sampled level by level in generation. Level 1's head has one extra class,
END, trained at the last frame: variable-length audio stops when it is sampled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.batch import AudioItem, AudioPayload, GroupBatch
from zoo.models.heads import HeadOutput
from zoo.models.sampling import Sampler, entropy, guided_logits, log_probs
from zoo.tokenizers.audio import AudioCodec
from zoo.tokenizers.vocab import UnifiedVocab


class NCP(nn.Module):
    """Audio embedder + depth head around a frozen `AudioCodec`.

    Args:
        codec: the trained RVQ codec; kept frozen. Its levels and codebook sizes must fit `vocab`.
        vocab: the unified vocabulary (audio levels and ids per level).
        dim: backbone width.
        depth_layers: layers of the depth transformer.
        depth_heads: attention heads of the depth transformer.
        level_weights: loss weight per level (default: equal).
        loss_weight: weight of the NCP loss in the model's total.
    """

    def __init__(
        self,
        codec: AudioCodec,
        vocab: UnifiedVocab,
        dim: int,
        depth_layers: int = 2,
        depth_heads: int = 4,
        level_weights: tuple[float, ...] | None = None,
        loss_weight: float = 1.0,
    ) -> None:
        super().__init__()
        self.codec = codec.requires_grad_(False).eval()
        self.levels = codec.num_levels
        sizes = tuple(codec.codebook_sizes)
        if self.levels != vocab.audio_levels or max(sizes) > vocab.audio_size:
            raise ValueError(
                f"the audio codec has {self.levels} levels of sizes {sizes}, but the unified vocabulary "
                f"reserves {vocab.audio_levels} levels of {vocab.audio_size} ids: make them agree"
            )
        weights = level_weights or (1.0,) * self.levels
        if len(weights) != self.levels or min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(f"level_weights needs {self.levels} non-negative weights, got {level_weights}")
        self.register_buffer("level_weights", torch.tensor(weights, dtype=torch.float32), persistent=False)
        self.codebook_sizes = sizes
        self.size = vocab.audio_size
        self.end_id = vocab.audio_size  # the extra class of level 1
        self.loss_weight = loss_weight
        self.input_embed = nn.Embedding(self.levels * self.size, dim)
        self.level_embed = nn.Embedding(self.levels * self.size, dim)
        self.level_pos = nn.Parameter(torch.zeros(self.levels, dim))
        self.depth_in = nn.Linear(dim, dim, bias=False)
        layer = nn.TransformerEncoderLayer(
            dim, depth_heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.depth = nn.TransformerEncoder(layer, depth_layers, enable_nested_tensor=False)
        self.depth_norm = nn.LayerNorm(dim)
        self.heads = nn.ModuleList(
            nn.Linear(dim, self.size + (q == 0), bias=False) for q in range(self.levels)
        )
        causal = nn.Transformer.generate_square_subsequent_mask(self.levels)
        self.register_buffer("causal", causal, persistent=False)
        self.register_buffer("offsets", torch.arange(self.levels) * self.size, persistent=False)
        for weight in (self.input_embed.weight, self.level_embed.weight, self.level_pos):
            nn.init.normal_(weight, std=0.02)

    def train(self, mode: bool = True) -> NCP:
        super().train(mode)
        self.codec.eval()  # quantiser EMA and dropout must stay off
        return self

    # -- batch side -------------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, payload: AudioPayload) -> Tensor:
        """Codes `[N_frames, Q]` of every audio item of a batch, in frame order."""
        hop = int(payload.hop)
        if hop != self.codec.hop:
            raise ValueError(
                f"the batch lays out audio with hop {hop} but the codec's hop is {self.codec.hop}: "
                "set the datamodule's layout.audio_hop to the codec's"
            )
        codes = []
        for kind, index, _, frames in payload.items.tolist():
            if kind == AudioItem.CODES:  # codes given by the data (pre-tokenized, or generated and fed back)
                item = payload.codes[index : index + frames]
            else:
                # One item at a time: zero padding would leak into the last frames' receptive field and
                # make an item's codes depend on what it was batched with.
                n = int(payload.lengths[index])
                item = self.codec.encode(payload.waves[index : index + 1, :n])[0]
            if item.shape != (frames, self.levels):
                expected = f"[{frames}, {self.levels}]"
                raise ValueError(f"audio item {index} has codes {list(item.shape)}, expected {expected}")
            codes.append(item)
        return torch.cat(codes)

    def embed_codes(self, codes: Tensor) -> Tensor:
        """`[..., Q]` codes -> `[..., D]`: the sum of the level embeddings."""
        return self.input_embed(codes + self.offsets).sum(-2)

    def embed(self, x: Tensor, payload: AudioPayload, frames: Tensor) -> Tensor:
        slot = payload.slot
        where = slot >= 0
        values = self.embed_codes(frames[slot[where]])
        return x.masked_scatter(where[..., None], values.to(x.dtype))

    def depth_logits(self, hidden: Tensor, codes: Tensor) -> list[Tensor]:
        """`[N, D]` states and teacher codes `[N, Q]` -> logits per level (level q sees levels < q)."""
        steps = self.depth_in(hidden)[:, None, :].expand(-1, self.levels, -1) + self.level_pos
        previous = self.level_embed(codes[:, :-1] + self.offsets[:-1])
        steps = torch.cat([steps[:, :1], steps[:, 1:] + previous], dim=1)
        out = self.depth_norm(self.depth(steps, mask=self.causal, is_causal=True))
        return [head(out[:, q]) for q, head in enumerate(self.heads)]

    def forward(self, hidden: Tensor, batch: GroupBatch, frames: Tensor) -> HeadOutput:
        target = batch.targets["audio"]
        end = batch.targets["audio_end"]
        picked = (target >= 0) | end
        if not bool(picked.any()):
            zero = hidden.sum() * 0.0
            return HeadOutput(zero, {"audio/frames": zero.detach()})
        is_end = end[picked]
        codes = frames[target[picked].clamp_min(0)]
        codes[is_end] = 0
        logits = self.depth_logits(hidden[picked], codes)
        first = torch.where(is_end, self.end_id, codes[:, 0])
        losses = [F.cross_entropy(logits[0].float(), first)]
        metrics = {"audio/end_accuracy": ((logits[0].argmax(-1) == self.end_id) == is_end).float().mean()}
        for q in range(1, self.levels):
            keep = ~is_end  # past the end there is nothing to predict for the other levels
            if bool(keep.any()):
                losses.append(F.cross_entropy(logits[q][keep].float(), codes[keep, q]))
            else:
                losses.append(logits[q].sum() * 0.0)
        for q, (loss, lg) in enumerate(zip(losses, logits, strict=True)):
            metrics[f"audio/level{q + 1}_loss"] = loss.detach()
            if q == 0:
                metrics["audio/level1_accuracy"] = (lg.argmax(-1) == first).float().mean().detach()
        total = (torch.stack(losses) * self.level_weights).sum() / self.level_weights.sum()
        metrics["audio/ncp_loss"] = total.detach()
        metrics["audio/frames"] = picked.sum().float()
        return HeadOutput(self.loss_weight * total, metrics)

    # -- generation -------------------------------------------------------------------------------
    def _valid(self, logits: Tensor, q: int) -> Tensor:
        """Ids past a smaller level's codebook are never valid codes (the END class stays allowed)."""
        invalid = torch.arange(self.codebook_sizes[q], self.size, device=logits.device)
        return logits.float().index_fill(-1, invalid, float("-inf"))

    @torch.no_grad()
    def sample(
        self,
        hidden: Tensor,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """States `[B, D]` -> (codes `[B, Q]`, ended `[B]` bool), level by level through the depth head."""
        codes, ended, _ = self.sample_frame(hidden, Sampler(temperature, top_k, top_p, generator))
        return codes, ended

    @torch.no_grad()
    def sample_frame(
        self, hidden: Tensor, sampler: Sampler, guidance: float = 0.0
    ) -> tuple[Tensor, Tensor, Tensor]:
        """As `sample`, plus `[B, Q]` log-probs of each sampled level (`zoo.models.sampling`: before top-k /
        top-p filtering); column 0 is END's for a row that ended, its other columns are meaningless.

        guidance g > 0: `hidden` holds B conditional states then B unconditional ones; every level is drawn
        from `l_uncond + g (l_cond - l_uncond)`, both depth passes reading the levels drawn so far."""
        rows = hidden.shape[0]
        b = rows // 2 if guidance > 0 else rows
        codes = torch.zeros(b, self.levels, dtype=torch.long, device=hidden.device)
        ended = torch.zeros(b, dtype=torch.bool, device=hidden.device)
        logprobs = torch.zeros(b, self.levels, device=hidden.device)
        for q in range(self.levels):
            depth = self.depth_logits(hidden, codes.repeat(rows // b, 1))[q]
            logits = self._valid(guided_logits(depth, guidance, b), q)
            token = sampler.sample(logits)
            logprobs[:, q] = sampler.logprob(logits, token)
            if q == 0:
                ended = token == self.end_id
                token = token.masked_fill(ended, 0)
            codes[:, q] = token
        return codes, ended, logprobs

    def logprobs(self, hidden: Tensor, codes: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
        """Teacher-forced `[N, Q]` log-probs (and entropies) of `codes` `[N, Q]` from states `[N, D]`, as
        `sample_frame` scores them; a row whose level-1 code is `end_id` scores END there."""
        logits = self.depth_logits(hidden, codes.clamp_max(self.size - 1))
        logprobs, entropies = [], []
        for q in range(self.levels):
            logp = log_probs(self._valid(logits[q], q), temperature)
            logprobs.append(logp.gather(-1, codes[:, q : q + 1])[:, 0])
            entropies.append(entropy(logp))
        return torch.stack(logprobs, 1), torch.stack(entropies, 1)

    @torch.no_grad()
    def decode(self, codes: Tensor) -> Tensor:
        """`[B, F, Q]` codes -> waveforms `[B, F * hop]`."""
        return self.codec.decode(codes).clamp(-1, 1)
