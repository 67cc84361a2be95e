"""Exact resume as a specification (issues 6 and 21): `zoo fit` killed by SIGKILL in the middle of an epoch
and resumed from `last.ckpt` continues with exactly the losses of the run that was never interrupted, under
each stopping rule: `max_steps`, `max_epochs` and `max_time`.

Every run is a real `python -m zoo.cli fit` subprocess on one CPU thread. The callbacks below are loaded
by those subprocesses by class_path (`test_resume.StepLossLog`), so they live beside the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from zoo.datamodules.shapes_data import ShapesDataModule

ROOT = Path(__file__).resolve().parents[1]
STEPS_PER_EPOCH = 8  # train_size 128 / batch_size 16
MAX_STEPS = 20  # epochs 0, 1 and half of 2
CHECKPOINT_EVERY = 3  # checkpoints at steps 3, 6, 9, 12, ...
HANG_AT = 14  # the run to be killed stops moving after step 14: the last checkpoint is step 12, mid-epoch 1
# Each stopping rule: the trainer overrides and the number of steps the run makes. `max_epochs` is the rule
# that Lightning#20550 breaks (the train loader's state is never restored when a task reads
# `estimated_stepping_batches` in `configure_optimizers`). A time limit cannot end two runs at the same
# step on a shared machine, so the `max_time` run gets a limit it never reaches (30 minutes) and a callback
# ends it at a fixed step: what is tested is that a run under a time limit (no step or epoch limit, the
# Timer's state in the checkpoint, an unbounded schedule) resumes exactly.
STOP_AT = 18
STOPPING_RULES = {
    "max_steps": ((), MAX_STEPS),
    "max_epochs": (("--trainer.max_steps=-1", "--trainer.max_epochs=2"), 2 * STEPS_PER_EPOCH),
    "max_time": (("--trainer.max_steps=-1", "--trainer.max_time=00:00:30:00"), STOP_AT),
}


class StepLossLog(L.Callback):
    """Appends `global_step loss` (loss as float.hex, exact) per training step, flushed to disk at once so
    that a SIGKILL loses nothing; `hang_at` makes the process wait there to be killed."""

    def __init__(self, path: str, hang_at: int | None = None) -> None:
        self.path, self.hang_at = path, hang_at

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.set_num_threads(1)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with open(self.path, "a") as f:
            f.write(f"{trainer.global_step - 1} {float(outputs['loss']).hex()}\n")
            f.flush()
            os.fsync(f.fileno())
        if self.hang_at is not None and trainer.global_step >= self.hang_at:
            time.sleep(600)


class StopAtStep(L.Callback):
    """Ends the run after `step` optimiser steps, as a time limit would, but at the same step every time."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


CONFIG = f"""
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: {MAX_STEPS}
  limit_val_batches: 0
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  gradient_clip_val: 1.0
model:
  class_path: zoo.tasks.pretrain.UnifiedPretraining
  init_args:
    model:
      class_path: zoo.models.unified.UnifiedModel
      init_args:
        backbone:
          class_path: zoo.models.backbone.UnifiedTransformer
          init_args:
            dim: 32
            n_layers: 3
            n_heads: 2
            n_kv_heads: 1
            n_dense_layers: 1
            n_experts: 8
            n_shared_experts: 1
            expert_hidden: 16
            top_k: 2
            balancing: aux_free
            max_seq_len: 128
        vocab:
          text_size: 512
        mtp_depth: 1
    elastic:
      class_path: zoo.models.elastic.ElasticSampler
      init_args:
        p_full_depth: 0.5
        p_full_width: 0.5
        p_full_topk: 0.5
        seed: 1
    lr: 0.003
    warmup_steps: 4
data:
  class_path: zoo.datamodules.shapes_data.ShapesDataModule
  init_args:
    vocab:
      text_size: 512
    train_size: {STEPS_PER_EPOCH * 16}
    val_size: 16
    seq_len: 128
    batch_size: 16
    tokenizer_size: 300
    bpe_dropout: 0.1
"""


def fit_command(
    tmp_path: Path,
    name: str,
    *extra: str,
    hang_at: int | None = None,
    checkpoint: dict | None = None,
    stop_at: int | None = None,
) -> list[str]:
    log = {"class_path": "test_resume.StepLossLog", "init_args": {"path": str(tmp_path / f"{name}.txt")}}
    if hang_at is not None:
        log["init_args"]["hang_at"] = hang_at
    callbacks = [{"class_path": "zoo.tasks.callbacks.ExpertBiasUpdate", "init_args": {"gamma": 0.01}}, log]
    callbacks += [checkpoint] if checkpoint is not None else []
    if stop_at is not None:
        callbacks.append({"class_path": "test_resume.StopAtStep", "init_args": {"step": stop_at}})
    return [
        sys.executable, "-m", "zoo.cli", "fit", "--config", str(tmp_path / "config.yaml"),
        f"--trainer.default_root_dir={tmp_path / name}", f"--trainer.callbacks={callbacks}", *extra,
    ]  # fmt: skip


