"""Unified pretraining (ERNIE 5.0 section 3): one next-group objective over every modality, elastic.

The LightningModule owns what `zoo.models` leaves out: losses summed and logged per head and per
modality, router statistics per modality (recorded beside routing, never fed into it), the elastic
sub-model drawn per step, the optimiser and its schedule, and text generation for `zoo predict`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

import lightning as L
import torch
from torch import Tensor

from zoo.analysis.routing import load_entropy
from zoo.batch import GroupBatch, Modality
from zoo.config import save_config_hyperparameters
from zoo.expert_parallel import clip_grad_norm_
from zoo.inference.best_of import check_best_of
from zoo.init_from import hand_over_tokenizer, load_starting_weights
from zoo.models.backbone import BackboneOutput
from zoo.models.elastic import ElasticSampler
from zoo.models.refinement import ImageRefinement, RefinerSettings
from zoo.models.unified import UnifiedModel
from zoo.parallel import Parallelism, gathered, is_sharded, parallelize
from zoo.tasks.optim import (
    LRSchedulerCallable,
    OptimizerCallable,
    build_optimizer,
    decay_groups,
    lightning_optimizers,
    refuse_replaced_arguments,
)
from zoo.tasks.tokenizer_state import restore_tokenizer, save_tokenizer

# Lightning suggests ignoring injected modules in save_hyperparameters; doing so breaks load_from_checkpoint
# (DESIGN.md), and the task stores their config instead of the objects, so the advice does not apply.
warnings.filterwarnings("ignore", message="Attribute 'model' is an instance of `nn.Module`")


@dataclass(frozen=True)
class SamplingConfig:
    """How `predict` and the sample callback generate: text, and media when the model has tokenizers.

    cfg_scale: classifier-free guidance weight of image and video generation (0: off).
    media_top_k: top-k of visual codes and audio levels (small codebooks want a tight filter).
    max_audio_frames: longest generated audio, in codec frames.
    refiner: the diffusion refiner applied to generated images and video frames after the tokenizer's decode
        (`zoo.models.refinement`; None: the decode as it is).
    best_of, audio_best_of: draw this many images (videos) / utterances a prompt and keep the one the model
        reads back as the prompt's caption most likely (`zoo.inference.best_of`; 1: one sample).
    """

    max_new_tokens: int = 48
    temperature: float = 0.8
    top_k: int | None = None
    top_p: float | None = 0.95
    cfg_scale: float = 2.0
    media_top_k: int | None = 8
    max_audio_frames: int = 160
    refiner: RefinerSettings | None = None
    best_of: int = 1
    audio_best_of: int = 1

    def __post_init__(self) -> None:
        check_best_of(best_of=self.best_of, audio_best_of=self.audio_best_of)


def router_statistics(output: BackboneOutput, batch: GroupBatch, n_experts: int) -> dict[str, Tensor]:
    """Per modality, averaged over MoE layers: the normalised entropy of expert load and the busiest
    expert's share. Only valid (non-padding) tokens were routed, in row-major order."""
    if not output.router:
        return {}
    modality = batch.modality[batch.valid]
    stats: dict[str, list[Tensor]] = {}
    for _, r in output.router:
        for m in Modality:
            chosen = r.indices[modality == m]
            if chosen.numel() == 0:
                continue
            load = torch.bincount(chosen.flatten(), minlength=n_experts).float()
            name = m.name.lower()
            stats.setdefault(f"router/{name}/load_entropy", []).append(load_entropy(load))
            stats.setdefault(f"router/{name}/max_load", []).append(load.max() / load.sum())
    return {k: torch.stack(v).mean() for k, v in stats.items()}


