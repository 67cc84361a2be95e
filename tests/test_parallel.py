"""zoo.parallel as a specification: FSDP2 on two CPU processes (gloo) trains exactly like one process,
FSDP2 + FP8 trains close to it, the FP8 filter keeps routing, embeddings and heads in high precision,
and parallelising twice changes nothing.

The distributed runs execute this very file as a script (`python tests/test_parallel.py OUT.json`):
Lightning's launcher starts the second rank by re-running the script, so it has to be a file.

Why every rank gets the *same* batches in the distributed comparison: the loss is a token mean per
rank and ranks receive different token counts, so "the same global batch split across ranks" gives a
different objective from one process on the whole batch (and packing changes). With identical batches,
the reduced FSDP gradient, mean of two identical gradients, equals the single-process one bit for
bit; any drift comes from the sharding itself (sharded clip norms, shard-wise AdamW), which is the
thing under test. How the real datamodule's sampler splits data over ranks is checked separately.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from host_memory_probe import BLOCK_MB, freed_block_leaves_resident_set
from torch import nn

from zoo.datamodules.documents import EpochShuffleSampler
from zoo.datamodules.sequence import SequenceBuilder, TextSegment
from zoo.parallel import FSDP2Strategy, Parallelism, high_precision_linears, parallelize
from zoo.registry import create_model
from zoo.tasks.callbacks import ExpertBiasUpdate
from zoo.tasks.pretrain import UnifiedPretraining

REPO = Path(__file__).resolve().parent.parent
# Every dim a multiple of 16 so that FP8 applies to attention and dense/shared MLPs.
TINY = dict(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=4, expert_hidden=32, top_k=2, max_seq_len=64
)
STEPS, BATCH, SEQ = 4, 4, 64
# FSDP2 vs one process, fp32, identical data: only reduction order may differ (sharded gradient-norm
# sums, the reduce-scatter); measured: bit-identical. 1e-5 relative still catches a missed gradient
# reduction or a wrong shard (the loss falls by ~1 over these 4 steps, so those move it by far more).
FSDP_RTOL = 1e-5
# FP8 (e4m3 forward, e5m2 gradients, tensor-wise scales) rounds to 3 mantissa bits per element, but the
# loss averages thousands of such errors: measured <= 4e-4 relative over the 4 steps here. 5e-3 leaves
# 10x headroom and still fails on a broken scale or a diverging float8 backward (>1e-2 within 4 steps).
FP8_RTOL = 5e-3


class LossRecorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def make_task(parallel: Parallelism = Parallelism()) -> UnifiedPretraining:
    torch.manual_seed(0)
    return UnifiedPretraining(create_model("tiny", **TINY), lr=3e-3, warmup_steps=2, parallel=parallel)


def make_batches(task: UnifiedPretraining) -> list:
    """STEPS fixed batches of random text documents (same on every rank: seeded). The documents use 16
    distinct tokens, so the loss falls fast from log(vocab) and a wrong update shows within 4 steps."""
    vocab = task.model.vocab
    builder = SequenceBuilder(vocab, SEQ)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        docs = []
        for _ in range(BATCH * 2):
            n = int(torch.randint(8, SEQ // 2, (1,), generator=g))
            ids = torch.randint(0, 16, (n,), generator=g) + vocab.text_offset
            docs.append([TextSegment(ids.tolist())])
        batches.append(builder.collate(docs))
    return batches


class StopAfterFirstEpoch(L.Callback):
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        trainer.should_stop = True


def fit(
    task: UnifiedPretraining,
    devices: int,
    strategy,  # noqa: ANN001
    callbacks: tuple[L.Callback, ...] = (),
    ckpt_path: str | None = None,
) -> list[float]:
    """STEPS optimiser steps as two epochs of STEPS // 2 batches (an epoch end is a clean place to stop)."""
    recorder = LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=2,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[recorder, ExpertBiasUpdate(), *callbacks],
    )
    batches = make_batches(task)
    loader = torch.utils.data.DataLoader(batches[: STEPS // 2], batch_size=None, shuffle=False)
    trainer.fit(task, train_dataloaders=loader, ckpt_path=ckpt_path)
    return recorder.losses


def main(out: str) -> None:
    """Runs in both ranks: FSDP2 fits, fp32 then FP8; rank 0 writes the losses."""
    torch.set_num_threads(1)  # two processes on two cores: OpenMP threads would oversubscribe (10x slower)
    results: dict[str, object] = {}
    for name, parallel in {
        "fsdp": Parallelism(fsdp=True),
        "fsdp_fp8": Parallelism(fsdp=True, fp8=True, fp8_all_gather=True, activation_checkpointing=True),
    }.items():
        start = time.perf_counter()
        task = make_task(parallel)
        total = sum(p.numel() for p in task.model.parameters())
        results[name] = fit(task, 2, FSDP2Strategy())
        results[name + "_seconds"] = time.perf_counter() - start
        local = sum(p.to_local().numel() for p in task.model.parameters())
        results[name + "_local_fraction"] = local / total
    # A distributed (DCP) checkpoint after the first epoch, then a fresh run resumed from it.
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=Path(out).parent / "ckpt", save_last=True)
    first = fit(make_task(Parallelism(fsdp=True)), 2, FSDP2Strategy(), (StopAfterFirstEpoch(), checkpoint))
    torch.manual_seed(123)
    resumed_task = make_task(Parallelism(fsdp=True))
    for p in resumed_task.parameters():  # resuming must not depend on the fresh initial weights
        p.data.normal_()
    resumed = fit(resumed_task, 2, FSDP2Strategy(), ckpt_path=str(Path(out).parent / "ckpt" / "last.ckpt"))
    results["resume"] = first + resumed
    results["checkpoint_is_a_folder"] = (Path(out).parent / "ckpt" / "last.ckpt").is_dir()
    results["freed_block_leaves_rank"] = freed_block_leaves_resident_set()  # after FSDP2Strategy's setup
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        Path(out).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def distributed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("fsdp") / "losses.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(
        [sys.executable, __file__, str(out)],
        cwd=out.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"distributed run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {**json.loads(out.read_text()), "checkpoint_dir": str(out.parent / "ckpt" / "last.ckpt")}


@pytest.fixture(scope="module")
def single() -> list[float]:
    return fit(make_task(), 1, "auto")


# --- distributed fits --------------------------------------------------------------------------------


def test_fsdp2_on_two_processes_reproduces_the_single_process_losses(distributed, single):
    assert len(distributed["fsdp"]) == len(single) == STEPS
    assert distributed["fsdp"] == pytest.approx(single, rel=FSDP_RTOL)
    assert single[-1] < single[0] - 0.5, "the reference run should learn, or the comparison proves little"
    # Really sharded: each of the two ranks holds about half of the parameters.
    assert 0.45 < distributed["fsdp_local_fraction"] < 0.6


def test_an_fsdp2_cpu_rank_returns_freed_buffers_to_the_os(distributed):
    """FSDP2Strategy's host_mmap_threshold_mb (zoo.host_memory): without it glibc keeps a freed 24 MB block
    resident (tests/test_host_memory.py), and FSDP2's gather buffers pile up as fragmented heap."""
    assert distributed["freed_block_leaves_rank"] > BLOCK_MB * 0.9


def test_fsdp2_distributed_checkpoint_resumes_to_the_uninterrupted_losses(distributed, single):
    assert distributed["checkpoint_is_a_folder"], "expected a DCP folder, one shard per rank"
    assert distributed["resume"] == pytest.approx(distributed["fsdp"], rel=FSDP_RTOL)


def test_a_distributed_checkpoint_consolidates_into_one_safetensors_file(distributed, tmp_path):
    from zoo.hub import from_pretrained, load_lightning_checkpoint, save_pretrained

    model, _ = load_lightning_checkpoint(distributed["checkpoint_dir"])
    reference = make_task().model
    assert model.num_parameters() == reference.num_parameters()
    # Consolidated weights are the trained ones, not a fresh initialisation.
    assert not torch.equal(model.text_embed.weight, reference.text_embed.weight)
    out = save_pretrained(model, tmp_path / "consolidated")
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".safetensors") == ["model.safetensors"]
    reloaded = from_pretrained(out)
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_fsdp2_with_fp8_and_checkpointing_trains_close_to_full_precision(distributed, single):
    fp8 = distributed["fsdp_fp8"]
    assert len(fp8) == STEPS and all(torch.isfinite(torch.tensor(fp8)))
    assert fp8 == pytest.approx(single, rel=FP8_RTOL)
    assert fp8 != pytest.approx(single, rel=1e-6), "FP8 changed nothing: the layers were not converted"


