"""Sampling and the sampled log-prob: the one formula of every decode loop, the RL engine and the RL trainer.

A `Sampler` draws ids from logits (temperature 0 is greedy; top-k and nucleus top-p filtering) and scores
them under `log_softmax(logits / temperature)`: the temperature-scaled distribution *before* filtering
(vLLM's raw log-probs; temperature 0 scores at temperature 1). The RL trainer scores its tokens with the
same `log_probs`, so that its log-prob minus the engine's is the train/inference mismatch and nothing else.
Which logits a modality samples from is its head's business (`UnifiedModel.sampling_logits` for text,
`NFSP.logits`, `NCP`'s depth head per level); how they are sampled and scored is this file's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def sample(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """`[B, V]` logits -> `[B]` ids. temperature 0 is greedy; top-k and nucleus (top-p) filtering."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


def guided_logits(logits: Tensor, guidance: float, conditional: int) -> Tensor:
    """Classifier-free guidance `l_uncond + g (l_cond - l_uncond)` over rows laid out as the `conditional`
    rows, then as many unconditional ones; g = 0 leaves the logits as they are (no unconditional rows)."""
    if guidance == 0:
        return logits
    return logits[conditional:] + guidance * (logits[:conditional] - logits[conditional:])


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")


def log_probs(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """`[..., V]` float32 log-probs that sampled tokens are scored under (temperature 0 scores at 1)."""
    return (logits.float() / (temperature if temperature > 0 else 1.0)).log_softmax(-1)


def chosen(logp: Tensor, tokens: Tensor) -> Tensor:
    """`[..., V]` log-probs and `[...]` ids -> `[...]` the log-prob of each id."""
    return logp.gather(-1, tokens[..., None])[..., 0]


def entropy(logp: Tensor) -> Tensor:
    """`[..., V]` log-probs -> `[...]` entropies (ids at -inf, such as masked ones, contribute 0)."""
    return -(logp.exp() * logp.clamp_min(-1e9)).sum(-1)


@dataclass
class Sampler:
    """How a decode loop samples: the settings of `sample` and the generator that draws.

    Args:
        temperature: 0 is greedy.
        top_k: keep the k likeliest ids (None: off).
        top_p: keep the smallest set of ids holding this much probability (None: off).
        generator: the random stream (None: torch's global one).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def sample(self, logits: Tensor) -> Tensor:
        """`[B, V]` logits -> `[B]` ids."""
        return sample(logits, self.temperature, self.top_k, self.top_p, self.generator)

    def log_probs(self, logits: Tensor) -> Tensor:
        """`[..., V]` logits -> the log-probs sampled ids are scored under."""
        return log_probs(logits, self.temperature)

    def logprob(self, logits: Tensor, tokens: Tensor) -> Tensor:
        """The log-prob of each sampled id `[B]` under its logits `[B, V]`."""
        return chosen(self.log_probs(logits), tokens)
