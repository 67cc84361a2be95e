"""zoo.tasks.checkpointing as a specification: an interrupted save keeps the previous checkpoint and leaves
nothing behind, a folder swap cut by a kill is completed, and `ZooCheckpoint` saves by steps, by time or
by whichever comes first, makes its saves atomic, and resumes exactly. The SIGKILL tests of saves are in
tests/test_checkpoint_kills.py.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from zoo.tasks.checkpointing import (
    AtomicCheckpointIO,
    ZooCheckpoint,
    remove_path,
    staging_prefix,
    swap_folder_in,
)


def staged(target: Path) -> list[Path]:
    """What saves of `target` staged beside it and left there."""
    return sorted(target.parent.glob(staging_prefix(target) + "*"))


# --- single-file saves ----------------------------------------------------------------------------------


class InterruptsPickling:
    """Raises KeyboardInterrupt when torch.save reaches it, as a Ctrl-C in the middle of a save would."""

    def __reduce__(self):  # noqa: ANN204
        raise KeyboardInterrupt


def test_an_interrupted_save_keeps_the_previous_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"version": 1, "weights": torch.ones(1000)}, target)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"version": 2, "weights": torch.zeros(1000), "x": InterruptsPickling()}, target)
    assert torch.load(target, weights_only=True)["version"] == 1
    assert staged(target) == []


def test_a_save_removes_stale_temporaries_of_its_own_target_only(tmp_path):
    target = tmp_path / "last.ckpt"
    stale = [tmp_path / f"{staging_prefix(target)}{name}" for name in ("abc123", "new", "old")]
    stale[0].write_bytes(b"half a checkpoint")
    stale[1].mkdir()
    (stale[1] / "__0_0.distcp").write_bytes(b"a shard")
    stale[2].symlink_to(stale[1])
    other = tmp_path / f"{staging_prefix(tmp_path / 'epoch=0-step=3.ckpt')}xyz"
    other.write_bytes(b"another target's save in progress")
    AtomicCheckpointIO().save_checkpoint({"step": 3}, target)
    assert staged(target) == [] and other.exists()
    assert torch.load(target, weights_only=True) == {"step": 3}
    assert target.stat().st_mode & 0o777 == 0o666 & ~current_umask(), "the mode a plain open would give"


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --- folder swaps (distributed checkpoints) -------------------------------------------------------------


def shard_folder(path: Path, content: str) -> Path:
    path.mkdir(parents=True)
    (path / "meta.pt").write_text(content)
    return path


def test_a_folder_swap_cut_between_its_two_renames_is_completed_when_training_starts(tmp_path):
    # The state a kill leaves between the renames: the old folder set aside, the complete new one staged.
    target = tmp_path / "last.ckpt"
    shard_folder(tmp_path / f"{staging_prefix(target)}old", "step 3")
    shard_folder(tmp_path / f"{staging_prefix(target)}new", "step 6")
    saved_steps(ZooCheckpoint(dirpath=str(tmp_path), save_last=False, save_top_k=0), 1)
    assert (target / "meta.pt").read_text() == "step 6"
    assert staged(target) == []


def test_a_folder_swap_replaces_a_folder_a_file_or_a_link(tmp_path):
    target = tmp_path / "last.ckpt"
    for old in ("folder", "file", "link"):
        remove_path(target)
        if old == "folder":
            shard_folder(target, "old")
        elif old == "file":
            target.write_text("old")
        else:
            target.symlink_to(shard_folder(tmp_path / old, "old"))
        swap_folder_in(shard_folder(tmp_path / f"{staging_prefix(target)}new", "new"), target)
        assert target.is_dir() and not target.is_symlink() and (target / "meta.pt").read_text() == "new"
        assert staged(target) == []
    assert (tmp_path / "link" / "meta.pt").read_text() == "old", "what a link pointed to is not removed"


# --- ZooCheckpoint triggers -----------------------------------------------------------------------------


class Regression(L.LightningModule):
    """The smallest trainable task; `manual=True` optimises by hand, as the RL task does."""

    def __init__(self, manual: bool = False, pause: float = 0.0) -> None:
        super().__init__()
        self.linear, self.automatic_optimization, self.pause = nn.Linear(4, 1), not manual, pause

    def training_step(self, batch, batch_idx) -> torch.Tensor | None:
        time.sleep(self.pause)
        loss = (self.linear(batch) ** 2).mean()
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return None

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.randn(40, 4, generator=torch.Generator().manual_seed(0)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def saved_steps(callback: ZooCheckpoint, steps: int, manual: bool = False, pause: float = 0.0) -> list[int]:
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(Regression(manual, pause))
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    folder = Path(callback.dirpath)
    return sorted(int(p.stem.split("step=")[1]) for p in folder.glob("epoch=*-step=*.ckpt"))


def test_lightning_refuses_steps_and_time_together_and_zoo_checkpoint_accepts_them(tmp_path):
    with pytest.raises(MisconfigurationException, match="mutually exclusive"):
        ModelCheckpoint(every_n_train_steps=3, train_time_interval=timedelta(minutes=5))
    callback = ZooCheckpoint(dirpath=str(tmp_path), every_n_train_steps=3, every_n_minutes=5.0)
    assert callback.save_last is True
    with pytest.raises(ValueError, match="every_n_minutes must be > 0"):
        ZooCheckpoint(every_n_minutes=0)


@pytest.mark.parametrize(
    "steps, minutes, expected",
    [
        (3, None, [3, 6]),  # by steps
        (None, 1e-7, [1, 2, 3, 4, 5, 6, 7]),  # by time: every step takes longer than 6 microseconds
        (3, 60.0, [3, 6]),  # both: the steps come first
        (100, 1e-7, [1, 2, 3, 4, 5, 6, 7]),  # both: the time comes first
    ],
)
def test_zoo_checkpoint_saves_by_steps_or_by_time_whichever_comes_first(tmp_path, steps, minutes, expected):
    callback = ZooCheckpoint(
        dirpath=str(tmp_path), every_n_train_steps=steps, every_n_minutes=minutes, save_top_k=-1
    )
    assert saved_steps(callback, 7) == expected
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == expected[-1]


def test_the_time_interval_counts_from_the_last_save_whatever_triggered_it(tmp_path):
    # 0.5 s a step, a save every 2 steps or every 1.2 s: the clock restarts at each step-triggered save,
    # 1 s apart, so time never comes first; counted from the start of training instead, it would fire at
    # step 3 (1.5 s). The margins (0.2 s, 0.3 s) allow for a slow machine.
    callback = ZooCheckpoint(
        dirpath=str(tmp_path), every_n_train_steps=2, every_n_minutes=1.2 / 60, save_top_k=-1
    )
    assert saved_steps(callback, 6, pause=0.5) == [2, 4, 6]


def test_a_manually_optimised_task_is_saved_by_time_too(tmp_path):
    # Lightning's hook saves manual optimisation (the RL task) by steps only.
    callback = ZooCheckpoint(dirpath=str(tmp_path), every_n_minutes=1e-7, save_top_k=-1)
    assert saved_steps(callback, 4, manual=True) == [1, 2, 3, 4]


def test_zoo_checkpoint_keeps_a_checkpoint_io_of_the_users_own(tmp_path):
    class OwnIO(TorchCheckpointIO):
        pass

    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[OwnIO()],
        callbacks=[ZooCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1)],
    )
    trainer.fit(Regression())
    assert type(trainer.strategy.checkpoint_io) is OwnIO
    assert (tmp_path / "last.ckpt").exists()


def test_save_last_link_replaces_the_link_in_one_rename(tmp_path):
    callback = ZooCheckpoint(dirpath=str(tmp_path), every_n_train_steps=2, save_last="link")
    assert saved_steps(callback, 6) == [6]
    last = tmp_path / "last.ckpt"
    assert last.is_symlink() and os.readlink(last) == "epoch=0-step=6.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 6
    assert staged(last) == []


# --- resuming from ZooCheckpoint's last.ckpt ------------------------------------------------------------


class LossRecorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


class StopAtStep(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def test_the_last_ckpt_of_zoo_checkpoint_resumes_mid_epoch_with_the_uninterrupted_losses(tmp_path):
    from test_pretrain import make_data, make_task

    from zoo.tasks.callbacks import ExpertBiasUpdate

    def fit(name: str, callbacks: list, ckpt_path: str | None = None) -> list[float]:
        recorder, task = LossRecorder(), make_task()
        trainer = L.Trainer(
            accelerator="cpu",
            max_epochs=2,  # 4 steps an epoch: the stopping rule Lightning#20550 broke
            default_root_dir=tmp_path / name,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            callbacks=[recorder, ExpertBiasUpdate(), *callbacks],
        )
        trainer.fit(task, datamodule=make_data(task.model), ckpt_path=ckpt_path)
        return recorder.losses

    full = fit("full", [])
    checkpoint = ZooCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=3)
    first = fit("first", [checkpoint, StopAtStep(5)])
    last = tmp_path / "ckpt" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 3  # mid-epoch 0
    resumed = fit("resumed", [], ckpt_path=str(last))
    assert len(full) == 8 and first == full[:5]
    assert resumed == full[3:]
