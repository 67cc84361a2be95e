"""FSDP2 and FP8 on the multimodal unified model: frozen tokenizers inside the sharded model.

The unified model with a visual tokenizer and an audio codec (frozen, inside the NFSP and NCP heads)
trains on two CPU processes (gloo) with FSDP2 exactly as on one, and with FSDP2 + FP8 close to it; the
frozen tokenizers never change and none of their layers is converted to FP8. Like tests/test_parallel.py
this file runs itself as the distributed script (Lightning's launcher re-runs it for rank 1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from zoo.datamodules.sequence import AudioSegment, MediaLayout, SequenceBuilder, TextSegment, VisualSegment
from zoo.models.backbone import UnifiedTransformer
from zoo.models.unified import UnifiedModel
from zoo.parallel import FSDP2Strategy, Parallelism
from zoo.tasks.pretrain import UnifiedPretraining
from zoo.tokenizers.audio import AudioCodec
from zoo.tokenizers.visual import VisualTokenizer
from zoo.tokenizers.vocab import UnifiedVocab

REPO = Path(__file__).resolve().parent.parent
STEPS = 3
FSDP_RTOL = 1e-5  # as in tests/test_parallel.py: only the reduction order differs
FP8_RTOL = 5e-3


def make_task(parallel: Parallelism = Parallelism()) -> UnifiedPretraining:
    torch.manual_seed(0)
    tokenizer, codec = VisualTokenizer(), AudioCodec()
    # Untrained codebooks k-means-initialise on the first batch they see, from the global RNG; do it here,
    # seeded, so every process (and any earlier test's RNG use) leaves them alike. Trained ones load it.
    tokenizer.encode(torch.rand(4, 3, 32, 32) * 2 - 1)
    codec.encode(torch.randn(2, 4 * 640) * 0.1)
    vocab = UnifiedVocab(text_size=64, visual_size=tokenizer.codebook_size, audio_size=256, audio_levels=4)
    backbone = UnifiedTransformer(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=4, expert_hidden=32, top_k=2, max_seq_len=256
    )
    model = UnifiedModel(backbone, vocab, mtp_depth=0, visual_tokenizer=tokenizer, audio_codec=codec)
    return UnifiedPretraining(model, lr=3e-3, warmup_steps=1, parallel=parallel)


def make_batches(task: UnifiedPretraining) -> list:
    vocab = task.model.vocab
    builder = SequenceBuilder(vocab, 256, layout=MediaLayout(task.model.nfsp.scales, audio_hop=640))
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        caption = (torch.randint(0, 16, (6,), generator=g) + vocab.text_offset).tolist()
        image = torch.rand(3, 32, 32, generator=g) * 2 - 1
        wave = torch.randn(4 * 640, generator=g) * 0.1
        docs = [
            [
                TextSegment([vocab.bos_id, *caption], predict=False),
                VisualSegment(image),
                TextSegment([vocab.eos_id]),
            ],
            [
                TextSegment([vocab.bos_id, *caption], predict=False),
                AudioSegment(wave),
                TextSegment([vocab.eos_id]),
            ],
        ]
        batches.append(builder.collate(docs))
    return batches


class LossRecorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def fit(task: UnifiedPretraining, devices: int, strategy) -> list[float]:  # noqa: ANN001
    recorder = LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[recorder],
    )
    loader = torch.utils.data.DataLoader(make_batches(task), batch_size=None, shuffle=False)
    trainer.fit(task, train_dataloaders=loader)
    return recorder.losses


def tokenizer_checksum(task: UnifiedPretraining) -> float:
    frozen = [*task.model.nfsp.tokenizer.parameters(), *task.model.ncp.codec.parameters()]
    return float(
        sum(p.full_tensor().double().sum() if hasattr(p, "full_tensor") else p.double().sum() for p in frozen)
    )


def main(out: str) -> None:
    torch.set_num_threads(1)
    results: dict[str, object] = {}
    for name, parallel in {
        "fsdp": Parallelism(fsdp=True),
        "fsdp_fp8": Parallelism(fsdp=True, fp8=True, activation_checkpointing=True),
    }.items():
        task = make_task(parallel)
        results[name] = fit(task, 2, FSDP2Strategy())
        results[name + "_tokenizer_checksum"] = tokenizer_checksum(task)
        if parallel.fp8:
            from torchao.float8.float8_linear import Float8Linear

            frozen = [*task.model.nfsp.tokenizer.modules(), *task.model.ncp.codec.modules()]
            results["fp8_in_tokenizers"] = sum(isinstance(m, Float8Linear) for m in frozen)
            results["fp8_linears"] = sum(isinstance(m, Float8Linear) for m in task.model.modules())
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        Path(out).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def distributed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("fsdp_mm") / "losses.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(
        [sys.executable, __file__, str(out)],
        cwd=out.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"distributed run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def test_fsdp2_trains_the_multimodal_model_like_one_process_and_keeps_the_tokenizers_frozen(distributed):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the two ranks run: conv reductions split over threads round differently
    try:
        task = make_task()
        before = tokenizer_checksum(task)
        single = fit(task, 1, "auto")
    finally:
        torch.set_num_threads(threads)
    assert torch.allclose(torch.tensor(distributed["fsdp"]), torch.tensor(single), rtol=FSDP_RTOL)
    assert single[-1] < single[0]
    assert distributed["fsdp_tokenizer_checksum"] == pytest.approx(before, rel=1e-9)
    assert tokenizer_checksum(task) == pytest.approx(before, rel=1e-9)


def test_fsdp2_with_fp8_trains_close_to_full_precision_and_leaves_the_tokenizers_in_high_precision(
    distributed,
):
    assert distributed["fp8_linears"] > 0
    assert distributed["fp8_in_tokenizers"] == 0
    assert torch.allclose(
        torch.tensor(distributed["fsdp_fp8"]), torch.tensor(distributed["fsdp"]), rtol=FP8_RTOL
    )


if __name__ == "__main__":
    main(sys.argv[1])
