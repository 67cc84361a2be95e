"""Checkpoints that survive a kill, saved by steps and by time (issue 21, "saves that survive a kill").

- `AtomicCheckpointIO` writes a checkpoint file as POSIX expects a safe replace to be written: a temporary
  file in the target's own folder, flushed and fsynced, `os.replace`d onto the target, then the folder
  fsynced. Lightning's `_atomic_save` stages in `$TMPDIR` through fsspec, so when `$TMPDIR` is another
  filesystem its "move" is a copy: a kill during it left `last.ckpt` at 0 bytes and a 320 MB temporary
  behind (Lightning #20270, fix PR #21744 still open).
- `ZooCheckpoint` is Lightning's `ModelCheckpoint` that saves every N steps *or* every M minutes, whichever
  comes first (Lightning refuses the combination), keeps `last.ckpt` by default, makes every save through
  Lightning's default checkpoint IO atomic, and stages distributed (DCP) folders before renaming them
  into place, so that a kill never leaves a half-written folder under a checkpoint's name.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import IO, Any, Literal
from weakref import proxy

import lightning as L
import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy

# A save of `x.ckpt` stages as `.x.ckpt.tmp-*` beside it; whatever carries that prefix belongs to a save of
# that one target that was killed, and the next save of the target removes it.
STAGING = ".{name}.tmp-"
# The process's umask, read once at import: os.umask can only be read by setting it, which is not safe
# while another thread (an AsyncCheckpointIO save) creates files.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def staging_prefix(target: Path) -> str:
    return STAGING.format(name=target.name)


def fsync_folder(folder: Path) -> None:
    """Makes a rename inside `folder` durable (POSIX: the entry lives in the folder, not in the file)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:  # some filesystems (e.g. certain network mounts) cannot sync a folder
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def remove_path(path: Path) -> None:
    """Removes a file, a symlink (not what it points to) or a folder, if there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def remove_stale_staging(target: Path) -> list[Path]:
    """Removes the temporaries that killed saves of `target` left beside it; returns what it removed."""
    removed = list(target.parent.glob(glob.escape(staging_prefix(target)) + "*"))
    for path in removed:
        remove_path(path)
    return removed


def write_atomically(target: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Runs `write` on a temporary file beside `target`, then puts the complete file in place with one
    `os.replace`: a reader, or a process killed at any moment, sees the old file or the new one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(target)
    fd, staged = tempfile.mkstemp(dir=target.parent, prefix=staging_prefix(target))
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; a checkpoint gets the mode a plain open gives
        with os.fdopen(fd, "wb") as file:
            fd = -1  # owned by `file` now
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(staged, target)
    except BaseException:  # a KeyboardInterrupt in torch.save must not leave the temporary behind either
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged)
        raise
    fsync_folder(target.parent)


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` whose local saves are atomic and durable (see `write_atomically`); remote paths
    (`s3://`, ...) keep Lightning's fsspec transaction, which is what object stores offer."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__} takes no storage_options (got {storage_options!r} for {path})"
            )
        if not _is_local_file_protocol(path):
            super().save_checkpoint(checkpoint, path)
            return
        write_atomically(Path(path), lambda file: torch.save(checkpoint, file))


def saves_a_folder(strategy: Strategy) -> bool:
    """Whether `strategy` writes each checkpoint as a folder of shards, bypassing the checkpoint IO."""
    if isinstance(strategy, ModelParallelStrategy):
        return strategy._save_distributed_checkpoint
    if isinstance(strategy, FSDPStrategy):
        return strategy._state_dict_type == "sharded"
    return False


def finish_interrupted_swap(target: Path) -> bool:
    """Completes a folder swap that a kill cut between its two renames (the old checkpoint moved aside, the
    complete new folder not yet in place); returns whether there was one to complete."""
    aside, staged = (target.parent / (staging_prefix(target) + part) for part in ("old", "new"))
    if target.exists() or target.is_symlink() or not (aside.exists() or aside.is_symlink()):
        return False
    if not staged.is_dir():  # cannot happen after a kill (the old one is set aside only after the new
        return False  # one is complete); leave both for a person rather than guess
    os.replace(staged, target)
    fsync_folder(target.parent)
    remove_path(aside)
    return True


def swap_folder_in(staged: Path, target: Path) -> None:
    """Puts the complete folder `staged` at `target`. A folder cannot replace a non-empty folder (or a
    file) in one rename, so what is there is first renamed aside; `finish_interrupted_swap` completes the
    pair if a kill falls between the two renames. At no moment does `target` name an incomplete checkpoint."""
    aside = target.parent / (staging_prefix(target) + "old")
    remove_path(aside)
    if target.exists() or target.is_symlink():
        os.replace(target, aside)
    os.replace(staged, target)
    fsync_folder(target.parent)
    remove_path(aside)


class ZooCheckpoint(ModelCheckpoint):
    """Lightning's `ModelCheckpoint`, saving every `every_n_train_steps` steps or every `every_n_minutes`
    minutes of training, whichever comes first, and `last.ckpt` by default; every save is kill-safe.
    The arguments not described here are those of `ModelCheckpoint`.

    Args:
        every_n_train_steps: save after every this many optimiser steps (None or 0: not by steps).
        every_n_minutes: save when this many minutes have passed since the last save (None: not by time);
            the clock restarts at every save, whatever triggered it. Combines with steps or with epochs.
        save_last: also keep `last.ckpt`, rewritten at every save (True by default: what `--ckpt_path`
            resumes from); "link" makes it a symlink to the newest checkpoint, replaced atomically, and
            the checkpoint it pointed to is removed only once it points to the new one.
        enable_version_counter: off by default (Lightning's is on): each `zoo fit` writes into a run folder
            of its own, so a `last.ckpt` already there is this run's, being resumed, and is replaced rather
            than joined by `last-v1.ckpt`.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        verbose: bool = False,
        save_last: bool | Literal["link"] | None = True,
        save_top_k: int = 1,
        save_on_exception: bool = False,
        save_weights_only: bool = False,
        mode: Literal["min", "max"] = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: int | None = None,
        every_n_minutes: float | None = None,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        enable_version_counter: bool = False,
    ) -> None:
        if every_n_minutes is not None and not every_n_minutes > 0:
            raise ValueError(f"ZooCheckpoint: every_n_minutes must be > 0 (or None), got {every_n_minutes}")
        by_time_only = every_n_minutes is not None and every_n_train_steps is None and every_n_epochs is None
        # Lightning refuses steps and time together in its init validation, yet its `on_train_batch_end`
        # already saves when either is due. So the parent is built without the interval (0 steps rather
        # than None when time is the only trigger, or it would add a save every epoch) and gets it after.
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            monitor=monitor,
            verbose=verbose,
            save_last=save_last,
            save_top_k=save_top_k,
            save_on_exception=save_on_exception,
            save_weights_only=save_weights_only,
            mode=mode,
            auto_insert_metric_name=auto_insert_metric_name,
            every_n_train_steps=0 if by_time_only else every_n_train_steps,
            train_time_interval=None,
            every_n_epochs=every_n_epochs,
            save_on_train_epoch_end=save_on_train_epoch_end,
            enable_version_counter=enable_version_counter,
        )
        self.every_n_minutes = every_n_minutes
        self._remove_after_relink: list[str] = []
        if every_n_minutes is not None:
            self._train_time_interval = timedelta(minutes=every_n_minutes)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        use_atomic_saves(trainer.strategy)
        if trainer.is_global_zero and self.dirpath is not None and _is_local_file_protocol(self.dirpath):
            folder = Path(self.dirpath)
            for aside in folder.glob(".*.tmp-old") if folder.is_dir() else ():
                finish_interrupted_swap(folder / aside.name[1 : -len(".tmp-old")])
        trainer.strategy.barrier("ZooCheckpoint.setup")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        # Under manual optimisation (the RL task) Lightning's hook saves by steps only: add the time rule.
        if pl_module.automatic_optimization or self._train_time_interval is None:
            return
        elapsed = time.monotonic() - (self._last_time_checked or time.monotonic())
        due = trainer.strategy.broadcast(elapsed >= self._train_time_interval.total_seconds())
        if not due or self._should_skip_saving_checkpoint(trainer):
            return
        candidates = self._monitor_candidates(trainer)
        if self.monitor is not None and self.monitor not in candidates:
            self._defer_save_until_validation = True  # as the parent does: saved once validation ran
            return
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        if saves_a_folder(trainer.strategy) and _is_local_file_protocol(filepath):
            self._save_folder_checkpoint(trainer, Path(filepath))
        else:
            super()._save_checkpoint(trainer, filepath)
        self._last_time_checked = time.monotonic()  # `every_n_minutes` counts from the last save

    def _save_folder_checkpoint(self, trainer: L.Trainer, target: Path) -> None:
        """A distributed checkpoint is written by every rank into `.<name>.tmp-new/`, then, once all have
        finished, rank 0 swaps it in. Lightning would write into the existing folder (`mkdir(exist_ok)`),
        where a kill mixes new shards with the old `.metadata` into something that looks valid."""
        staged = target.parent / (staging_prefix(target) + "new")
        if trainer.is_global_zero:
            finish_interrupted_swap(target)
            remove_stale_staging(target)
        trainer.strategy.barrier("ZooCheckpoint.stage")
        trainer.save_checkpoint(staged, self.save_weights_only)  # ends with a barrier: every shard written
        if trainer.is_global_zero:
            swap_folder_in(staged, target)
        trainer.strategy.barrier("ZooCheckpoint.swap")
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = str(target)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))

    def _remove_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        # With save_last="link", Lightning removes the previous top-k checkpoint before it relinks
        # last.ckpt: a kill in between would leave last.ckpt pointing at nothing. Remove after relinking.
        if self.save_last == "link":
            self._remove_after_relink.append(filepath)
        else:
            super()._remove_checkpoint(trainer, filepath)

    def _save_last_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict[str, torch.Tensor]) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)
        removals, self._remove_after_relink = self._remove_after_relink, []
        for filepath in removals:
            super()._remove_checkpoint(trainer, filepath)

    @staticmethod
    def _link_checkpoint(trainer: L.Trainer, filepath: str, linkpath: str) -> None:
        """`save_last="link"`: Lightning removes the old link before making the new one, which leaves a
        moment without `last.ckpt`; here the new link is made under a temporary name and renamed over it."""
        link, source = Path(linkpath), Path(filepath)
        if trainer.is_global_zero and link.absolute() != source.absolute():
            remove_stale_staging(link)
            if link.is_dir() and not link.is_symlink():
                shutil.rmtree(link)  # a real folder cannot be replaced by a link in one rename
            staged = link.parent / f"{staging_prefix(link)}{uuid.uuid4().hex[:8]}"
            try:
                os.symlink(os.path.relpath(source, link.parent), staged)
                os.replace(staged, link)
                fsync_folder(link.parent)
            except OSError:  # no symlinks (e.g. Windows without the privilege): an atomic copy instead
                with contextlib.suppress(FileNotFoundError):
                    staged.unlink()
                if source.is_dir():
                    raise
                with open(source, "rb") as original:
                    write_atomically(link, lambda file: shutil.copyfileobj(original, file))
        trainer.strategy.barrier()


def use_atomic_saves(strategy: Strategy) -> None:
    """Gives `strategy` `AtomicCheckpointIO` where it would use Lightning's default `TorchCheckpointIO`
    (also inside a wrapper such as `AsyncCheckpointIO`); a checkpoint IO of the user's own is kept."""
    io = strategy.checkpoint_io
    if type(io) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()
    elif isinstance(io, _WrappingCheckpointIO) and type(io.checkpoint_io) is TorchCheckpointIO:
        io._checkpoint_io = AtomicCheckpointIO()  # its setter ignores a second base IO, so set it directly