def start(command: list[str], tmp_path: Path, name: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
        "OMP_NUM_THREADS": "1",
        "ZOO_ALLOW_IMPORTS": "test_resume",  # the callbacks above, named by class_path (zoo.trust)
    }
    with open(tmp_path / f"{name}.out", "w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)


def losses(path: Path) -> dict[int, str]:
    steps = {}
    for line in path.read_text().splitlines():
        step, loss = line.split()
        steps[int(step)] = loss
    return steps


def finish(process: subprocess.Popen, tmp_path: Path, name: str, timeout: float = 120) -> None:
    assert process.wait(timeout) == 0, (tmp_path / f"{name}.out").read_text()[-4000:]


@pytest.mark.parametrize("epoch", [0, 1])
def test_the_train_loader_restored_mid_epoch_yields_exactly_the_rest_of_that_epoch(epoch):
    def loader():
        data = ShapesDataModule(train_size=64, val_size=8, batch_size=8, tokenizer_size=300, bpe_dropout=0.1)
        data.setup("fit")
        train = data.train_dataloader()
        train.sampler.set_epoch(epoch)
        return train

    first = loader()
    uninterrupted = [b.input_ids for b in first]
    first.sampler.set_epoch(epoch)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    assert state == {"epoch": epoch, "batches": 3}

    resumed = loader()
    resumed.load_state_dict(state)
    rest = [b.input_ids for b in resumed]
    assert len(rest) == len(uninterrupted) - 3
    assert all(torch.equal(a, b) for a, b in zip(rest, uninterrupted[3:], strict=True))
    assert resumed.state_dict() == {"epoch": epoch, "batches": len(uninterrupted)}
    assert len(list(resumed)) == len(uninterrupted)  # the skip applies once, to the resumed epoch only


def test_a_train_loader_state_from_another_epoch_or_a_finished_one_skips_nothing():
    data = ShapesDataModule(train_size=64, val_size=8, batch_size=8, tokenizer_size=300)
    data.setup("fit")
    train = data.train_dataloader()
    train.load_state_dict({"epoch": 1, "batches": 3})
    assert len(list(train)) == 8  # the sampler is at epoch 0
    train.load_state_dict({"epoch": 0, "batches": 8})
    assert len(list(train)) == 8
    with pytest.raises(ValueError, match="'epoch' and 'batches'"):
        train.load_state_dict({"step": 3})


def checkpoint_callback(dirpath: Path, every: int) -> dict:
    """A ModelCheckpoint (as a class_path spec) saving every `every` steps plus last.ckpt."""
    return {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"dirpath": str(dirpath), "every_n_train_steps": every, "save_last": True},
    }


# max_steps runs by default; the epoch and time rules (the same resume path, other stopping checks) are slow
# tests, to keep `make test` under 15 minutes.
@pytest.mark.parametrize(
    "rule",
    [rule if rule == "max_steps" else pytest.param(rule, marks=pytest.mark.slow) for rule in STOPPING_RULES],
)
def test_a_run_killed_mid_epoch_resumes_from_the_last_checkpoint_with_the_uninterrupted_losses(
    tmp_path, rule
):  # ~25 s each: two runs side by side, then the resumed one
    (tmp_path / "config.yaml").write_text(CONFIG)
    limits, total_steps = STOPPING_RULES[rule]
    stop_at = STOP_AT if rule == "max_time" else None
    checkpoints = tmp_path / "ckpt"
    checkpoint = checkpoint_callback(checkpoints, CHECKPOINT_EVERY)
    full = start(fit_command(tmp_path, "full", *limits, stop_at=stop_at), tmp_path, "full")
    killed = start(
        fit_command(tmp_path, "killed", *limits, hang_at=HANG_AT, checkpoint=checkpoint, stop_at=stop_at),
        tmp_path,
        "killed",
    )
    try:
        deadline = time.monotonic() + 120
        log = tmp_path / "killed.txt"
        while not (log.exists() and max(losses(log), default=-1) >= HANG_AT - 1):
            assert killed.poll() is None, (tmp_path / "killed.out").read_text()[-4000:]
            assert time.monotonic() < deadline, "the run to be killed never reached its step"
            time.sleep(0.1)
        os.kill(killed.pid, signal.SIGKILL)
        assert killed.wait(30) == -signal.SIGKILL
    finally:
        if killed.poll() is None:
            killed.kill()
    last = checkpoints / "last.ckpt"
    saved_step = torch.load(last, map_location="cpu", weights_only=True)["global_step"]
    assert saved_step % STEPS_PER_EPOCH != 0 and saved_step < HANG_AT, "the checkpoint must be mid-epoch"

    # The resume continues the killed run in its own run folder (zoo.cli.runs), hence its root.
    same_run = f"--trainer.default_root_dir={tmp_path / 'killed'}"
    resumed_command = fit_command(
        tmp_path, "resumed", *limits, f"--ckpt_path={last}", same_run, stop_at=stop_at
    )
    resumed = start(resumed_command, tmp_path, "resumed")
    finish(full, tmp_path, "full")
    finish(resumed, tmp_path, "resumed")

    reference, before, after = (losses(tmp_path / f"{n}.txt") for n in ("full", "killed", "resumed"))
    assert sorted(reference) == list(range(total_steps))
    assert sorted(before) == list(range(HANG_AT))
    assert sorted(after) == list(range(saved_step, total_steps))
    assert before == {s: reference[s] for s in before}
    mismatched = {
        s: (float.fromhex(after[s]), float.fromhex(reference[s])) for s in after if after[s] != reference[s]
    }
    assert not mismatched, (
        f"{rule}: resumed from step {saved_step}; (resumed, uninterrupted) losses differ: {mismatched}"
    )