# --- the FP8 filter and idempotence (one process) ----------------------------------------------------


def test_fp8_converts_only_linears_with_dims_divisible_by_16_outside_router_embeddings_and_heads():
    from torchao.float8.float8_linear import Float8Linear

    model = make_task().model
    keep = {id(m) for m in high_precision_linears(model)}
    parallelize(model, Parallelism(fp8=True))
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted, "nothing was converted"
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name not in converted:
            assert id(module) in keep or module.in_features % 16 or module.out_features % 16, name
    assert not any(".router." in n or n.startswith("text_head.output") for n in converted)
    assert not any(n.endswith("proj") for n in converted), "the MTP projection must stay high precision"
    assert type(model.text_embed) is nn.Embedding
    # Experts are stacked parameters used by grouped GEMMs, not nn.Linear: they stay in fp32.
    assert model.backbone.layers[1].ffn.experts.w1.dtype == torch.float32


def test_fp8_skips_a_linear_whose_dims_are_not_multiples_of_16():
    from torchao.float8.float8_linear import Float8Linear

    model = create_model("tiny", **{**TINY, "expert_hidden": 24, "n_shared_experts": 1})
    parallelize(model, Parallelism(fp8=True))
    shared = model.backbone.layers[-1].ffn.shared
    assert shared is not None and shared.w1.out_features % 16
    assert type(shared.w1) is nn.Linear and not isinstance(shared.w1, Float8Linear)
    assert isinstance(model.backbone.layers[0].attention.wq, Float8Linear)


