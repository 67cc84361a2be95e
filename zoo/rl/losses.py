"""RL policy losses as pure functions on tensors (ERNIE 5.0 RL stage; REFERENCES.md Part B, section 2).

Per response token three log-probs are kept: `logp_inf` (the inference engine that sampled it), `logp_old`
(the trainer at the weights that generated the batch, no gradient) and `l` (the trainer now, with
gradient). Tensors are padded `[B, T]` (B responses, T their longest length) with a `mask` `[B, T]`
marking real response tokens; advantages are one scalar per response, `[B]`.

- `group_advantages`: A_i = (R_i - mean_G R) / (std_G R + eps), zero for zero-variance groups.
- `grpo_token_loss`: r = exp(logp - logp_old), PPO clip with DAPO's asymmetric clip-higher.
- `gspo_token_loss`: the GSPO sequence ratio s_i = exp(mean_t(logp - logp_old)) in its GSPO-token form.
- `icepop_token_weights` / `icepop_sequence_weights`: the IcePop train/inference mismatch mask
  M(k) = k if alpha <= k <= beta else 0 with k = exp(logp_old - logp_inf), detached; token or sequence level.
  MISC ("mixed") is the token mask inside the GSPO-token objective: `policy_loss(algorithm="gspo_misc")`.
- `wpsm_weights` + `SuccessTracker`: ERNIE's well-learned positive sample mask.
- `aggregate`: denominators are GLOBAL token or sequence counts of the whole step (all micro-batches),
  so splitting a batch into micro-batches never changes the gradient.
- `kl_k3`, `token_entropy`, `mismatch_kl`: the optional KL / entropy terms and the mismatch monitor.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, fields
from typing import Literal

import torch
from torch import Tensor

from zoo.batch import Modality

Algorithm = Literal["grpo", "gspo", "gspo_misc"]
Aggregation = Literal["token", "sequence"]


# ---------------------------------------------------------------------------------------- advantages


def group_advantages(rewards: Tensor, eps: float = 1e-6, scale: bool = True) -> tuple[Tensor, Tensor]:
    """Group-normalised advantages (GRPO): A_{g,i} = (R_{g,i} - mean_i R_{g,:}) / (std_i R_{g,:} + eps).

    Args:
        rewards: `[N_groups, G]`, the rewards of G responses to each of N prompts.
        eps: added to the (unbiased) standard deviation.
        scale: divide by the standard deviation (False: Dr. GRPO's A = R - mean).

    Returns:
        advantages `[N_groups, G]` and `zero_variance` `[N_groups]` bool. A group whose rewards are all
        equal (or a group of one) gets advantage exactly 0: it carries no learning signal, and dividing
        its zero deviation by eps would only amplify float noise.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [N_groups, G], got shape {tuple(rewards.shape)}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards hold non-finite values; verifiers must return finite numbers")
    rewards = rewards.float()
    zero_variance = (rewards.amax(dim=1) - rewards.amin(dim=1)) == 0
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale and rewards.shape[1] > 1:
        centred = centred / (rewards.std(dim=1, keepdim=True) + eps)
    advantages = torch.where(zero_variance[:, None], torch.zeros_like(centred), centred)
    return advantages, zero_variance


# ------------------------------------------------------------------------------------ mismatch masks


@dataclass(frozen=True)
class MismatchBounds:
    """IcePop trust region [alpha, beta] on k = pi_train / pi_infer, per modality of the response token.

    ERNIE 5.0 uses modality-dependent bounds: image/audio tokens are sampled from wider distributions
    and tolerate a different mismatch than text. (0.5, 5.0) is the IcePop / verl / OpenRLHF default.
    """

    text: tuple[float, float] = (0.5, 5.0)
    image: tuple[float, float] = (0.5, 5.0)
    video: tuple[float, float] = (0.5, 5.0)
    audio: tuple[float, float] = (0.5, 5.0)

    def __post_init__(self) -> None:
        for f in fields(self):
            low, high = getattr(self, f.name)
            if not 0.0 <= low <= 1.0 <= high:
                raise ValueError(
                    f"MismatchBounds.{f.name} = ({low}, {high}): expected 0 <= alpha <= 1 <= beta"
                )

    def tensors(self, modality: Tensor) -> tuple[Tensor, Tensor]:
        """Per-token alpha and beta `[..]` for a tensor of `zoo.batch.Modality` ids (others: text's)."""
        table = {
            Modality.TEXT: self.text,
            Modality.IMAGE: self.image,
            Modality.VIDEO: self.video,
            Modality.AUDIO: self.audio,
        }
        alpha = torch.full(modality.shape, self.text[0], dtype=torch.float32, device=modality.device)
        beta = torch.full(modality.shape, self.text[1], dtype=torch.float32, device=modality.device)
        for m, (low, high) in table.items():
            alpha = torch.where(modality == int(m), low, alpha)
            beta = torch.where(modality == int(m), high, beta)
        return alpha, beta


def icepop_token_weights(
    logp_old: Tensor, logp_inf: Tensor, mask: Tensor, alpha: float | Tensor, beta: float | Tensor
) -> Tensor:
    """IcePop token mask (Ring-1T): w_{i,t} = M(k_{i,t}), k = exp(logp_old - logp_inf),
    M(k) = k if alpha <= k <= beta else 0. Detached; 0 at padding.
    alpha/beta: scalars or per-token `[B, T]` (`MismatchBounds.tensors`)."""
    k = torch.exp((logp_old - logp_inf).detach().float())
    keep = (k >= alpha) & (k <= beta) & mask.bool()
    return torch.where(keep, k, torch.zeros_like(k))


def icepop_sequence_weights(
    logp_old: Tensor, logp_inf: Tensor, mask: Tensor, alpha: float | Tensor, beta: float | Tensor
) -> Tensor:
    """Sequence-level IcePop: k_i = exp(mean_t(logp_old - logp_inf)) (the geometric mean of the token ratios),
    w_{i,t} = M(k_i) for every token of response i. Detached. alpha/beta: scalars or `[B]`.

    The ERNIE report finds this variant collapses entropy with GSPO: one outlier token discards the whole
    response, and long responses are hit hardest.
    """
    m = mask.float()
    log_k = ((logp_old - logp_inf).detach().float() * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)
    k = torch.exp(log_k)
    keep = (k >= alpha) & (k <= beta)
    return torch.where(keep, k, torch.zeros_like(k))[:, None] * m


def mismatch_kl(logp_old: Tensor, logp_inf: Tensor, mask: Tensor) -> Tensor:
    """Sum over response tokens of the k3 estimate of KL(pi_infer || pi_train_old) from pi_infer's samples:
    k3 = k - 1 - log k with k = exp(logp_old - logp_inf) (>= 0, unbiased; Schulman's estimator)."""
    d = (logp_old - logp_inf).detach().float()
    return torch.where(mask.bool(), torch.expm1(d) - d, torch.zeros_like(d)).sum()


# ------------------------------------------------------------------------------------ policy objectives


def ppo_clip(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token loss -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) and where each side clipped.

    Returns (loss, clipped_low, clipped_high): the clipped branch is the active one when A < 0 and
    r < 1 - clip_low (low), or A > 0 and r > 1 + clip_high (high); there the gradient is zero.
    """
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -torch.minimum(ratio * advantages, clipped * advantages)
    low = (advantages < 0) & (ratio < 1.0 - clip_low)
    high = (advantages > 0) & (ratio > 1.0 + clip_high)
    return loss, low, high


def grpo_token_loss(
    logp: Tensor, logp_old: Tensor, advantages: Tensor, clip_low: float = 0.2, clip_high: float = 0.28
) -> tuple[Tensor, Tensor, Tensor]:
    """GRPO / PPO per token: r_{i,t} = exp(logp - logp_old),
    loss = -min(r A_i, clip(r, 1 - e_low, 1 + e_high) A_i).

    e_high > e_low is DAPO's clip-higher (0.2 / 0.28 there). Returns (loss `[B, T]`, clipped_low,
    clipped_high); mask and weights are applied by `policy_loss`.
    """
    # Clamped like verl: an exp of a huge log-ratio would overflow before clipping can help.
    ratio = torch.exp((logp - logp_old.detach()).clamp(-20.0, 20.0))
    return ppo_clip(ratio, advantages[:, None], clip_low, clip_high)


def sequence_log_ratio(logp: Tensor, logp_old: Tensor, mask: Tensor) -> Tensor:
    """log s_i = (1/|y_i|) sum_t (logp - logp_old) over response tokens, `[B]` (GSPO's normalised ratio)."""
    m = mask.float()
    return ((logp - logp_old.detach()) * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)


def gspo_token_loss(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    token_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """GSPO in its GSPO-token form (Zheng et al. 2025, eq. 11; verl's `gspo` loss):

        s_{i,t} = sg[s_i] * exp(logp_{i,t} - sg[logp_{i,t}]),   s_i = exp(mean_t(logp - logp_old)),
        loss_{i,t} = -min(s_{i,t} A_i, clip(s_{i,t}, 1 - e_low, 1 + e_high) A_i).

    Every token of response i has the value s_i, so clipping is decided per sequence; the gradient of
    token t flows through its own l_{i,t} only, so a per-token weight of 0 (MISC) zeroes exactly that
    token's gradient. With no per-token weights and seq-mean aggregation this equals GSPO in value and
    gradient. Defaults are the paper's (3e-4, 4e-4). `token_mask` `[B, T]` (optional): tokens whose
    gradient must be exactly zero (the MISC mask).
    """
    log_s = sequence_log_ratio(logp, logp_old, mask).detach().clamp(max=10.0)
    # Tokens outside `token_mask` carry a constant in place of logp: their factor is exactly 1 with no graph,
    # so even a non-finite log-prob there cannot turn the (zero) gradient into NaN.
    live = logp if token_mask is None else torch.where(token_mask.bool(), logp, torch.zeros_like(logp))
    ratio = torch.exp(log_s[:, None] + live - live.detach())
    return ppo_clip(ratio, advantages[:, None], clip_low, clip_high)


# ------------------------------------------------------------------------------------------------ WPSM


class SuccessTracker:
    """Per-query success rate for WPSM: the group accuracy of the latest visit, or an exponential moving
    average over visits (`momentum` m: acc <- m acc + (1 - m) acc_now; None keeps the latest only)."""

    def __init__(self, momentum: float | None = None) -> None:
        if momentum is not None and not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must lie in [0, 1) or be None, got {momentum}")
        self.momentum = momentum
        self.accuracy: dict[Hashable, float] = {}
        self.visits: dict[Hashable, int] = {}

    def update(self, query_id: Hashable, correct: Sequence[bool] | Tensor) -> float:
        """Record one group of responses to `query_id`; returns the tracked accuracy."""
        values = [bool(c) for c in (correct.tolist() if isinstance(correct, Tensor) else correct)]
        if not values:
            raise ValueError(f"no responses given for query {query_id!r}")
        now = sum(values) / len(values)
        previous = self.accuracy.get(query_id)
        if previous is None or self.momentum is None:
            self.accuracy[query_id] = now
        else:
            self.accuracy[query_id] = self.momentum * previous + (1.0 - self.momentum) * now
        self.visits[query_id] = self.visits.get(query_id, 0) + 1
        return self.accuracy[query_id]

    def get(self, query_id: Hashable, default: float = 0.0) -> float:
        return self.accuracy.get(query_id, default)

    def state_dict(self) -> dict[str, object]:
        return {"accuracy": dict(self.accuracy), "visits": dict(self.visits)}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.accuracy = dict(state["accuracy"])  # type: ignore[arg-type]
        self.visits = dict(state["visits"])  # type: ignore[arg-type]


def wpsm_weights(
    advantages: Tensor, accuracy: Tensor, mean_entropy: Tensor, tau: float, eta: float, alpha: float
) -> tuple[Tensor, Tensor]:
    """Well-learned Positive Sample Mask (ERNIE 5.0): W_i = 1[A_i > 0] 1[acc(x_i) > tau] 1[H_i < eta],
    weight_i = 1 - alpha W_i (detached). A correct, confident answer to a query the policy already solves
    pushes entropy down for little gain, so its update is damped.

    Args: `[B]` advantages, tracked query accuracy and mean token entropy of each response.
    Returns (weights `[B]`, W `[B]` bool).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"WPSM alpha must lie in [0, 1], got {alpha}")
    well_learned = (advantages > 0) & (accuracy > tau) & (mean_entropy.detach() < eta)
    weights = 1.0 - alpha * well_learned.float()
    return weights, well_learned


# -------------------------------------------------------------------------------- KL, entropy, totals


def kl_k3(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref): exp(logp_ref - logp) - (logp_ref - logp) - 1."""
    d = (logp_ref.detach() - logp).clamp(-20.0, 20.0)
    return torch.expm1(d) - d


def token_entropy(logits: Tensor) -> Tensor:
    """H = -sum_v p_v log p_v over the last dimension (in nats)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: Aggregation,
    total_tokens: int | None = None,
    total_sequences: int | None = None,
) -> Tensor:
    """Reduce a per-token quantity to the step's loss with GLOBAL denominators.

    token:    sum_{i,t} m x / N_tokens            (DAPO; N_tokens = response tokens of the whole step)
    sequence: sum_i (sum_t m x / |y_i|) / N_seqs  (GRPO / GSPO seq-mean-token-mean)

    Pass the totals of the whole step (every micro-batch, every rank): then the sum of the
    micro-batch losses is the full batch's loss and so is its gradient. None uses this batch's own
    counts (only right when the batch is the whole step).
    """
    m = mask.float()
    x = torch.where(mask.bool(), per_token, torch.zeros_like(per_token))
    if mode == "token":
        n = float(total_tokens) if total_tokens is not None else float(m.sum())
        return x.sum() / max(n, 1.0)
    if mode == "sequence":
        n = float(total_sequences) if total_sequences is not None else float(m.shape[0])
        return (x.sum(dim=1) / m.sum(dim=1).clamp_min(1.0)).sum() / max(n, 1.0)
    raise ValueError(f"aggregation must be 'token' or 'sequence', got {mode!r}")


# ----------------------------------------------------------------------------------- the full objective


@dataclass
class LossStats:
    """Sums over the tokens / sequences of one step (add micro-batches with `+`); `logs()` gives rates."""

    tokens: float = 0.0
    sequences: float = 0.0
    clipped_low: float = 0.0  # tokens whose clipped branch is active, by side
    clipped_high: float = 0.0
    masked: float = 0.0  # response tokens whose IcePop / MISC weight is 0
    mismatch_kl: float = 0.0  # sum of k3(logp_old vs logp_inf) over tokens
    ratio_sum: float = 0.0  # sum of the (token or sequence) ratio over tokens
    entropy_sum: float = 0.0
    kl_sum: float = 0.0
    wpsm_masked: float = 0.0  # sequences down-weighted by WPSM
    extra: dict[str, float] = field(default_factory=dict)

    def __add__(self, other: LossStats) -> LossStats:
        summed = {
            f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self) if f.name != "extra"
        }
        return LossStats(**summed, extra={**self.extra, **other.extra})

    def logs(self) -> dict[str, float]:
        t, s = max(self.tokens, 1.0), max(self.sequences, 1.0)
        return {
            "clipped_fraction": (self.clipped_low + self.clipped_high) / t,
            "clipped_low_fraction": self.clipped_low / t,
            "clipped_high_fraction": self.clipped_high / t,
            "masked_fraction": self.masked / t,
            "mismatch_kl": self.mismatch_kl / t,
            "ratio_mean": self.ratio_sum / t,
            "entropy": self.entropy_sum / t,
            "kl": self.kl_sum / t,
            "wpsm_fraction": self.wpsm_masked / s,
            **self.extra,
        }


@dataclass(frozen=True)
class PolicyLossConfig:
    """Which RL objective and its stabilisers.

    Args:
        algorithm: "grpo" (token ratio, PPO clip), "gspo" (sequence ratio) or "gspo_misc" (GSPO with
            the token-level IcePop mask inside: ERNIE's MISC "mixed").
        icepop: train/inference mismatch correction. grpo: token-level IcePop; gspo: sequence-level
            IcePop (the variant that collapses entropy); gspo_misc always masks per token.
        bounds: IcePop [alpha, beta] per modality.
        clip_low: lower clip epsilon (None: 0.2 for grpo, 3e-4 for gspo).
        clip_high: upper clip epsilon (None: 0.28 for grpo (DAPO clip-higher), 4e-4 for gspo).
        aggregation: "token" or "sequence" (None: token for grpo, sequence for gspo).
        kl_coef: weight of the k3 KL to the reference policy (0: no reference model).
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
        wpsm_alpha: WPSM damping (0 disables WPSM).
        wpsm_tau: WPSM accuracy threshold.
        wpsm_eta: WPSM mean-entropy threshold (nats).
    """

    algorithm: Algorithm = "gspo_misc"
    icepop: bool = True
    bounds: MismatchBounds = MismatchBounds()
    clip_low: float | None = None
    clip_high: float | None = None
    aggregation: Aggregation | None = None
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    wpsm_alpha: float = 0.0
    wpsm_tau: float = 0.8
    wpsm_eta: float = 0.5

    def __post_init__(self) -> None:
        if self.algorithm not in ("grpo", "gspo", "gspo_misc"):
            raise ValueError(f"algorithm must be 'grpo', 'gspo' or 'gspo_misc', got {self.algorithm!r}")
        if self.clip_low is not None and not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low must lie in [0, 1), got {self.clip_low}")
        if self.clip_high is not None and not self.clip_high >= 0.0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")
        if not 0.0 <= self.wpsm_alpha <= 1.0:
            raise ValueError(f"wpsm_alpha must lie in [0, 1], got {self.wpsm_alpha}")

    @property
    def token_level(self) -> bool:
        return self.algorithm == "grpo"

    @property
    def epsilons(self) -> tuple[float, float]:
        low, high = (0.2, 0.28) if self.token_level else (3e-4, 4e-4)
        return (
            low if self.clip_low is None else self.clip_low,
            high if self.clip_high is None else self.clip_high,
        )

    @property
    def reduction(self) -> Aggregation:
        if self.aggregation is not None:
            return self.aggregation
        return "token" if self.token_level else "sequence"


def policy_loss(
    config: PolicyLossConfig,
    logp: Tensor,
    logp_old: Tensor,
    logp_inf: Tensor,
    advantages: Tensor,
    mask: Tensor,
    total_tokens: int | None = None,
    total_sequences: int | None = None,
    modality: Tensor | None = None,
    sequence_weights: Tensor | None = None,
    entropy: Tensor | None = None,
    logp_ref: Tensor | None = None,
) -> tuple[Tensor, LossStats]:
    """The step's loss on one micro-batch (sum the micro-batches' losses, or backward each).

    L = aggregate(w_{i,t} * v_i * loss_{i,t}) + kl_coef * aggregate(k3) - entropy_coef * aggregate(H)

    with loss_{i,t} from `grpo_token_loss` or `gspo_token_loss`, w the IcePop weights (token-level for
    grpo and gspo_misc, sequence-level for gspo) and v the per-sequence weights (WPSM). A token of weight
    0 contributes exactly 0 to the loss and to the gradient (`torch.where`, not a product, so that even
    a non-finite log-prob at a masked token cannot leak NaN into the gradient).

    Args:
        logp, logp_old, logp_inf: `[B, T]` log-probs of the response tokens (logp carries the gradient).
        advantages: `[B]`. mask: `[B, T]` response tokens.
        total_tokens / total_sequences: GLOBAL counts of the step (see `aggregate`).
        modality: `[B, T]` Modality ids of the response tokens, for per-modality IcePop bounds.
        sequence_weights: `[B]` detached weights (e.g. `wpsm_weights`), None = 1.
        entropy: `[B, T]` token entropies (with gradient when entropy_coef > 0).
        logp_ref: `[B, T]` reference log-probs, required when kl_coef > 0.
    """
    if not (logp.shape == logp_old.shape == logp_inf.shape == mask.shape):
        raise ValueError(
            f"logp {tuple(logp.shape)}, logp_old {tuple(logp_old.shape)}, logp_inf {tuple(logp_inf.shape)} "
            f"and mask {tuple(mask.shape)} must share one [B, T] shape"
        )
    if advantages.shape != (logp.shape[0],):
        raise ValueError(f"advantages must be [B={logp.shape[0]}], got {tuple(advantages.shape)}")
    mask = mask.bool()
    if modality is None:
        modality = torch.full_like(mask, int(Modality.TEXT), dtype=torch.long)
    alpha, beta = config.bounds.tensors(modality)
    weights: Tensor | None = None
    if config.algorithm == "gspo_misc" or (config.icepop and config.algorithm == "grpo"):
        weights = icepop_token_weights(logp_old, logp_inf, mask, alpha, beta)
    elif config.icepop and config.algorithm == "gspo":
        # The response's bounds are those of its first token's modality.
        weights = icepop_sequence_weights(logp_old, logp_inf, mask, alpha[:, 0], beta[:, 0])
    keep = mask if weights is None else mask & (weights > 0)

    clip_low, clip_high = config.epsilons
    if config.token_level:
        per_token, low, high = grpo_token_loss(logp, logp_old, advantages, clip_low, clip_high)
        ratio = torch.exp((logp - logp_old).detach().clamp(-20, 20))
    else:
        per_token, low, high = gspo_token_loss(logp, logp_old, advantages, mask, clip_low, clip_high, keep)
        ratio = torch.exp(sequence_log_ratio(logp, logp_old, mask).detach())[:, None].expand_as(logp)
    if weights is not None:
        per_token = weights * per_token
    if sequence_weights is not None:
        per_token = sequence_weights.detach()[:, None] * per_token
    per_token = torch.where(keep, per_token, torch.zeros_like(per_token))
    loss = aggregate(per_token, mask, config.reduction, total_tokens, total_sequences)

    m = mask.float()
    stats = LossStats(
        tokens=float(m.sum()),
        sequences=float(logp.shape[0]),
        clipped_low=float((low & keep).sum()),
        clipped_high=float((high & keep).sum()),
        masked=float((mask & ~keep).sum()),
        mismatch_kl=float(mismatch_kl(logp_old, logp_inf, mask)),
        ratio_sum=float((ratio * m).sum()),
    )
    if entropy is not None:
        stats.entropy_sum = float((entropy.detach() * m).sum())
        if config.entropy_coef:
            loss = loss - config.entropy_coef * aggregate(
                entropy, mask, config.reduction, total_tokens, total_sequences
            )
    if config.kl_coef:
        if logp_ref is None:
            raise ValueError("kl_coef > 0 needs the reference log-probs logp_ref")
        kl = kl_k3(logp, logp_ref)
        stats.kl_sum = float((kl.detach() * m).sum())
        loss = loss + config.kl_coef * aggregate(kl, mask, config.reduction, total_tokens, total_sequences)
    return loss, stats


def pad_sequences(values: Sequence[Tensor], pad: float = 0.0) -> tuple[Tensor, Tensor]:
    """A list of 1-D tensors -> (`[B, T]` right-padded, `[B, T]` bool mask). Keeps the autograd graph."""
    if not values:
        raise ValueError("no sequences to pad")
    longest = max(max(v.numel() for v in values), 1)
    rows, masks = [], []
    for v in values:
        v = v.reshape(-1)
        n = v.numel()
        rows.append(torch.cat([v, v.new_full((longest - n,), pad)]))
        masks.append(torch.arange(longest, device=v.device) < n)
    return torch.stack(rows), torch.stack(masks)
