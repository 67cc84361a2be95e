"""The policy update of one RL step: advantages of the scored groups, then `ppo_epochs` optimizer steps
(ERNIE 5.0 RL stage; REFERENCES.md part B, section 2).

`PolicyUpdate.advantages`: group-normalised advantages of the groups' rewards (`zoo.rl.losses`); groups
whose rewards are all equal carry no gradient and are counted; the per-query accuracy WPSM reads is
updated. `PolicyUpdate.train`: l_old (the trainer's log-probs at this step's weights, no grad, with router
replay if enabled) and, for a KL term, the reference policy's; then `ppo_epochs` passes over
micro-batches: l with gradient, `zoo.rl.losses.policy_loss` (GRPO / GSPO / GSPO+MISC) with denominators
counted over the whole step, backward; one optimizer step per pass. Lightning's optimisation hooks come in
as two callables, so this file knows nothing of the LightningModule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from zoo.models.unified import UnifiedModel
from zoo.rl.losses import (
    LossStats,
    PolicyLossConfig,
    SuccessTracker,
    group_advantages,
    pad_sequences,
    policy_loss,
    wpsm_weights,
)
from zoo.rl.records import Rollout
from zoo.rl.replay import sequence_logprobs
from zoo.rl.responses import response_kind
from zoo.tasks.optim import (
    LRSchedulerCallable,
    OptimizerCallable,
    build_optimizer,
    build_schedule,
    decay_groups,
    refuse_replaced_arguments,
)


@dataclass(frozen=True)
class UpdateConfig:
    """What one RL step trains on, and how.

    Args:
        batch_size: queries per step.
        group_size: responses per query (G).
        micro_batch_size: rollouts per forward/backward.
        ppo_epochs: optimizer steps per batch of rollouts.
        router_replay: recompute l_old and l with the recorded expert sets (Rollout Router Replay); the
            engine then records the routing of every position.
        wpsm_momentum: per-query accuracy for WPSM: EMA momentum over visits (None: the latest group).
        permute_rewards: a control without learning signal: each group's rewards are randomly permuted
            among its responses before the advantages (same reward statistics, same number of updates of
            the same size, no relation between a response and its advantage). Logged rewards stay true.
    """

    batch_size: int = 8
    group_size: int = 8
    micro_batch_size: int = 32
    ppo_epochs: int = 1
    router_replay: bool = True
    wpsm_momentum: float | None = None
    permute_rewards: bool = False

    def __post_init__(self) -> None:
        for name in ("batch_size", "group_size", "micro_batch_size", "ppo_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"UpdateConfig.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class OptimConfig:
    """The default optimizer of the policy (AdamW, betas (0.9, 0.99); constant learning rate after a linear
    warm-up), the gradient clip and the frozen parameters. RLTask's `optimizer` and `lr_scheduler` replace the
    default optimizer and schedule (zoo/tasks/optim.py); clip and freezing apply to any.

    Args:
        lr: learning rate of the default AdamW.
        weight_decay: weight decay of matrices (vectors get none).
        warmup_steps: linear warm-up of the default schedule, in optimizer steps.
        grad_clip: gradient-norm clip (0 disables).
        frozen: prefixes of the policy's parameter names (as `model.named_parameters()` spells them, e.g.
            "text_embed", "text_head.output") kept fixed during RL: no gradient, not in the optimizer.
            Each prefix must name at least one parameter. Why: the policy gradient of the tiny model is
            largest, and noisiest, in the input embedding (docs/rl.md).
    """

    lr: float = 1e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float = 1.0
    frozen: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.weight_decay < 0 or self.warmup_steps < 0 or self.grad_clip < 0:
            raise ValueError(f"OptimConfig needs lr > 0, weight_decay, warmup_steps, grad_clip >= 0: {self}")

    def freeze(self, model: UnifiedModel) -> None:
        """Take the `frozen` parameters out of training (refusing a prefix that names none)."""
        names = [n for n, _ in model.named_parameters()]
        for prefix in self.frozen:
            hits = [n for n in names if n == prefix or n.startswith(prefix + ".")]
            if not hits:
                roots = sorted({n.split(".")[0] for n in names})
                raise ValueError(
                    f"frozen: {prefix!r} names no parameter of the model (expected a prefix of "
                    f"model.named_parameters(), e.g. one of {roots})"
                )
            for name, p in model.named_parameters():
                if name in hits:
                    p.requires_grad_(False)

    def refuse_replaced(
        self, optimizer: OptimizerCallable | None, lr_scheduler: LRSchedulerCallable | None
    ) -> None:
        """Refuse `lr` or `warmup_steps` changed while a configured optimizer or schedule makes it unused."""
        refuse_replaced_arguments(OptimConfig, "optimizer", optimizer, {"lr": self.lr})
        schedule = {"warmup_steps": self.warmup_steps}
        refuse_replaced_arguments(OptimConfig, "lr_scheduler", lr_scheduler, schedule)

    def optimizer(
        self,
        model: UnifiedModel,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        """The optimizer over the trainable parameters (decayed matrices, undecayed vectors) and its schedule,
        stepped every optimizer step. None: AdamW at `lr` with betas (0.9, 0.99), and a linear warm-up to a
        constant `lr` over `warmup_steps` (zoo/tasks/optim.py)."""
        self.refuse_replaced(optimizer, lr_scheduler)
        groups = decay_groups(model.parameters(), self.weight_decay)
        adamw = lambda g: torch.optim.AdamW(g, lr=self.lr, betas=(0.9, 0.99))
        built = build_optimizer(groups, optimizer, adamw, "RLTask")
        if lr_scheduler is not None:
            return built, build_schedule(built, lr_scheduler, "RLTask")
        warmup = self.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(built, lambda s: min(1.0, (s + 1) / max(1, warmup)))
        return built, scheduler


@dataclass
class Advantages:
    """A step's groups scored: per rollout (flat, group after group) its advantage and the accuracy WPSM
    reads; which groups had equal rewards; which rollouts are trained."""

    advantages: Tensor
    accuracy: list[float]
    zero_variance: Tensor
    trained: list[int]


class PolicyUpdate:
    """The update of one RL step (see the module docstring).

    Args:
        model: the policy (trained in place).
        loss: the objective and its stabilisers.
        config: batch and update settings.
        temperature: the engine's sampling temperature (the trainer scores under the same).
        reference: the frozen reference policy of a KL term (None: no KL).
    """

    def __init__(
        self,
        model: UnifiedModel,
        loss: PolicyLossConfig,
        config: UpdateConfig,
        temperature: float,
        reference: UnifiedModel | None = None,
    ) -> None:
        self.model, self.loss, self.config = model, loss, config
        self.temperature, self.reference = temperature, reference
        self.tracker = SuccessTracker(config.wpsm_momentum)

    def advantages(
        self, groups: list[list[Rollout]], rewards: Tensor, permutation_seed: int, mask_truncated: bool
    ) -> Advantages:
        """Group advantages of `rewards` `[groups, G]`; `permutation_seed` seeds the no-signal control; a
        rollout is trained unless its group had equal rewards, it is empty, or it was truncated and
        `mask_truncated` (DAPO overlong filtering)."""
        signal = rewards
        if self.config.permute_rewards:  # the no-signal control: seeded by run and step, so reruns repeat it
            generator = torch.Generator().manual_seed(permutation_seed)
            signal = torch.stack([row[torch.randperm(len(row), generator=generator)] for row in rewards])
        advantages, zero_variance = group_advantages(signal)
        accuracy = []
        for group in groups:
            tracked = self.tracker.update(group[0].query.id, [r.reward >= 1.0 for r in group])
            accuracy += [tracked] * len(group)
        g = self.config.group_size
        flat = [r for group in groups for r in group]
        trained = [
            i
            for i, r in enumerate(flat)
            if not bool(zero_variance[i // g])
            and len(r.response_ids) > 0
            and not (r.truncated and mask_truncated)
        ]
        return Advantages(advantages.flatten(), accuracy, zero_variance, trained)

    def modalities(self, rollout: Rollout, token_modality: Callable[[list[int]], list[int]]) -> list[int]:
        """The `Modality` of each response decision: its id's, as its response kind refines it."""
        kind = response_kind(self.model, rollout.prompt_ids)
        return kind.loss_modalities(token_modality(rollout.response_ids))

    def train(
        self,
        rollouts: list[Rollout],
        scored: Advantages,
        token_modality: Callable[[list[int]], list[int]],
        backward: Callable[[Tensor], None],
        optimizer_step: Callable[[], None],
        version: int,
    ) -> dict[str, float]:
        """l_old, then `ppo_epochs` optimizer steps over micro-batches of the trained rollouts; returns
        the step's statistics. token_modality: a `Modality` per response id (per-modality IcePop bounds;
        the response kind may refine it: a video's codes are VIDEO, `ResponseKind.loss_modalities`).
        backward / optimizer_step: Lightning's (clip, step, zero the gradients, step the schedule)."""
        rollouts = [rollouts[i] for i in scored.trained]
        advantages = scored.advantages[scored.trained]
        acc = torch.tensor([scored.accuracy[i] for i in scored.trained])
        config, replay, temperature = self.loss, self.config.router_replay, self.temperature
        with torch.no_grad():
            logp_old = sequence_logprobs(self.model, rollouts, replay=replay, temperature=temperature)
            logp_ref = None
            if self.reference is not None:
                logp_ref = sequence_logprobs(self.reference, rollouts, temperature=temperature)
            extra = {}
            if replay:
                plain = sequence_logprobs(self.model, rollouts, replay=False, temperature=temperature)
                extra["mismatch_kl_without_replay"] = token_k3(plain, rollouts)
        # Tokens an environment fed (tool results) are no decisions of the policy: out of counts and masks.
        total_tokens = sum(sum(r.policy_mask) for r in rollouts)
        total_sequences = len(rollouts)
        stats = LossStats()
        size = self.config.micro_batch_size
        for _ in range(self.config.ppo_epochs):
            for start in range(0, len(rollouts), size):
                part = slice(start, start + size)
                micro = rollouts[part]
                logp_list, entropy_list = sequence_logprobs(
                    self.model, micro, replay=replay, temperature=temperature, with_entropy=True
                )
                logp, mask = pad_sequences(logp_list)
                policy, _ = pad_sequences([torch.tensor(r.policy_mask, device=logp.device) for r in micro])
                mask = mask & policy.bool()
                entropy, _ = pad_sequences(entropy_list)
                old, _ = pad_sequences(logp_old[part])
                inf, _ = pad_sequences([r.inf_logprobs.to(logp.device) for r in micro])
                modality, _ = pad_sequences([torch.tensor(self.modalities(r, token_modality)) for r in micro])
                ref = pad_sequences(logp_ref[part])[0] if logp_ref is not None else None
                adv = advantages[part].to(logp.device)
                weights = None
                if config.wpsm_alpha > 0:
                    mean_entropy = (entropy.detach() * mask).sum(1) / mask.sum(1).clamp_min(1)
                    weights, _ = wpsm_weights(
                        adv, acc[part], mean_entropy, config.wpsm_tau, config.wpsm_eta, config.wpsm_alpha
                    )
                loss, part_stats = policy_loss(
                    config,
                    logp,
                    old.to(logp.device),
                    inf,
                    adv,
                    mask,
                    total_tokens,
                    total_sequences,
                    modality=modality.long().to(logp.device),
                    sequence_weights=weights,
                    entropy=entropy,
                    logp_ref=ref,
                )
                if weights is not None:
                    part_stats.wpsm_masked = float((weights < 1).sum())
                if not torch.isfinite(loss):
                    raise FloatingPointError(
                        f"non-finite RL loss ({loss.item()}) at version {version} (before the update)"
                    )
                backward(loss)
                stats = stats + part_stats
            optimizer_step()
        # Rates over every pass of the step; counts of the step's trained samples and tokens.
        logs = stats.logs()
        logs["trained_samples"] = float(total_sequences)
        logs["trained_tokens"] = float(total_tokens)
        logs.update(extra)
        return logs


def token_k3(train: list[Tensor], rollouts: list[Rollout]) -> float:
    """Token-mean k3 of KL(pi_inf || pi_train) on the sampled tokens (environment tokens left out)."""
    d = torch.cat([t.float() for t in train]) - torch.cat([r.inf_logprobs.float() for r in rollouts])
    sampled = torch.tensor([m for r in rollouts for m in r.policy_mask], dtype=torch.bool, device=d.device)
    d = d[sampled]
    return float((torch.expm1(d) - d).mean()) if d.numel() else 0.0