def test_parallelizing_twice_is_a_no_op():
    model = make_task().model
    config = Parallelism(fp8=True, activation_checkpointing=True)
    parallelize(model, config)
    structure = repr(model)
    names = [n for n, _ in model.named_parameters()]
    parallelize(model, config)
    assert repr(model) == structure and [n for n, _ in model.named_parameters()] == names


def test_activation_checkpointing_keeps_the_loss_gradients_and_state_dict_keys():
    task = make_task()
    batch = make_batches(task)[0]
    plain = task.model
    keys = set(plain.state_dict())
    plain(batch).loss.backward()
    grads = {n: p.grad.clone() for n, p in plain.named_parameters()}
    wrapped = make_task(Parallelism(activation_checkpointing=True))
    wrapped.configure_model()
    out = wrapped.model(batch)
    out.loss.backward()
    assert set(wrapped.model.state_dict()) == keys, "checkpoint wrappers must not rename weights"
    named = {n.replace("._checkpoint_wrapped_module", ""): p for n, p in wrapped.model.named_parameters()}
    for n, g in grads.items():
        torch.testing.assert_close(named[n].grad, g, msg=n)


def test_fsdp_without_a_device_mesh_is_refused_with_the_strategy_to_use():
    with pytest.raises(ValueError, match="ModelParallelStrategy"):
        parallelize(make_task().model, Parallelism(fsdp=True))
    with pytest.raises(ValueError, match="fp8_all_gather"):
        Parallelism(fp8_all_gather=True)


# --- data across ranks --------------------------------------------------------------------------------


def test_lightnings_distributed_wrapper_splits_the_epoch_shuffle_order_across_ranks():
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    sampler = EpochShuffleSampler(10, seed=3)
    sampler.set_epoch(2)
    order = list(sampler)
    parts = [list(DistributedSamplerWrapper(sampler, num_replicas=2, rank=r, shuffle=False)) for r in (0, 1)]
    # Rank r takes every second item of the one global order, epochs travelling with the indices.
    assert parts[0] == order[0::2] and parts[1] == order[1::2]
    assert all(epoch == 2 for _, epoch in parts[0] + parts[1])


if __name__ == "__main__":
    main(sys.argv[1])
