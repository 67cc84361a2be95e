"""Scoring for RL: rewards of rollouts from the verifier pool, and what validation generates and scores.

`Scorer.submit` queues a rollout's verifier call the moment the engine finishes it (the scheduler's
`on_complete`), so with `verifier_workers > 0` scoring runs while the longer rollouts still generate;
`Scorer.rewards` collects a step's rewards (a failing verifier gives 0 and is counted; a truncated
response per `ScoringConfig.truncated`). What a verifier reads is the response kind's
(`zoo.rl.responses`: the completion text, decoded pixels or a decoded waveform). With
`ScoringConfig.reward = "reading"` media rollouts are rewarded instead by a frozen reader's reading of them
(`zoo.rl.reading_reward`), and the verifiers only validate.

`respond` is validation's generation: the trained model (not the engine) answers held-out prompts, each
response kind with its own loop, with `safe_verify` scoring the answers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from zoo.inference.best_of import prompt_caption
from zoo.models.sampling import Sampler
from zoo.models.unified import UnifiedModel
from zoo.rl.prompts import Prompt, PromptLayout, is_document
from zoo.rl.reading_reward import ReadingReward
from zoo.rl.records import Rollout
from zoo.rl.responses import RESPONSE_KINDS, TEXT, MediaLengths, response_kind
from zoo.rl.verifiers import VerifierPool, verifier_for

if TYPE_CHECKING:
    from zoo.rl.engines import ScoringPool
    from zoo.rl.envs.protocol import Environment


@dataclass(frozen=True)
class ScoringConfig:
    """How rollouts are rewarded and held-out queries validated.

    Args:
        reward: what rewards a rollout: "verifier" (the task's verifier), or "reading" (caption-to-media
            tasks only: how likely a frozen copy of the starting policy reads the drawn image, video or
            speech back as its caption, `zoo.rl.reading_reward`; no verifier takes part in training, the
            held-out queries are still validated by theirs).
        truncated: a response cut by its budget: "zero_reward" scores it 0, "mask" leaves it out of the loss
            (DAPO overlong filtering), "keep" scores it as it is.
        verifier_workers: verifier worker processes (0: inline).
        verifier_timeout_s: longest a verifier call may take.
        val_max_new_tokens: generation budget (text tokens) on held-out queries.
    """

    reward: Literal["verifier", "reading"] = "verifier"
    truncated: Literal["zero_reward", "mask", "keep"] = "zero_reward"
    verifier_workers: int = 0
    verifier_timeout_s: float = 10.0
    val_max_new_tokens: int = 24

    def __post_init__(self) -> None:
        if self.reward not in ("verifier", "reading"):
            raise ValueError(f"reward must be 'verifier' or 'reading', got {self.reward!r}")
        if self.truncated not in ("zero_reward", "mask", "keep"):
            raise ValueError(f"truncated must be 'zero_reward', 'mask' or 'keep', got {self.truncated!r}")
        if self.verifier_workers < 0 or self.verifier_timeout_s <= 0 or self.val_max_new_tokens < 1:
            raise ValueError(
                "ScoringConfig needs verifier_workers >= 0, verifier_timeout_s > 0 and "
                f"val_max_new_tokens >= 1, got {self}"
            )


class Scorer:
    """The reward calls of rollouts: `submit` as each finishes, `rewards` of a step's batch.

    Args:
        model: the policy (response kinds decode media responses with its frozen tokenizers).
        config: the reward, truncation policy and verifier pool settings.
        pool: where verifier calls run (a `RolloutBackend.verifier_pool`, e.g. Ray actors); None: a
            `VerifierPool` of `config.verifier_workers` local workers.
        reader: the frozen model that reads media rollouts, required by `config.reward == "reading"`.
    """

    def __init__(
        self,
        model: UnifiedModel,
        config: ScoringConfig,
        pool: ScoringPool | None = None,
        reader: UnifiedModel | None = None,
    ) -> None:
        self.model, self.config = model, config
        if pool is None:
            pool = VerifierPool(config.verifier_workers, config.verifier_timeout_s)
        self.pool = pool
        if (config.reward == "reading") != (reader is not None):
            needs = "needs a reader" if reader is None else "takes no reader (reward 'reading' does)"
            raise ValueError(f"reward {config.reward!r} {needs}")
        self.errors = 0  # failed verifier calls collected since the last `reset_errors`
        self._tickets: dict[int, int] = {}  # id(rollout) -> verifier ticket, submitted as it finished
        self._base_lengths: dict[str, int] = {}  # query id -> positions of its prompt without a hint
        self._builder = PromptLayout(model).builder
        self.reading = ReadingReward(reader, self._builder) if reader is not None else None

    @property
    def in_flight(self) -> int:
        """Verifier calls submitted and not yet collected."""
        return len(self._tickets)

    def submit(self, rollout: Rollout, source: object) -> None:
        """Queue the verifier call of a finished rollout (its hint length is set first: the verifier of a
        hinted caption reads the hint and the response)."""
        rollout.hint_len = len(rollout.prompt_ids) - self._base_length(rollout.query, source)
        kind = response_kind(self.model, rollout.prompt_ids)
        if self.reading is not None:  # what was asked for, the prompt's caption, as the medium reads back
            medium = kind.reading_segment(self.model, rollout, source)
            caption = prompt_caption(rollout.prompt_ids[: len(rollout.prompt_ids) - rollout.hint_len])
            self._tickets[id(rollout)] = self.reading.submit(caption, medium)
            return
        output = kind.verifier_input(self.model, rollout, source)
        self._tickets[id(rollout)] = self.pool.submit(verifier_for(rollout.query.task), rollout.query, output)

    def _base_length(self, query: object, source: object) -> int:
        """Positions of the query's prompt without a hint, as the engine lays it out."""
        if query.id not in self._base_lengths:
            prompt = source.base_prompt(query)
            length = self._builder.length(prompt) if is_document(prompt) else len(prompt)
            self._base_lengths[query.id] = length
        return self._base_lengths[query.id]

    def rewards(self, rollouts: list[Rollout], submit: Callable[[Rollout], None]) -> list[float]:
        """Rewards of rollouts (set on them too). Rollouts submitted as they finished are collected; the
        others (e.g. restored from a checkpoint) are submitted now, through `submit`."""
        for r in rollouts:
            if id(r) not in self._tickets:
                submit(r)
        tickets = [self._tickets.pop(id(r)) for r in rollouts]
        results = (self.reading or self.pool).collect(tickets)
        rewards = []
        for r, ticket in zip(rollouts, tickets, strict=True):
            reward = results[ticket].reward
            if r.truncated and self.config.truncated == "zero_reward":
                reward = 0.0
            r.reward = reward
            rewards.append(reward)
        self.errors += sum(not results[t].ok for t in tickets)
        return rewards

    def close(self) -> None:
        self.pool.close()


