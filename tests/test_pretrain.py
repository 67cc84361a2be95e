"""The pretraining task as a specification: it trains, logs per head / modality / router, resumes
exactly, refuses non-finite losses before touching the weights, and balances experts without a loss."""

from pathlib import Path

import lightning as L
import pytest
import torch

from zoo.datamodules.shapes_data import ShapesDataModule
from zoo.models.elastic import ElasticSampler
from zoo.models.moe import Router
from zoo.registry import create_model
from zoo.tasks.callbacks import ExpertBiasUpdate
from zoo.tasks.pretrain import UnifiedPretraining

TINY = dict(
    dim=32, n_layers=3, n_heads=2, n_kv_heads=1, n_experts=8, expert_hidden=16, top_k=2, max_seq_len=64
)


class LossRecorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


class StopAfterFirstEpoch(L.Callback):
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        trainer.should_stop = True


def make_task(elastic: bool = True, **overrides) -> UnifiedPretraining:
    torch.manual_seed(0)
    model = create_model("tiny", **{**TINY, **overrides})
    return UnifiedPretraining(
        model, elastic=ElasticSampler(seed=1) if elastic else None, lr=3e-3, warmup_steps=2
    )


def make_data(model, **overrides) -> ShapesDataModule:
    args = dict(train_size=64, val_size=16, batch_size=16, seq_len=64, tokenizer_size=300)
    return ShapesDataModule(vocab=model.vocab, **{**args, **overrides})


def make_trainer(tmp_path: Path, max_epochs: int, callbacks: list, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_epochs=max_epochs,
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        callbacks=callbacks,
        **kwargs,
    )


def test_training_lowers_the_loss_and_logs_every_head_modality_and_router(tmp_path):
    task = make_task()
    recorder = LossRecorder()
    trainer = make_trainer(tmp_path, 3, [recorder, ExpertBiasUpdate()], enable_checkpointing=False)
    trainer.fit(task, datamodule=make_data(task.model))
    assert recorder.losses[-1] < recorder.losses[0] - 0.5
    logged = set(trainer.logged_metrics)
    for key in (
        "train/text/ntp_loss",
        "train/text/mtp1_loss",
        "train/aux_loss",
        "train/z_loss",
        "train/router/text/load_entropy",
        "train/router/text/max_load",
        "val/loss",
        "val/text/accuracy",
    ):
        assert key in logged, f"{key} not logged; logged: {sorted(logged)}"


def test_resuming_from_a_checkpoint_reproduces_the_uninterrupted_losses_exactly(tmp_path):
    full = LossRecorder()
    make_trainer(tmp_path / "a", 2, [full, ExpertBiasUpdate()], enable_checkpointing=False).fit(
        make_task(), datamodule=make_data(make_task().model)
    )

    first = LossRecorder()
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    task = make_task()
    # Same schedule as the full run (the LR follows max_epochs), interrupted after the first epoch.
    make_trainer(tmp_path / "b", 2, [first, ExpertBiasUpdate(), StopAfterFirstEpoch(), checkpoint]).fit(
        task, datamodule=make_data(task.model)
    )
    resumed = LossRecorder()
    torch.manual_seed(123)  # the resumed run must not depend on the global RNG state
    task = make_task()
    for p in task.parameters():  # nor on its fresh initial weights
        p.data.normal_()
    make_trainer(tmp_path / "c", 2, [resumed, ExpertBiasUpdate()], enable_checkpointing=False).fit(
        task, datamodule=make_data(task.model), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt")
    )
    assert len(first.losses) + len(resumed.losses) == len(full.losses)
    assert first.losses + resumed.losses == full.losses


def test_a_non_finite_loss_stops_training_before_the_weights_change_and_names_the_step(tmp_path):
    task = make_task(elastic=False)
    before = {k: v.clone() for k, v in task.state_dict().items()}
    with torch.no_grad():
        task.model.text_head.output.weight[0, 0] = float("nan")
    before["model.text_head.output.weight"][0, 0] = float("nan")
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1
    )
    trainer = make_trainer(tmp_path, 1, [checkpoint])
    with pytest.raises(FloatingPointError, match="global step 0"):
        trainer.fit(task, datamodule=make_data(task.model))
    after = task.state_dict()
    for key, value in before.items():
        assert torch.equal(value, after[key]) or torch.isnan(value).any(), key
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_aux_free_bias_steers_load_without_a_gradient_and_stays_centred(tmp_path):
    task = make_task(elastic=False, balancing="aux_free")
    trainer = make_trainer(tmp_path, 2, [ExpertBiasUpdate(gamma=0.01)], enable_checkpointing=False)
    trainer.fit(task, datamodule=make_data(task.model))
    routers = [m for m in task.modules() if isinstance(m, Router)]
    assert routers
    for router in routers:
        assert router.expert_bias.abs().sum() > 0
        assert abs(float(router.expert_bias.mean())) < 1e-5
        assert not router.expert_bias.requires_grad


def test_data_and_model_vocabularies_must_agree(tmp_path):
    task = make_task()
    data = ShapesDataModule(train_size=32, val_size=8, batch_size=8, seq_len=64, tokenizer_size=300)
    data.vocab = type(task.model.vocab)(text_size=1024)
    with pytest.raises(ValueError, match="vocabulary"):
        make_trainer(tmp_path, 1, []).fit(task, datamodule=data)
