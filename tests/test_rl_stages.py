"""The multi-stage RL configs as a specification (configs/rl/stages/, scripts/post_train.sh): each stage
starts from the previous stage's output by its own `init_from`, and the chain runs through `zoo fit`, two RL
steps a stage, stage 2 from stage 1's last.ckpt and so on (stage 1 from fresh weights here: SFT is its own
test).

One of the few essential end-to-end tests: four `zoo fit` runs of the demo's architecture (about a minute)."""

from pathlib import Path

import pytest
import torch
import yaml

from zoo.cli import ZooCLI, main

REPO = Path(__file__).resolve().parent.parent
STAGES = sorted((REPO / "configs" / "rl" / "stages").glob("*.yaml"))
LAST = "latest/checkpoints/last.ckpt"

# Two steps of everything, tiny batches; every stage saves its last.ckpt where the next one looks for it.
SHORT = {
    "trainer": {
        "max_steps": 2, "val_check_interval": 2, "limit_val_batches": 1, "enable_progress_bar": False,
        "callbacks": [
            {"class_path": "zoo.tasks.checkpointing.ZooCheckpoint",
             "init_args": {"save_last": True, "every_n_train_steps": 2}},
        ],
    },
    "model": {"init_args": {
        "rollout": {"max_new_tokens": 8, "max_audio_frames": 4},
        "update": {"batch_size": 2, "group_size": 2, "micro_batch_size": 4},
        "scoring": {"val_max_new_tokens": 8},
    }},
    "data": {"init_args": {"train_size": 8, "heldout_size": 2, "val_batch_size": 2}},
}  # fmt: skip


def config(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_the_stages_are_numbered_in_order_and_each_starts_from_the_previous_ones_output():
    assert [p.stem for p in STAGES] == ["1_reasoning", "2_multimodal", "3_instructions", "4_tools"]
    roots = [config(p)["trainer"]["default_root_dir"] for p in STAGES]
    starts = [config(p)["model"]["init_args"]["init_from"] for p in STAGES]
    assert starts[0] == f"runs/sft/tiny/{LAST}"  # the SFT stage's output (configs/sft/tiny.yaml)
    assert starts[1:] == [f"{root}/{LAST}" for root in roots[:-1]]
    models = [config(p)["model"]["init_args"]["model"] for p in STAGES]
    assert all(m == models[0] for m in models), "a stage changes the architecture: init_from would refuse it"
    assert models[0]["init_args"]["vocab"]["chat"] is True
    assert all(config(p)["data"]["init_args"]["vocab"] == models[0]["init_args"]["vocab"] for p in STAGES)


def test_the_rl_chain_runs_two_steps_a_stage_each_from_the_last(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the configs' relative run folders land here
    monkeypatch.setattr("sys.argv", ["zoo"])
    short = tmp_path / "short.yaml"
    short.write_text(yaml.safe_dump(SHORT))
    previous = None
    for i, path in enumerate(STAGES):
        start = ["--model.init_args.init_from=null"] if i == 0 else []
        args = ["--config", str(path), "--config", str(short), *start]
        if previous is not None:  # the stage's task, as built, holds the previous stage's last weights
            built = ZooCLI(args=args, run=False).model.model.state_dict()
            assert built.keys() == {k.removeprefix("model.") for k in previous}
            assert all(torch.equal(built[k.removeprefix("model.")], v) for k, v in previous.items())
        main(["fit", *args])
        last = tmp_path / config(path)["trainer"]["default_root_dir"] / LAST
        assert last.is_file(), f"{path.stem} wrote no {last}"
        state = torch.load(last, map_location="cpu", weights_only=True)
        assert state["global_step"] == 2 and state["rl_state"]["version"] == 2
        previous = {k: v for k, v in state["state_dict"].items() if k.startswith("model.")}


@pytest.mark.parametrize("path", STAGES, ids=lambda p: p.stem)
def test_each_stage_config_is_documented_with_its_command(path: Path):
    assert f"zoo fit --config configs/rl/stages/{path.name}" in path.read_text()
