"""The rollout side of RL: the inference engine, apart from the trained module (ERNIE 5.0 RL section).

The engine's numerics differ from the trainer's, so three log-probs exist per token (REFERENCES.md part B,
section 2): the engine's l_inf, the trainer's at the old weights l_old and the trainer's now l.

`InferenceEngine` schedules generation on its own copy of the weights (`zoo.rl.policy.PolicyCopy`: float32,
bfloat16 or FP8-emulated, synced after each update). Generation is *continuous*: `start`/`resume` queue
sequences, `step` advances every active one by a token (`zoo.models.decode.text_step` over one KV cache),
finished rows leave the batch and queued rows join it at once (`KVCache.select` / `KVCache.join`). After
`sync` in-flight rows are re-prefilled (prompt + partial response) under the new weights and continue,
each token recording the policy version that sampled it (slime/APRIL partial rollouts, ERNIE U-RB). Per
decision it records l_inf and, per MoE layer, the chosen experts of every position (router replay).

An `Environment` (`zoo.rl.envs.protocol`: a tool) may take part in text responses: after each token the
engine asks it for a token it owes (a tool's result after the policy's call) and feeds that id in place of
a sample, one a step like any other token (same cache, same routing record), marked `Rollout.injected`
with l_inf 0.0; the loss leaves such tokens out (`zoo.rl.update`). Without an environment nothing changes.

What a prompt asks for is its response kind's (`zoo.rl.responses`): text continues in the running batch;
an image or a video (NFSP, one step a scale of a latent frame; a video has `video_frames` frames) or speech
(NCP, one step a frame, until END or `max_audio_frames`) is generated whole the step it is admitted, by the
same loops as `zoo.models.media_generation`.

l_inf is `log_softmax(logits / temperature)` of the sampled token (`zoo.models.sampling`): the engine's
temperature-scaled distribution *before* top-k/top-p filtering (vLLM's raw log-probs; temperature 0 =
greedy records temperature 1). The trainer's `sequence_logprobs` (zoo/rl/replay.py, re-exported here with
the other names of the rollout contract) takes the same temperature, so that l_old - l_inf is the
train/inference mismatch and nothing else.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from zoo.datamodules.sequence import Document
from zoo.models.decode import Cursor, Recording, prefill, routing_per_row, text_step
from zoo.models.kv_cache import KVCache
from zoo.models.sampling import Sampler, check_sampling
from zoo.models.unified import UnifiedModel
from zoo.rl.policy import PolicyCopy, Precision, fp8_round_trip, full_state_dict
from zoo.rl.prompts import Prompt, PromptLayout, is_document
from zoo.rl.records import Rollout
from zoo.rl.responses import RESPONSE_KINDS, MediaLengths, ResponseKind, response_kind, rollout_batch

if TYPE_CHECKING:
    from zoo.rl.envs.protocol import Environment
    from zoo.rl.records import Query

log = logging.getLogger(__name__)

_CACHE_HEADROOM = 32  # columns added at a time when decoding outgrows the cache


@dataclass
class EngineStats:
    """steps: decode steps; row_steps: sum of active rows over them; busy_s: seconds inside `step`;
    prefill_tokens: positions (re-)prefilled; tokens: response tokens sampled."""

    steps: int = 0
    row_steps: int = 0
    busy_s: float = 0.0
    prefill_tokens: int = 0
    tokens: int = 0
    reprefills: int = 0


@dataclass
class _Row:
    """A sequence in the engine. `fed`: positions in the KV cache; the pending token is response[-1], fed
    at time `next_t` in group `next_group` (both equal `fed` for a text prompt)."""

    rollout: Rollout
    kind: ResponseKind
    budget: int
    logprobs: list[float]
    routing: dict[int, list[Tensor]]
    fed: int = 0
    next_t: int = 0
    next_group: int = 0
    done: bool = False  # decided; waits for one last forward that records its final position's routing

    @property
    def recorded(self) -> int:
        return sum(t.shape[0] for t in next(iter(self.routing.values()), []))


class GeneratesToEnd:
    """`generate` for an engine with `pending`, `start` and `step` (`InferenceEngine`, `RayEngineGroup`)."""

    def generate(
        self, prompts: list[Prompt], queries: list[Query], max_new_tokens: list[int] | None = None
    ) -> list[Rollout]:
        """Generate every prompt to the end (blocking); rollouts in the order of the prompts."""
        if self.pending:
            raise RuntimeError(f"generate() needs an idle engine; {self.pending} sequences are in flight")
        rollouts = self.start(prompts, queries, max_new_tokens)
        while self.pending:
            self.step(64)
        return rollouts


class InferenceEngine(GeneratesToEnd):
    """Continuous-batching generation on a private copy of the policy (see the module docstring).

    Args:
        model: the trained UnifiedModel; copied (never shared), in eval mode.
        precision: "float32", "bfloat16" (the copy in bf16, KV cache included; the frozen visual
            tokenizer and audio codec stay float32) or "fp8" (FP8-eligible
            linears and every routed expert rounded through float8_e4m3fn, one scale per tensor/expert;
            router gates, embeddings, norms and the output head stay float32, as in `zoo.parallel`).
        max_new_tokens: response budget per sequence (a rollout may carry a smaller one).
        temperature, top_k, top_p: sampling (`zoo.models.sampling.Sampler`).
        record_routing: record the experts of every position (costs one extra forward per sequence for
            its last token).
        stop_ids: ids that end a response (kept in it); None = `<eos>`; () never stops.
        max_batch: most sequences decoded at once; the rest wait in order (None: no limit).
        seed: the sampling generator's seed.
        max_audio_frames: most codec frames of a speech response (prompts ending with `<boa>`).
        environment: takes part in text responses (a tool answering calls; `zoo.rl.envs.protocol`); None:
            every token is sampled.
        video_frames: frames of a video response (prompts ending with `<bov>` to a model with a causal 3D
            tokenizer), `1 + temporal_stride * k`; None: `1 + temporal_stride` (two latent frames).
    """

    def __init__(
        self,
        model: UnifiedModel,
        precision: Precision = "float32",
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        record_routing: bool = True,
        stop_ids: tuple[int, ...] | None = None,
        max_batch: int | None = None,
        seed: int = 0,
        max_audio_frames: int = 128,
        environment: Environment | None = None,
        video_frames: int | None = None,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        check_sampling(temperature, top_k, top_p)
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 or None, got {max_batch}")
        if max_audio_frames < 1:
            raise ValueError(f"max_audio_frames must be >= 1, got {max_audio_frames}")
        self.max_audio_frames = max_audio_frames
        self.environment = environment
        self.policy = PolicyCopy(model, precision)
        self.lengths = MediaLengths.of(self.model, max_audio_frames, video_frames)
        self.max_new_tokens = max_new_tokens
        self.record_routing, self.max_batch = record_routing, max_batch
        self.layout = PromptLayout(self.model)
        self.stop_ids = (self.model.vocab.eos_id,) if stop_ids is None else tuple(stop_ids)
        self.device = self.policy.device
        self.sampler = Sampler(temperature, top_k, top_p, torch.Generator(self.device).manual_seed(seed))
        self.moe_layers = [i for i, block in enumerate(self.model.backbone.layers) if block.is_moe]
        self.version = 0
        self.stats = EngineStats()
        self._active: list[_Row] = []
        self._waiting: list[_Row] = []
        self._cache: KVCache | None = None
        self._completed: list[Rollout] = []  # completed outside `step` (by `sync`), handed out by it

    @torch.no_grad()
    def sync(self, model: UnifiedModel, version: int) -> None:
        """Copy `model`'s weights (FSDP2-sharded ones are gathered: call on every rank) as policy `version`.

        Sequences in flight are re-prefilled (prompt + partial response) under the new weights at the
        next `step`, and their later tokens carry the new version.
        """
        self.sync_weights(full_state_dict(model), version)

    @torch.no_grad()
    def sync_weights(self, state: dict[str, Tensor], version: int) -> None:
        """`sync` from a plain state dict (`full_state_dict` of the trained model): what an engine in
        another process receives (`zoo.rl.ray_engines`)."""
        if self._active and self.record_routing:
            # Pending tokens are fed once more under the weights that sampled them, so every position's
            # routing is recorded by the policy that produced it; rows only waiting for that are complete.
            begin = time.perf_counter()
            self._decode(sample=False)
            self._completed += self._retire()
            self.stats.busy_s += time.perf_counter() - begin
        self.policy.load(state)
        self.version = version
        if self._active:
            self.stats.reprefills += len(self._active)
            self._waiting = self._active + self._waiting
            self._active, self._cache = [], None

    @property
    def model(self) -> UnifiedModel:
        """The engine's copy of the policy (`PolicyCopy`), in its precision."""
        return self.policy.model

    @property
    def precision(self) -> Precision:
        return self.policy.precision

    # ------------------------------------------------------------------------------------------ queueing

    def start(
        self,
        prompts: list[Prompt],
        queries: list[Query],
        max_new_tokens: list[int] | None = None,
        groups: list[int] | None = None,
    ) -> list[Rollout]:
        """Queue new sequences; returns their Rollouts, filled in as they generate (done when `step`
        returns them). A prompt is unified ids or a `Document` with media (tokenized once per distinct
        prompt object). max_new_tokens: per-sequence budgets (capped by the engine's and the context)."""
        if len(prompts) != len(queries):
            raise ValueError(
                f"{len(prompts)} prompts but {len(queries)} queries: expected one query a prompt"
            )
        budgets = max_new_tokens or [self.max_new_tokens] * len(prompts)
        if len(budgets) != len(prompts):
            raise ValueError(f"max_new_tokens has {len(budgets)} entries for {len(prompts)} prompts")
        rollouts = []
        prepared: dict[int, tuple[Document, list[int]]] = {}  # id(prompt) -> (codes document, laid-out ids)
        for i, (prompt, query, budget) in enumerate(zip(prompts, queries, budgets, strict=True)):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty: start it with at least <bos>")
            if budget < 1:
                raise ValueError(f"max_new_tokens[{i}] = {budget}: expected >= 1")
            document = None
            if is_document(prompt):
                if id(prompt) not in prepared:
                    prepared[id(prompt)] = self.layout.prepare(prompt)
                document, prompt = prepared[id(prompt)]
            else:
                self.model.vocab.check_ids(torch.tensor(prompt), range(0, self.model.vocab.text_head_size))
            group = -1 if groups is None else groups[i]
            rollout = Rollout(query, list(prompt), [], torch.zeros(0), None, [], False, False)
            rollout.max_new_tokens, rollout.group, rollout.prompt_document = budget, group, document
            rollouts.append(rollout)
        self.resume(rollouts)
        return rollouts

    def resume(self, rollouts: list[Rollout]) -> None:
        """Queue partial rollouts (from `interrupt`) to continue under the current weights."""
        for r in rollouts:
            if r.done:
                raise ValueError("cannot resume a rollout that is already finished or truncated")
            if len(r.prompt_ids) > self.model.backbone.max_seq_len:
                raise ValueError(
                    f"prompt of {len(r.prompt_ids)} tokens exceeds the context of "
                    f"{self.model.backbone.max_seq_len} (max_seq_len)"
                )
            tokens = min(r.max_new_tokens or self.max_new_tokens, self.max_new_tokens)
            room = self.model.backbone.max_seq_len - len(r.prompt_ids)
            kind = response_kind(self.model, r.prompt_ids)
            budget = kind.budget(self.model, tokens, self.lengths, room)
            routing: dict[int, list[Tensor]] = {}
            if self.record_routing:
                old = r.routing or {}
                # A rollout exported before its prompt was ever fed has empty [0, 0] entries: nothing to keep.
                routing = {
                    layer: [old[layer]] if layer in old and old[layer].shape[0] else []
                    for layer in self.moe_layers
                }
            row = _Row(r, kind, budget, r.inf_logprobs.tolist(), routing)
            if budget <= len(r.response_ids):
                # The prompt leaves no room (or the budget is spent): say so, never drop it silently.
                log.warning(
                    "prompt of %d tokens leaves no room to generate: empty/truncated", len(r.prompt_ids)
                )
                row.done = r.truncated = True
            self._waiting.append(row)

    @torch.no_grad()
    def interrupt(self) -> list[Rollout]:
        """Stop every queued and active sequence (APRIL's abort) and return their rollouts (plus any
        completed by `sync` and not yet handed out by `step`).

        Active rows first get one forward without sampling, which records the routing of their pending
        token: a partial rollout then holds the routing of all its positions, and a row that was only
        waiting for that forward comes back complete (`done`), not partial."""
        begin = time.perf_counter()
        if self._active and self.record_routing:
            self._decode(sample=False)
        rows, self._active, self._waiting, self._cache = self._active + self._waiting, [], [], None
        completed, self._completed = self._completed, []
        self.stats.busy_s += time.perf_counter() - begin
        return completed + [self._export(row) for row in rows]

    def in_flight(self) -> list[Rollout]:
        """The rollouts queued or active, brought up to date (tokens, l_inf, routing so far) and left in
        place: what a checkpoint stores so that they can `resume` after a restart."""
        return [self._export(row) for row in self._active + self._waiting]

    @property
    def generator(self) -> torch.Generator:
        """The sampling generator (its state travels in RL checkpoints)."""
        return self.sampler.generator

    def rng_state(self) -> Tensor:
        """The sampling generator's state (`RLTask` checkpoints it: a resumed run samples the same)."""
        return self.generator.get_state()

    def load_rng_state(self, state: Tensor) -> None:
        self.generator.set_state(state)

    def close(self) -> None:
        """Nothing to release in-process (a `RolloutEngine` method: engine actors are stopped by it)."""

    @property
    def pending(self) -> int:
        """Sequences queued or active, or completed by `sync` and not yet handed out by `step`."""
        return len(self._active) + len(self._waiting) + len(self._completed)

    @property
    def active(self) -> int:
        return len(self._active)

    # ------------------------------------------------------------------------------------------ stepping

    @torch.no_grad()
    def step(self, n_steps: int = 1) -> list[Rollout]:
        """Advance every active sequence by one token, `n_steps` times (queued ones join when a slot is
        free). Returns the rollouts completed in these steps."""
        completed, self._completed = self._completed, []
        begin = time.perf_counter()
        for _ in range(n_steps):
            if not self.pending:
                break
            completed += self._admit()
            completed += self._retire()  # rows the prefill completed (no room left, resumed at the end)
            if self._active:
                self._decode()
                completed += self._retire()
        self.stats.busy_s += time.perf_counter() - begin
        return completed

    def _admit(self) -> list[Rollout]:
        """Prefill the queued rows that fit; returns the image rollouts, generated whole here."""
        free = len(self._waiting) if self.max_batch is None else self.max_batch - len(self._active)
        rows, self._waiting = self._waiting[: max(free, 0)], self._waiting[max(free, 0) :]
        completed, whole = [], [r for r in rows if r.kind.whole and not r.done]
        for kind in RESPONSE_KINDS:  # media: generated whole here, never waiting in the batch
            picked = [r for r in whole if r.kind is kind]
            if picked:
                completed += self._generate_whole(kind, picked)
        rows = [r for r in rows if all(r is not w for w in whole)]
        if not rows:
            return completed
        parts = [(r.rollout.prompt_document, r.rollout.prompt_ids, r.rollout.response_ids) for r in rows]
        batch = rollout_batch(self.layout, parts, left=True)
        out, cursor, cache = prefill(self.model, batch, extra=0)
        self.stats.prefill_tokens += sum(self._length(r) for r in rows)
        if self.record_routing:
            for row, routing in zip(rows, routing_per_row(out, batch), strict=True):
                kept = row.recorded  # positions recorded before an interruption are kept
                for layer, chosen in routing.items():
                    row.routing[layer].append(chosen[kept:])
        for row, length, t, group in zip(rows, map(self._length, rows), *self._listed(cursor), strict=True):
            row.fed, row.next_t, row.next_group = length, t, group
        sample = [i for i, r in enumerate(rows) if not r.done]
        if sample:
            self._sample([rows[i] for i in sample], self.model.sampling_logits(out.hidden[sample, -1]))
        self._merge(rows, cache)
        return completed

    @staticmethod
    def _listed(cursor: Cursor) -> tuple[list[int], list[int]]:
        return cursor.t.tolist(), cursor.group.tolist()

    def _generate_whole(self, kind: ResponseKind, rows: list[_Row]) -> list[Rollout]:
        """A media kind's responses, generated whole (`ResponseKind.generate`), with l_inf and the routing
        of every position."""
        recording = Recording(len(rows), self.record_routing)
        prompts = [r.rollout.prompt_ids for r in rows]
        generated = kind.generate(self.model, prompts, [r.budget for r in rows], self.sampler, recording)
        for i, row in enumerate(rows):
            r = row.rollout
            r.response_ids = generated.responses[i]
            r.versions = [self.version] * len(r.response_ids)
            r.finished, r.truncated, row.done = generated.finished[i], not generated.finished[i], True
            row.logprobs += recording.logprobs[i]
            for layer, chosen in recording.routing(i).items():
                row.routing[layer].append(chosen)
        self.stats.prefill_tokens += sum(len(p) for p in prompts)
        self.stats.steps += generated.steps
        self.stats.row_steps += generated.row_steps
        self.stats.tokens += sum(len(response) for response in generated.responses)
        return [self._export(row) for row in rows]

    def _decode(self, sample: bool = True) -> None:
        rows = self._active
        cache = self._cache
        if cache.length + 1 > cache.max_len:
            cache.grow(_CACHE_HEADROOM)
        ids = torch.tensor([[r.rollout.response_ids[-1]] for r in rows], device=self.device)
        cursor = Cursor.at([r.next_t for r in rows], [r.next_group for r in rows], self.device)
        out, batch = text_step(self.model, cache, ids, cursor)
        for row in rows:
            row.fed, row.next_t, row.next_group = row.fed + 1, row.next_t + 1, row.next_group + 1
        if self.record_routing:
            for row, routing in zip(rows, routing_per_row(out, batch), strict=True):
                for layer, chosen in routing.items():
                    row.routing[layer].append(chosen)
        sample = [i for i, r in enumerate(rows) if not r.done] if sample else []
        if sample:
            self._sample([rows[i] for i in sample], self.model.sampling_logits(out.hidden[sample, -1]))
        self.stats.steps += 1
        self.stats.row_steps += len(rows)

    def _sample(self, rows: list[_Row], logits: Tensor) -> None:
        """Each row's next token: sampled, or the one its environment owes it (l_inf 0.0, `injected`)."""
        env = self.environment
        forced = [None if env is None else env.forced_token(row.rollout) for row in rows]
        free = [i for i, token in enumerate(forced) if token is None]
        tokens: list[int | None] = list(forced)
        logprobs = [0.0] * len(rows)
        if free:
            picked = logits if len(free) == len(rows) else logits[free]
            sampled = self.sampler.sample(picked)
            scores = self.sampler.logprob(picked, sampled).tolist()
            for i, token, logprob in zip(free, sampled.tolist(), scores, strict=True):
                tokens[i], logprobs[i] = token, logprob
        for row, token, logprob, by_env in zip(rows, tokens, logprobs, forced, strict=True):
            r = row.rollout
            r.response_ids.append(token)
            r.versions.append(self.version)
            row.logprobs.append(logprob)
            if by_env is not None and not r.injected:
                r.injected = [False] * (len(r.response_ids) - 1)
            if r.injected:
                r.injected.append(by_env is not None)
            if by_env is None and token in self.stop_ids:
                r.finished = row.done = True
            elif len(r.response_ids) >= row.budget:
                r.truncated = row.done = True
        self.stats.tokens += len(rows)

    def _retire(self) -> list[Rollout]:
        """Rows whose last position has been fed (or that need no routing) leave the batch."""
        keep, done = [], []
        for i, row in enumerate(self._active):
            complete = row.done and (not self.record_routing or row.fed == row.recorded == self._length(row))
            (done if complete else keep).append(i)
        if not done:
            return []
        finished = [self._export(self._active[i]) for i in done]
        self._active = [self._active[i] for i in keep]
        if not keep:
            self._cache = None
            return finished
        self._cache.select(keep)
        return finished

    @staticmethod
    def _length(row: _Row) -> int:
        return len(row.rollout.prompt_ids) + len(row.rollout.response_ids)

    def _export(self, row: _Row) -> Rollout:
        r = row.rollout
        r.inf_logprobs = torch.tensor(row.logprobs, dtype=torch.float32)
        if self.record_routing:
            r.routing = {
                layer: torch.cat(chunks) if chunks else torch.zeros(0, 0, dtype=torch.long)
                for layer, chunks in row.routing.items()
            }
        return r

    # ------------------------------------------------------------------------------------------ the cache

    def _merge(self, rows: list[_Row], new: KVCache) -> None:
        """Join freshly prefilled rows to the running batch: every row's entries end at one column."""
        caches = [new] if self._cache is None else [self._cache, new]
        self._cache = KVCache.join(caches, headroom=_CACHE_HEADROOM)
        self._active = self._active + rows


# The trainer side (router replay) lives in zoo/rl/replay.py; re-exported here for the contract's name.
from zoo.rl.replay import mismatch_kl, routing_agreement, sequence_logprobs  # noqa: E402

__all__ = [
    "EngineStats",
    "InferenceEngine",
    "fp8_round_trip",
    "full_state_dict",
    "mismatch_kl",
    "routing_agreement",
    "sequence_logprobs",
]
