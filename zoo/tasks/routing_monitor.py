"""The routing analysis during training (issue 7 item 1; ERNIE 5.0's routing figures, as training curves).

`RoutingMonitor` records the router's expert choices with forward hooks on the MoE layers, beside routing
and never fed into it: every `every_n_steps` training steps from that step's batch (the sub-model the
elastic sampler drew, as trained), and over each whole validation epoch (the full model). It logs the
scalars of `zoo.analysis.routing` (normalised entropy of the expert load per layer and per modality, IoU of
the modalities' top-25% experts) as `routing/{train,val}/...`, and the expert heatmap as an image when a
TensorBoard logger is attached.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.utils.hooks import RemovableHandle

from zoo.analysis.routing import TOP_FRACTION, RoutingCounts, moe_layers
from zoo.batch import GroupBatch


class RoutingMonitor(L.Callback):
    """Logs routing statistics by modality: NE of the expert load, top-expert IoU, the heatmap.

    Args:
        every_n_steps: record one training batch every this many optimiser steps (0: never in training).
        on_validation: also record every validation epoch, over all its batches (sanity checks excepted).
        top_fraction: the share of experts that counts as a modality's "top" experts for the IoU.
        log_image: add the expert heatmap to TensorBoard (when a TensorBoardLogger is attached).
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        on_validation: bool = True,
        top_fraction: float = TOP_FRACTION,
        log_image: bool = True,
    ) -> None:
        if every_n_steps < 0:
            raise ValueError(f"every_n_steps={every_n_steps}: expected >= 0 (0 disables training records)")
        if not 0.0 < top_fraction <= 1.0:
            raise ValueError(f"top_fraction={top_fraction}: expected a value in (0, 1]")
        self.every_n_steps, self.on_validation = every_n_steps, on_validation
        self.top_fraction, self.log_image = top_fraction, log_image
        self._handles: list[RemovableHandle] = []
        self._captured: dict[int, Any] = {}
        self._counts: RoutingCounts | None = None

    # -- hooks on the MoE layers -----------------------------------------------------------------------
    def _attach(self, pl_module: L.LightningModule) -> RoutingCounts:
        model = pl_module.model
        layers, n_experts = moe_layers(model)
        self._detach()
        for i in layers:
            self._handles.append(model.backbone.layers[i].ffn.register_forward_hook(self._hook(i)))
        return RoutingCounts(layers, n_experts)

    def _hook(self, layer: int):  # noqa: ANN202 (a torch forward hook)
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            # Activation checkpointing re-runs the forward in backward: the same choices, kept once.
            self._captured[layer] = output.router.indices.detach()

        return hook

    def _detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._captured = [], {}

    def _count(self, batch: Any) -> None:
        captured, self._captured = self._captured, {}
        if self._counts is None or not isinstance(batch, GroupBatch):
            return
        modality = batch.modality[batch.valid]
        for layer, indices in captured.items():
            if indices.shape[0] != modality.shape[0]:
                rank_zero_warn(
                    f"RoutingMonitor: layer {layer} routed {indices.shape[0]} tokens for a batch of "
                    f"{modality.shape[0]} valid positions; that batch is left out"
                )
                return
        for layer, indices in captured.items():
            self._counts.add(layer, indices, modality)
        self._counts.tokens += modality.long().cpu().bincount(minlength=len(self._counts.tokens))

    # -- training --------------------------------------------------------------------------------------
    def _due(self, trainer: L.Trainer) -> bool:
        return self.every_n_steps > 0 and trainer.global_step % self.every_n_steps == 0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._due(trainer):
            self._counts = self._attach(pl_module)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._counts is None or not self._handles:
            return
        self._count(batch)
        self._detach()
        self._report(trainer, pl_module, "train")

    # -- validation ------------------------------------------------------------------------------------
    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.on_validation and not trainer.sanity_checking:
            self._counts = self._attach(pl_module)

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._handles:
            self._count(batch)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._handles:
            return
        self._detach()
        self._report(trainer, pl_module, "val")

    # -- output ------------------------------------------------------------------------------------------
    def _report(self, trainer: L.Trainer, pl_module: L.LightningModule, split: str) -> None:
        counts, self._counts = self._counts, None
        if counts is None or not counts.modalities():
            return
        scalars = {f"routing/{split}/{k}": v for k, v in counts.scalars(self.top_fraction).items()}
        on_step = split == "train"
        pl_module.log_dict(scalars, on_step=on_step, on_epoch=not on_step, rank_zero_only=True)
        if not (self.log_image and trainer.is_global_zero):
            return
        loggers = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not loggers:
            return
        from zoo.analysis.plots import heatmap_figure, plt

        fig = heatmap_figure(counts, f"Expert activation by modality ({split}, step {trainer.global_step})")
        for logger in loggers:
            logger.experiment.add_figure(f"routing/{split}/heatmap", fig, trainer.global_step, close=False)
        plt.close(fig)
