"""Learning curves in the verifiers' terms: every task scored on a few val scenes every n training steps.

The loss says little about whether a caption is right or an image shows its scene; `VerifierCurve` runs the
same evaluation as the end-of-fit gallery (`zoo.tasks.multimodal_eval.evaluate`, same sampling) on a small
fixed set of scenes while training, logs `curve/<task>/<metric>` to every logger and appends one JSON line
per evaluation to `<default_root_dir>/verifier_curve.jsonl`, which `docs/make_figures.py` (or anyone) can
draw. It is how the demo's budget was spent (docs/results.md): where each task starts to learn, and whether
it is still rising when training stops.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L

from zoo.parallel import is_sharded
from zoo.tasks.gallery_overview import CURVE_FILE


class VerifierCurve(L.Callback):
    """Score every supported task on `scenes` val scenes every `every_n_steps` steps (and at the end).

    Args:
        every_n_steps: training steps between evaluations.
        scenes: val scenes per task (fixed: the first `scenes` of the split, so points are comparable).
        cfg_scale: classifier-free guidance weight for image and video generation.
        audio_cfg_scale: guidance weight for caption to speech (0: off; for data with `audio_uncond_prob`).
        temperature: media sampling temperature.
        top_k: top-k filtering of sampled media tokens (None: off).
        seed: sampling seed (the same at every point).
    """

    def __init__(
        self,
        every_n_steps: int = 150,
        scenes: int = 16,
        cfg_scale: float = 2.0,
        temperature: float = 1.0,
        top_k: int | None = 8,
        seed: int = 0,
        audio_cfg_scale: float = 0.0,
    ) -> None:
        if every_n_steps < 1 or scenes < 1:
            raise ValueError(f"every_n_steps and scenes must be >= 1, got {every_n_steps} and {scenes}")
        self.every_n_steps, self.scenes, self.cfg_scale = every_n_steps, scenes, cfg_scale
        self.temperature, self.top_k, self.seed = temperature, top_k, seed
        self.audio_cfg_scale = audio_cfg_scale
        self._last_step = -1

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            self._score(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._score(trainer, pl_module)

    def _score(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule
        from zoo.tasks.multimodal_eval import evaluate

        step = trainer.global_step
        data = trainer.datamodule
        if step == self._last_step or not isinstance(data, ShapesMultimodalDataModule):
            return
        if not trainer.is_global_zero or is_sharded(pl_module.model):
            return  # a sharded forward is a collective; score an exported checkpoint instead
        self._last_step = step
        was_training = pl_module.training
        result = evaluate(
            pl_module.model, data, self.scenes, "val", self.cfg_scale, self.temperature, self.top_k,
            seed=self.seed, audio_cfg_scale=self.audio_cfg_scale,
        )
        pl_module.train(was_training)
        point = {k: round(v, 4) for k, v in result.metrics.items() if "ci95" not in k and "baseline" not in k}
        for logger in trainer.loggers:
            logger.log_metrics({f"curve/{k}": v for k, v in point.items()}, step=step)
        path = Path(trainer.default_root_dir) / CURVE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps({"step": step, "scenes": self.scenes, **point}) + "\n")
