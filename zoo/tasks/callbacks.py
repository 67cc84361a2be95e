"""Lightning callbacks of the pretraining stage: the aux-loss-free expert-bias update, sample
generations with verifier scores, and the writer of `zoo predict` outputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from rich.console import Console
from rich.table import Table

from zoo.inference.best_of import check_best_of
from zoo.models.moe import Router
from zoo.models.refinement import RefinerSettings
from zoo.parallel import is_sharded


class ExpertBiasUpdate(L.Callback):
    """DeepSeek-V3's auxiliary-loss-free balancing: after every optimiser step,
    `b_i += gamma * sign(mean_load - load_i)` per router, then the biases are re-centred to mean 0.

    The bias only chooses experts; gate weights never see it, so it steers load without a gradient.

    Args:
        gamma: the bias update speed (DeepSeek-V3: 1e-3).
    """

    def __init__(self, gamma: float = 1e-3) -> None:
        self.gamma = gamma

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx
    ) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        routers = [m for m in pl_module.modules() if isinstance(m, Router) and m.balancing == "aux_free"]
        if not routers:
            return
        spread = []
        for router in routers:
            router.update_bias(self.gamma)
            spread.append(router.expert_bias.abs().mean())
        pl_module.log("train/router/bias_abs_mean", torch.stack(spread).mean(), on_step=True, on_epoch=False)


class SampleGenerations(L.Callback):
    """At the end of fit, generate from the prompts of the datamodule, score the texts with its verifier,
    print a table and write `samples.md` beside the logs. Scores are logged as `samples/<name>`.

    Args:
        num_samples: generations (from `<bos>`, i.e. unconditioned) to draw.
        seed: sampling seed, so two runs are comparable.
    """

    def __init__(self, num_samples: int = 16, seed: int = 0) -> None:
        self.num_samples, self.seed = num_samples, seed

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        datamodule = trainer.datamodule
        if datamodule is None or not hasattr(datamodule, "prompt_ids"):
            return
        # Every rank generates (a sharded model's forward needs all of them, same seed, same prompts);
        # only rank 0 reports.
        prompts = [datamodule.prompt_ids("") for _ in range(self.num_samples)]
        generator = torch.Generator(device=pl_module.device).manual_seed(self.seed)
        was_training = pl_module.training
        pl_module.eval()
        outputs = pl_module.sample(prompts, generator)
        pl_module.train(was_training)
        # `trainer.log_dir` broadcasts from rank 0: every rank must ask, or the next collective deadlocks.
        out_dir = Path(trainer.log_dir or trainer.default_root_dir)
        if not trainer.is_global_zero:
            return
        texts = [datamodule.decode(ids) for ids in outputs]
        scores = [datamodule.score_text(t) for t in texts]
        names = sorted({k for sc in scores for k in sc})
        means = {n: sum(sc.get(n, 0.0) for sc in scores) / len(scores) for n in names}

        table = Table(title=f"Samples after {trainer.global_step} steps", show_lines=False)
        table.add_column("#", justify="right")
        table.add_column("generated text")
        for n in names:
            table.add_column(n, justify="center")
        for i, (text, sc) in enumerate(zip(texts, scores, strict=True)):
            table.add_row(str(i), text, *("yes" if sc.get(n) else "no" for n in names))
        console = Console()
        console.print(table)
        if means:
            console.print("  ".join(f"{n}: {v:.0%}" for n, v in means.items()))

        out_dir.mkdir(parents=True, exist_ok=True)
        lines = [f"# Samples after {trainer.global_step} steps", ""]
        lines += ["| # | generated text | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for i, (text, sc) in enumerate(zip(texts, scores, strict=True)):
            lines.append(f"| {i} | {text} | " + " | ".join(f"{sc.get(n, 0):.0f}" for n in names) + " |")
        lines += ["", "Means: " + ", ".join(f"{n} {v:.3f}" for n, v in means.items()), ""]
        (out_dir / "samples.md").write_text("\n".join(lines))
        console.print(f"samples written to {out_dir / 'samples.md'}")
        for logger in trainer.loggers:
            logger.log_metrics({f"samples/{n}": v for n, v in means.items()}, step=trainer.global_step)


class GenerationWriter(BasePredictionWriter):
    """Writes `zoo predict` outputs as JSON lines (one per prompt or file) as each batch is answered, and
    prints them. A request that could not be answered (a bad file, a prompt too long) gets a row with its
    "error", said on the terminal too; the others are written all the same.

    Args:
        output: the JSONL file to write (replaced at the start of the run).
    """

    def __init__(self, output: str = "predictions.jsonl") -> None:
        super().__init__(write_interval="batch")
        self.output = output
        self.written = self.failed = 0

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        path = Path(self.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        self.written = self.failed = 0

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx
    ) -> None:
        path = Path(self.output)
        for row in prediction:
            if isinstance(row.get("media"), torch.Tensor):  # generated image / video / audio: a file beside
                from zoo.tasks.multimodal_eval import save_media

                folder = path.parent / f"{path.stem}_media"
                folder.mkdir(exist_ok=True)
                row["media"] = str(save_media(row["media"], folder / f"{row['task']}_{row['name']}"))
        with path.open("a") as f:
            for row in prediction:
                f.write(json.dumps(row) + "\n")
        for row in prediction:
            source = row.get("prompt", row.get("name", row.get("prompt_ids")))
            if "error" in row:
                self.failed += 1
                print(f"{source!r}: not answered: {row['error']}", file=sys.stderr)
            else:
                self.written += 1
                print(f"{source!r} -> {row.get('text', row.get('media', row.get('ids')))!r}")

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        failed = f" ({self.failed} could not be answered, see their 'error')" if self.failed else ""
        print(f"{self.written + self.failed} generations written to {self.output}{failed}")


class MultimodalGallery(L.Callback):
    """At the end of fit, evaluate every modality the model and data support with the ShapesWorld verifiers
    (`zoo.tasks.multimodal_eval.evaluate`), print the scores beside their baselines, and write the gallery
    page (`gallery/gallery.md` with PNG/GIF/WAV files, `overview.png` and `metrics.json`) in
    `trainer.default_root_dir`.

    Args:
        num_samples: scenes per task (and per split).
        split: "val" (training compositions) or "test" (held-out colour-shape pairs): the gallery's pictures
            and the unprefixed keys of metrics.json (`image_to_text/exact`).
        score_splits: further splits scored too, under `<split>/` keys (`test/image_to_text/exact`), no
            pictures: e.g. ["test"] to see how far held-out compositions fall behind.
        cfg_scale: classifier-free guidance weight for image and video generation.
        audio_cfg_scale: guidance weight for caption to speech (0: off; for data with `audio_uncond_prob`).
        temperature: sampling temperature.
        top_k: top-k filtering of every sampled token (None: off).
        seed: sampling seed.
        refiner: a diffusion refiner (folder or Hub id, steps, seed) for caption-to-image: the page shows each
            decode beside its refinement, and metrics.json adds `text_to_image/refined_exact`, `/psnr`, ...
            (loaded here, so that a wrong folder fails before training).
        best_of, audio_best_of: draw this many images / utterances a caption and keep the one the model reads
            back as the caption most likely (`zoo.inference.best_of`; 1: one sample); the page and
            metrics.json add what one sample scores (`text_to_image/one_sample_exact`, ...).
    """

    def __init__(
        self,
        num_samples: int = 16,
        split: str = "val",
        score_splits: list[str] | None = None,
        cfg_scale: float = 2.0,
        temperature: float = 1.0,
        top_k: int | None = 8,
        seed: int = 0,
        refiner: RefinerSettings | None = None,
        audio_cfg_scale: float = 0.0,
        best_of: int = 1,
        audio_best_of: int = 1,
    ) -> None:
        check_best_of(best_of=best_of, audio_best_of=audio_best_of)  # before training, not after it
        self.best_of, self.audio_best_of = best_of, audio_best_of
        self.num_samples, self.split, self.cfg_scale = num_samples, split, cfg_scale
        self.audio_cfg_scale = audio_cfg_scale
        self.score_splits = list(score_splits or [])
        self.temperature, self.top_k, self.seed = temperature, top_k, seed
        self.refinement = None if refiner is None else refiner.load()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from zoo.datamodules.shapes_multimodal import ShapesMultimodalDataModule
        from zoo.tasks.multimodal_eval import evaluate, write_gallery

        datamodule = trainer.datamodule
        out_dir = Path(trainer.default_root_dir) / "gallery"  # a fixed place: reruns overwrite it
        if not isinstance(datamodule, ShapesMultimodalDataModule) or not trainer.is_global_zero:
            return
        if is_sharded(pl_module.model):
            Console().print("MultimodalGallery: skipped for a sharded model; evaluate an exported checkpoint")
            return
        was_training = pl_module.training

        def scored(split: str):  # noqa: ANN202 (an Evaluation)
            return evaluate(
                pl_module.model, datamodule, self.num_samples, split, self.cfg_scale, self.temperature,
                self.top_k, seed=self.seed, refinement=self.refinement, audio_cfg_scale=self.audio_cfg_scale,
                best_of=self.best_of, audio_best_of=self.audio_best_of,
            )

        result = scored(self.split)
        held_out = {split: scored(split).metrics for split in self.score_splits if split != self.split}
        pl_module.train(was_training)
        tasks = sorted({k.split("/")[0] for k in result.metrics})
        for split, metrics in held_out.items():
            result.metrics.update({f"{split}/{k}": v for k, v in metrics.items()})
        page = write_gallery(result, out_dir, f"ShapesWorld gallery after {trainer.global_step} steps")
        m = result.metrics
        table = Table(title=f"Verifier scores, {self.num_samples} scenes per task and split (95% intervals)")
        for column in ("task", "split", "exact", "attributes", "baseline exact", "baseline attributes"):
            table.add_column(column, justify="left" if column in ("task", "split") else "center")
        for split, prefix in ((self.split, ""), *((s, f"{s}/") for s in held_out)):
            for task in tasks:
                p = f"{prefix}{task}"
                table.add_row(
                    task, split,
                    *(f"{m[f'{p}/{k}']:.2f} [{m[f'{p}/{k}_ci95_low']:.2f}, {m[f'{p}/{k}_ci95_high']:.2f}]"
                      for k in ("exact", "attribute_accuracy")),
                    *(f"{m[f'{p}/{k}']:.2f}" for k in ("baseline_exact", "baseline_attribute_accuracy")),
                )
        console = Console()
        console.print(table)
        if "text_to_audio/word_accuracy" in m:
            console.print(
                f"text_to_audio: caption words read back in place {m['text_to_audio/word_accuracy']:.2f} "
                f"(random codes {m['text_to_audio/baseline_word_accuracy']:.2f})"
            )
        for task in (t for t in tasks if f"{t}/best_of" in m):
            one = f"{task}/one_sample"
            console.print(
                f"{task}: the best of {m[f'{task}/best_of']:.0f} by the model's own reading; one sample: "
                f"exact {m[f'{one}_exact']:.2f}, attributes {m[f'{one}_attribute_accuracy']:.2f}"
                + (f", words in place {m[f'{one}_word_accuracy']:.2f}" if f"{one}_word_accuracy" in m else "")
            )
        if "text_to_image/refined_exact" in m:
            console.print(
                f"text_to_image refined: exact {m['text_to_image/refined_exact']:.2f}, attributes "
                f"{m['text_to_image/refined_attribute_accuracy']:.2f}; PSNR {m['text_to_image/psnr']:.2f} dB "
                f"(decode, bicubic) -> {m['text_to_image/refined_psnr']:.2f} dB (refined)"
            )
        console.print(f"gallery written to {page}")
        for logger in trainer.loggers:
            logger.log_metrics({f"gallery/{k}": v for k, v in m.items()}, step=trainer.global_step)
