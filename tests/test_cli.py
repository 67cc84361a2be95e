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
    run = tmp_path / "runs" / "quickstart"
    checkpoint = run / "checkpoints" / "last.ckpt"
    assert checkpoint.is_file()
    assert list(run.glob("logs/version_*/samples.md")), "the sample callback writes samples.md"

    main(
        [
            "predict",
            "--config",
            QUICKSTART,
            "--config",
            PREDICT,
            "--trainer.enable_progress_bar=false",
            "--model.init_args.sampling.max_new_tokens=8",
            f"--ckpt_path={checkpoint}",
        ]
    )
    output = run / "predictions.jsonl"
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rows) == 4
    assert rows[1]["prompt"] == "a small red"
    assert all(isinstance(r["text"], str) and 1 <= len(r["ids"]) <= 8 for r in rows)
    assert "generations written" in capsys.readouterr().out

    # The checkpoint holds no pickled objects: it loads with weights_only=True and rebuilds the task.
    torch.load(checkpoint, map_location="cpu", weights_only=True)
    task = UnifiedPretraining.load_from_checkpoint(checkpoint, map_location="cpu")
    assert task.model.backbone.n_layers == 4