@torch.no_grad()
def respond(
    model: UnifiedModel,
    prompts: list[Prompt],
    decode: Callable[[list[int]], str],
    max_new_tokens: int,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    max_audio_frames: int = 128,
    environment: Environment | None = None,
    video_frames: int | None = None,
) -> list[object]:
    """What verifiers read from `model` (not an engine) for each prompt: the completion text (`decode` of
    the response ids) of unified-id or media prompts, the pixels (float `[3, H, W]` numpy) of prompts that
    ask for an image (NFSP, no guidance), the frames (float `[3, T, H, W]` numpy, `video_frames` of them:
    `MediaLengths.of`) of prompts that ask for a video, the waveform (float numpy) of prompts that ask for
    speech (NCP, up to `max_audio_frames`). temperature 0 is greedy. Each kind generates its prompts
    together, media kinds first (as the engine does). An `environment` (a tool) takes part in the text
    responses."""
    sampler = Sampler(temperature, top_k, top_p, generator)
    lengths = MediaLengths.of(model, max_audio_frames, video_frames)
    kinds = [response_kind(model, p) for p in prompts]
    outputs: list[object] = [None] * len(prompts)
    for kind in (*RESPONSE_KINDS, TEXT):
        picked = [i for i, k in enumerate(kinds) if k is kind]
        if picked:
            asked = [prompts[i] for i in picked]
            if kind is TEXT and environment is not None:
                said = environment.respond(model, asked, decode, max_new_tokens, sampler)
            else:
                said = kind.respond(model, asked, decode, max_new_tokens, sampler, lengths)
            for i, output in zip(picked, said, strict=True):
                outputs[i] = output
    return outputs


def safe_verify(query: object, output: object) -> float:
    """A held-out reward: a verifier failure (or a non-finite reward) costs the sample, not the run."""
    try:
        value = float(verifier_for(query.task)(query, output))
    except Exception:
        return 0.0
    return value if math.isfinite(value) else 0.0