class UnifiedPretraining(L.LightningModule):
    """Trains a `UnifiedModel` on group batches.

    Args:
        model: the unified model (backbone, embedders, heads).
        elastic: draws a sub-model per training step (None: always the full model).
        lr: peak AdamW learning rate.
        weight_decay: decoupled weight decay of matrices (norms and biases are not decayed).
        betas: AdamW betas.
        warmup_steps: linear warm-up, then cosine decay to `min_lr_ratio * lr` at the last step.
        min_lr_ratio: the final learning rate as a fraction of `lr`.
        sampling: generation settings of `predict` and the sample callback.
        parallel: FSDP2, FP8, activation checkpointing, compile and the attention backend, applied in
            `configure_model` (zoo.parallel).
        optimizer: builds the optimizer from the parameter groups (decayed matrices, undecayed vectors), e.g.
            `{class_path: torch.optim.SGD, init_args: {lr: 0.1}}`; None: AdamW with `lr` and `betas`
            (zoo/tasks/optim.py).
        lr_scheduler: builds the schedule from the optimizer, stepped every step; None: warm-up-cosine with
            `warmup_steps` and `min_lr_ratio`.
        init_from: starting weights (continued pretraining, SFT; `zoo.init_from`): a Lightning checkpoint, an
            exported folder or a hub id, loaded strictly when the task is built; its tokenizer, if it has
            one, replaces the datamodule's at setup.
    """

    # With parallel.fsdp, `zoo fit` builds the model on `meta` and `configure_model` materialises each rank's
    # shards with the single-process weights (zoo.meta_init): per-rank memory falls with the ranks.
    meta_init_with_fsdp: ClassVar[bool] = True

    def __init__(
        self,
        model: UnifiedModel,
        elastic: ElasticSampler | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 50,
        min_lr_ratio: float = 0.1,
        sampling: SamplingConfig = SamplingConfig(),
        parallel: Parallelism = Parallelism(),
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        init_from: str | None = None,
    ) -> None:
        super().__init__()
        save_config_hyperparameters(self)  # configs, never pickled modules (zoo.config)
        refuse_replaced_arguments(type(self), "optimizer", optimizer, {"lr": lr, "betas": betas})
        schedule = {"warmup_steps": warmup_steps, "min_lr_ratio": min_lr_ratio}
        refuse_replaced_arguments(type(self), "lr_scheduler", lr_scheduler, schedule)
        self.optimizer_callable, self.lr_scheduler_callable = optimizer, lr_scheduler
        self.model = model
        self.elastic = elastic
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.warmup_steps, self.min_lr_ratio = warmup_steps, min_lr_ratio
        self.sampling = sampling
        self.parallel = parallel
        self.init_tokenizer = load_starting_weights(model, init_from).tokenizer if init_from else None

    def configure_model(self) -> None:
        # Lightning may call this more than once (fit then test); parallelize skips what is already done.
        parallelize(self.model, self.parallel, self.device_mesh)

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        # Expert parallelism leaves gradients on two device meshes, which torch's clip_grad_norm_ cannot mix.
        by_norm = gradient_clip_algorithm in (None, "norm")
        if self.parallel.expert_parallel > 1 and gradient_clip_val and by_norm:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            clip_grad_norm_(params, gradient_clip_val)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        hand_over_tokenizer(self.init_tokenizer, datamodule, self.model.vocab)
        vocab = getattr(datamodule, "vocab", None)
        if vocab is not None and vocab != self.model.vocab:
            raise ValueError(
                f"the data's vocabulary {vocab} differs from the model's {self.model.vocab}: "
                "give both the same `vocab`"
            )
        seq_len = getattr(getattr(datamodule, "builder", None), "seq_len", None)
        max_seq_len = self.model.backbone.max_seq_len
        if seq_len is not None and seq_len > max_seq_len:
            raise ValueError(
                f"data.seq_len={seq_len} exceeds the backbone's max_seq_len={max_seq_len}: lower "
                "data.init_args.seq_len or raise model...backbone.init_args.max_seq_len"
            )

    def _decode_with_data_tokenizer(self) -> None:
        """Generation samples only text ids the data's tokenizer decodes (after any checkpoint restore)."""
        tokenizer = getattr(getattr(self._trainer, "datamodule", None), "tokenizer", None)
        if tokenizer is not None:
            self.model.decode_text_with(tokenizer.vocab_size)

    def on_train_start(self) -> None:
        self._decode_with_data_tokenizer()

    def on_predict_start(self) -> None:
        self._decode_with_data_tokenizer()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        save_tokenizer(self._trainer, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        restore_tokenizer(self._trainer, checkpoint)

    def _step(self, batch: GroupBatch, split: str) -> Tensor:
        backbone = self.model.backbone
        elastic = None
        if split == "train" and self.elastic is not None:
            elastic = self.elastic.sample(
                self.global_step, backbone.n_layers, backbone.n_experts, backbone.top_k
            )
        out = self.model(batch, elastic=elastic)
        if not torch.isfinite(out.loss):
            # Stop before the optimiser step: the weights (and any checkpoint) stay as they were.
            raise FloatingPointError(
                f"non-finite {split} loss ({out.loss.item()}) at global step {self.global_step}, "
                f"batch of {batch.batch_size} rows; training stopped before updating the weights"
            )
        logs = {f"{split}/loss": out.loss.detach()}
        for name, head in out.heads.items():
            logs[f"{split}/{name}_loss"] = head.loss.detach()
            logs.update({f"{split}/{k}": v for k, v in head.metrics.items()})
        if out.backbone.router:
            if split == "train":  # the router computes its balancing losses only when gradients flow
                logs["train/aux_loss"] = out.backbone.aux_loss.detach()
                logs["train/z_loss"] = out.backbone.z_loss.detach()
            logs.update(
                {
                    f"{split}/{k}": v
                    for k, v in router_statistics(out.backbone, batch, backbone.n_experts).items()
                }
            )
        if elastic is not None:
            depth = backbone.n_layers if elastic.layers is None else len(elastic.layers)
            logs["train/elastic_depth"] = float(depth)
            logs["train/elastic_top_k"] = float(elastic.top_k or backbone.top_k)
        on_step = split == "train"
        self.log_dict(
            logs, on_step=on_step, on_epoch=not on_step, batch_size=batch.batch_size, sync_dist=not on_step
        )
        if on_step:
            self.log("loss", out.loss.detach(), prog_bar=True, logger=False, batch_size=batch.batch_size)
        return out.loss

    def training_step(self, batch: GroupBatch, batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: GroupBatch, batch_idx: int) -> Tensor:
        loss = self._step(batch, "val")
        self.log("val_loss", loss, prog_bar=True, logger=False, batch_size=batch.batch_size, sync_dist=True)
        return loss

    def test_step(self, batch: GroupBatch, batch_idx: int) -> Tensor:
        return self._step(batch, "test")

    def sample(self, prompts: list[list[int]], generator: torch.Generator | None = None) -> list[list[int]]:
        """Continuations of unified-id prompts with the `sampling` settings; safe under FSDP2."""
        s, sharded = self.sampling, is_sharded(self.model)
        # A sharded forward is a collective: every rank must run as many steps as the others, so no rank
        # may stop early at <eos>; the outputs are cut at <eos> afterwards instead.
        stop_ids = () if sharded else None
        with gathered(self.model) as model:
            outputs = model.generate(
                prompts, s.max_new_tokens, s.temperature, s.top_k, s.top_p, None, True, stop_ids, generator
            )
        if sharded:
            eos = self.model.vocab.eos_id
            outputs = [out[: out.index(eos) + 1] if eos in out else out for out in outputs]
        return outputs

    def refinement(self) -> ImageRefinement | None:
        """The `sampling.refiner`, loaded on first use (a plain attribute: never in the state dict)."""
        settings = self.sampling.refiner
        if settings is None:
            return None
        if getattr(self, "_refinement", None) is None:  # an ImageRefinement is no nn.Module: not registered
            self._refinement = settings.load(self.device)
        return self._refinement

    def predict_step(self, batch: list, batch_idx: int) -> list[dict[str, object]]:
        """Generate a continuation of each prompt (unified ids); decoded when the datamodule can decode.
        Media requests (`zoo.datamodules.requests.MediaRequest`) get images, videos, audio or captions."""
        datamodule = getattr(self.trainer, "datamodule", None)
        if not isinstance(batch, list):  # media requests (zoo.datamodules.requests.MediaRequests)
            from zoo.tasks.multimodal_eval import answer_requests

            s = self.sampling
            with gathered(self.model) as model:
                return answer_requests(
                    model, datamodule, batch, s.cfg_scale, s.temperature, s.media_top_k,
                    s.max_new_tokens, s.max_audio_frames, self.refinement(), s.best_of, s.audio_best_of,
                )
        limit, budget = self.model.backbone.max_seq_len, self.sampling.max_new_tokens
        fitting = [p for p in batch if len(p) + budget <= limit]
        outputs = iter(self.sample(fitting) if fitting else [])
        decode = getattr(datamodule, "decode", None)
        score = getattr(datamodule, "score_text", None)
        results = []
        for prompt in batch:
            row: dict[str, object] = {"prompt_ids": prompt}
            if decode is not None:
                row["prompt"] = decode(prompt)
            if len(prompt) + budget > limit:  # reported, and the other prompts are still answered
                row["error"] = (
                    f"the prompt has {len(prompt)} tokens and max_new_tokens is {budget}: "
                    f"{len(prompt) + budget} exceed the model's max_seq_len of {limit}; shorten the prompt "
                    "or lower --model.init_args.sampling.max_new_tokens"
                )
            else:
                row["ids"] = ids = next(outputs)
                if decode is not None:
                    row["text"] = decode(ids)
                    if score is not None:
                        row["scores"] = score(row["prompt"] + row["text"])
            results.append(row)
        return results

    def configure_optimizers(self):  # noqa: ANN201 (Lightning's union of return types)
        groups = decay_groups(self.model.parameters(), self.weight_decay)
        adamw = lambda g: torch.optim.AdamW(g, lr=self.lr, betas=self.betas)
        optimizer = build_optimizer(groups, self.optimizer_callable, adamw, type(self).__name__)
        total = lambda: self.trainer.estimated_stepping_batches  # lazily: Lightning#20550, see schedules.py
        schedule = self.lr_scheduler_callable
        return lightning_optimizers(optimizer, schedule, self.warmup_steps, total, self.min_lr_ratio)
