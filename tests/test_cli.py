"""The `zoo` command end to end: fit a few steps from the quickstart YAML, then predict from the
checkpoint, then reload the checkpoint in Python with weights_only loading."""

import json
from pathlib import Path

import torch

from zoo.cli import main
from zoo.tasks.pretrain import UnifiedPretraining

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
PREDICT = str(ROOT / "configs" / "predict.yaml")


def test_fit_then_predict_from_the_checkpoint(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the YAML's relative paths (runs/quickstart/...) land in tmp_path
    main(
        [
            "fit",
            "--config",
            QUICKSTART,
            "--trainer.max_steps=4",
            "--trainer.val_check_interval=2",
            "--trainer.limit_val_batches=1",
            "--trainer.enable_progress_bar=false",
            "--data.init_args.train_size=256",
            "--data.init_args.val_size=16",
            "--model.init_args.sampling.max_new_tokens=8",
        ]
    )
    root = tmp_path / "runs" / "quickstart"
    run = root / "latest"  # each fit writes its own runs/quickstart/version_N; latest points at the newest
    assert run.resolve() == root / "version_0"
    checkpoint = run / "checkpoints" / "last.ckpt"
    assert checkpoint.is_file()
    assert (run / "logs" / "samples.md").is_file(), "the sample callback writes samples.md in the run"

    main(
        [
            "predict",
            "--config",
            QUICKSTART,
            "--config",
            PREDICT,
            "--trainer.enable_progress_bar=false",
            "--model.init_args.sampling.max_new_tokens=3",  # the flag wins over the checkpoint's 8
            f"--ckpt_path={checkpoint}",
        ]
    )
    output = root / "predictions.jsonl"
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rows) == 4
    assert rows[1]["prompt"] == "a small red"
    assert all(isinstance(r["text"], str) and 1 <= len(r["ids"]) <= 3 for r in rows)
    assert any(len(r["ids"]) == 3 for r in rows)
    captured = capsys.readouterr()
    assert "generations written" in captured.out
    assert "sampling.max_new_tokens: checkpoint 8 -> config 3" in captured.err, "an override is never silent"

    # The checkpoint holds no pickled objects: it loads with weights_only=True and rebuilds the task.
    torch.load(checkpoint, map_location="cpu", weights_only=True)
    task = UnifiedPretraining.load_from_checkpoint(checkpoint, map_location="cpu")
    assert task.model.backbone.n_layers == 4
