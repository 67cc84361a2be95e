"""`zoo ablate`: variants of one config over seeds, trained and validated, summarised with their spread."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from zoo.cli import main

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
SMALL_RUN = [
    "trainer.max_steps=3",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false",
    "data.init_args.train_size=64",
    "data.init_args.val_size=8",
    "data.init_args.batch_size=4",
]


@pytest.fixture(autouse=True)
def clean_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["zoo"])


def ablate(out: Path, overlay: Path, seeds: list[str], *extra: str) -> dict:
    args = ["ablate", "--config", QUICKSTART, "--variant", "base=", "--variant", f"no_mtp={overlay}",
            "--seeds", *seeds, "--out", str(out), *extra]
    for setting in SMALL_RUN:
        args += ["--set", setting]
    main(args)
    return json.loads((out / "results.json").read_text())


def test_ablation_trains_every_variant_at_every_seed_and_summarises(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overlay = tmp_path / "no_mtp.yaml"
    overlay.write_text("model:\n  init_args:\n    model:\n      init_args:\n        mtp_depth: 0\n")
    results = ablate(
        tmp_path / "ab", overlay, ["0", "1"], "--set", "trainer.log_every_n_steps=1",
        "--train-metrics", "train/loss", "--window", "2",
    )  # fmt: skip

    runs = results["runs"]
    assert set(runs) == {"base", "no_mtp"} and all(set(r) == {"0", "1"} for r in runs.values())
    # The overlay really changed the model: the MTP loss exists only in the base runs.
    assert any("mtp" in k for k in runs["base"]["0"]) and not any("mtp" in k for k in runs["no_mtp"]["0"])
    loss = results["summary"]["base"]["val/text/ntp_loss"]
    values = [runs["base"][s]["val/text/ntp_loss"] for s in ("0", "1")]
    assert loss["n"] == 2 and loss["mean"] == pytest.approx(sum(values) / 2)
    assert loss["std"] > 0  # two seeds, two different runs
    # Training curves from each run's CSV log: the mean of the first and last two logged losses.
    with (tmp_path / "ab" / "base" / "seed0" / "logs" / "metrics.csv").open() as f:
        logged = [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]
    assert runs["base"]["0"]["train/loss[first2]"] == pytest.approx(sum(logged[:2]) / 2)
    assert runs["base"]["0"]["train/loss[last2]"] == pytest.approx(sum(logged[-2:]) / 2)
    assert (tmp_path / "ab" / "curves.png").stat().st_size > 0
    table = (tmp_path / "ab" / "results.md").read_text()
    assert "| no_mtp |" in table and "(n=2)" in table
    # Every run stayed in its own directory: CSV curves there, nothing written by the base config's
    # checkpoint callback (runs/quickstart/...).
    assert (tmp_path / "ab" / "no_mtp" / "seed1" / "logs" / "metrics.csv").is_file()
    assert not (tmp_path / "runs").exists()


def test_same_seed_reproduces_and_finished_runs_are_not_repeated(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    overlay = tmp_path / "no_mtp.yaml"
    overlay.write_text("model:\n  init_args:\n    model:\n      init_args:\n        mtp_depth: 0\n")
    first = ablate(tmp_path / "a", overlay, ["0"])
    again = ablate(tmp_path / "b", overlay, ["0"])
    loss = first["runs"]["base"]["0"]["val/loss"]
    assert loss == pytest.approx(again["runs"]["base"]["0"]["val/loss"], abs=1e-6)
    capsys.readouterr()
    ablate(tmp_path / "a", overlay, ["0"])
    assert capsys.readouterr().out.count("already in") == 2


def test_a_variant_without_name_or_with_a_missing_overlay_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="NAME=OVERLAY"):
        main(["ablate", "--config", QUICKSTART, "--variant", "x.yaml", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="does not exist"):
        main(["ablate", "--config", QUICKSTART, "--variant", "a=missing.yaml", "--out", str(tmp_path)])
