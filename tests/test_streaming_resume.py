"""Exact resume of a *streamed* corpus (issue 14, item 4): `zoo fit` on a `TextFilesDataModule` read by two
DataLoader workers, killed by SIGKILL mid-epoch and resumed from `last.ckpt`, continues with exactly the
losses of the run that was never interrupted. The run also cuts its epochs short (`limit_train_batches`),
validates in the middle of epochs, leaves out a different remainder of documents each epoch and uses
BPE-dropout, all of which the resumed run must reproduce.

It reuses tests/test_resume.py's subprocess helpers; `max_steps` bounds the run (with `max_epochs`,
Lightning#20550 would skip restoring the loader's state).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import torch
from test_resume import checkpoint_callback, finish, fit_command, losses, start

from zoo.tokenizers.text import TextTokenizer

STEPS_PER_EPOCH = 6  # limit_train_batches; the loader has 143 // 16 = 8 batches
MAX_STEPS = 16  # epochs 0, 1 and part of 2
CHECKPOINT_EVERY = 3  # checkpoints at steps 3, 6, 9, 12, ...
HANG_AT = 11  # the last checkpoint before it is step 9: epoch 1, after an odd number of batches, so the
# resumed DataLoader's first turn belongs to the second worker's part

WORDS = "the a red blue green circle square small large near far left right top bottom moves".split()

CONFIG = f"""
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: {MAX_STEPS}
  limit_train_batches: {STEPS_PER_EPOCH}
  val_check_interval: 3
  limit_val_batches: 1
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
            n_layers: 2
            n_heads: 2
            n_kv_heads: 1
            n_dense_layers: 1
            n_experts: 4
            expert_hidden: 16
            top_k: 2
            balancing: aux_free
            max_seq_len: 128
        vocab:
          text_size: 512
    lr: 0.003
    warmup_steps: 4
data:
  class_path: zoo.datamodules.text.TextFilesDataModule
  init_args:
    train_files: [corpus.txt, corpus.jsonl]
    tokenizer: tokenizer.json
    vocab:
      text_size: 512
    seq_len: 128
    batch_size: 16
    bpe_dropout: 0.1
    val_fraction: 0.05
    truncate: true
    num_workers: 2
    shuffle_buffer: 32
"""


def write_corpus(folder: Path) -> None:
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))) + "." for _ in range(150)]
    (folder / "corpus.txt").write_text("\n\n".join(docs[:90]) + "\n")
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[90:]))
    TextTokenizer.train(docs, vocab_size=300).save(folder / "tokenizer.json")


def test_a_streamed_run_killed_mid_epoch_resumes_with_the_uninterrupted_losses(tmp_path: Path):
    write_corpus(tmp_path)
    (tmp_path / "config.yaml").write_text(CONFIG)
    checkpoints = tmp_path / "ckpt"
    checkpoint = checkpoint_callback(checkpoints, CHECKPOINT_EVERY)
    full = start(fit_command(tmp_path, "full"), tmp_path, "full")
    killed = start(
        fit_command(tmp_path, "killed", hang_at=HANG_AT, checkpoint=checkpoint), tmp_path, "killed"
    )
    try:
        deadline = time.monotonic() + 180
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
    state = torch.load(last, map_location="cpu", weights_only=True)
    saved_step = state["global_step"]
    assert saved_step % STEPS_PER_EPOCH != 0 and saved_step < HANG_AT, "the checkpoint must be mid-epoch"
    train_state = state["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert train_state == {
        "epoch": saved_step // STEPS_PER_EPOCH, "batches": saved_step % STEPS_PER_EPOCH,
        "world_size": 1, "num_workers": 2, "batch_size": 16,
    }  # fmt: skip

    same_run = f"--trainer.default_root_dir={tmp_path / 'killed'}"  # a resume continues its run folder
    resumed = start(fit_command(tmp_path, "resumed", f"--ckpt_path={last}", same_run), tmp_path, "resumed")
    finish(full, tmp_path, "full", timeout=240)
    finish(resumed, tmp_path, "resumed", timeout=240)

    reference, before, after = (losses(tmp_path / f"{n}.txt") for n in ("full", "killed", "resumed"))
    assert sorted(reference) == list(range(MAX_STEPS))
    assert sorted(before) == list(range(HANG_AT))
    assert sorted(after) == list(range(saved_step, MAX_STEPS))
    assert before == {s: reference[s] for s in before}
    mismatched = {
        s: (float.fromhex(after[s]), float.fromhex(reference[s])) for s in after if after[s] != reference[s]
    }
    assert not mismatched, (
        f"resumed from step {saved_step}; (resumed, uninterrupted) losses differ: {mismatched}"
    )
