"""Two ranks x two workers, as a specification (issue 14, item 4): a stream under Lightning DDP (two gloo
processes, one thread each) delivers every sample of an epoch exactly once, both ranks take the same
number of steps, the order changes between epochs, and with a sample count that does not divide, what
`zoo.datamodules.partition` says is left out is left out, and a different part each epoch.

The distributed run executes this file as a script (`python tests/test_streaming_ranks.py OUT`), because
Lightning starts the second rank by re-running it. Its workers are forked (each spawned worker would
re-import torch and Lightning, seconds apiece); that spawned workers read only their rank's part is checked
in tests/test_streaming.py.
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

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from test_streaming import sample_id, write_shards  # noqa: E402

from zoo.datamodules.partition import Layout, plan_epoch  # noqa: E402
from zoo.datamodules.shards import TarSamples, count_shards  # noqa: E402
from zoo.datamodules.streaming import StreamDataset, StreamLoader, rank_and_world  # noqa: E402

BATCH, WORKERS, EPOCHS = 3, 2, 2
CORPORA = {"divisible": 48, "ragged": 50}  # 48 = 2 ranks x 2 workers x 3 x 4; 50 leaves 2 out per epoch


class ShardStream(L.LightningDataModule):
    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder

    def setup(self, stage: str) -> None:
        urls = sorted(str(p) for p in Path(self.folder).glob("*.tar"))
        self.stream = StreamDataset(count_shards(urls, TarSamples()), TarSamples(), sample_id, seed=7)

    def train_dataloader(self) -> StreamLoader:
        rank, world = rank_and_world(self.trainer)  # bound here, in the main process
        return StreamLoader(self.stream, list, BATCH, rank, world, WORKERS)


class Recorder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.steps: list[tuple[int, list[int]]] = []

    def training_step(self, batch: list[int], batch_idx: int) -> torch.Tensor:
        self.steps.append((self.current_epoch, batch))
        return (self.weight * len(batch)).pow(2).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(out: str) -> None:
    torch.set_num_threads(1)
    for name, folder in sorted((p.name, p) for p in Path(out).iterdir() if p.is_dir()):
        model = Recorder()
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy="ddp", max_epochs=EPOCHS, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(model, datamodule=ShardStream(str(folder)))
        (Path(out) / f"{name}.rank{trainer.global_rank}.json").write_text(json.dumps(model.steps))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[list]]:
    out = tmp_path_factory.mktemp("ranks")
    for name, samples in CORPORA.items():
        write_shards(out / name, samples, 7)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(
        [sys.executable, __file__, str(out)], cwd=out, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"distributed run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {
        name: [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(2)] for name in CORPORA
    }


def by_epoch(steps: list) -> dict[int, list[int]]:
    epochs: dict[int, list[int]] = {}
    for epoch, batch in steps:
        epochs.setdefault(epoch, []).extend(batch)
    return epochs


def test_two_ranks_of_two_workers_deliver_every_sample_once_per_epoch_in_equal_steps(runs):
    ranks = runs["divisible"]
    assert len(ranks[0]) == len(ranks[1]) == EPOCHS * 48 // 2 // BATCH
    for epoch in range(EPOCHS):
        both = by_epoch(ranks[0])[epoch] + by_epoch(ranks[1])[epoch]
        assert sorted(both) == list(range(48)), f"epoch {epoch}"
    for rank in ranks:
        assert by_epoch(rank)[0] != by_epoch(rank)[1]


def test_a_sample_count_that_does_not_divide_leaves_out_what_the_partition_says_and_not_twice_the_same(runs):
    ranks = runs["ragged"]
    per_rank_steps = 50 // 2 // BATCH  # 8 batches of 3 per rank: 48 samples used, 2 left out per epoch
    assert len(ranks[0]) == len(ranks[1]) == EPOCHS * per_rank_steps
    counts = [7] * 7 + [1]
    left_out = []
    for epoch in range(EPOCHS):
        used = by_epoch(ranks[0])[epoch] + by_epoch(ranks[1])[epoch]
        assert len(used) == len(set(used)) == 48
        planned = set()
        for rank in range(2):
            for plan in plan_epoch(counts, 7, epoch, True, Layout(rank, 2, WORKERS, BATCH)):
                planned |= {7 * p.shard + p.first + k for p in plan.pieces for k in range(p.count)}
        assert set(used) == planned
        left_out.append(set(range(50)) - planned)
    assert all(len(s) == 2 for s in left_out) and left_out[0] != left_out[1]


if __name__ == "__main__":
    main(sys.argv[1])
