"""RLTask as a specification: RL steps of a warm-started tiny model change its weights and log the RL
statistics; steps without signal leave the weights alone but still count; checkpoints load weights-only;
starting weights and their tokenizer come from a pretraining checkpoint; every configs/rl YAML builds."""

from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from zoo.cli import ZooCLI
from zoo.config import to_config
from zoo.datamodules.sequence import SequenceBuilder, TextSegment
from zoo.hub import build_from_config
from zoo.registry import create_model
from zoo.rl.data import QueryDataModule, RLDataModule
from zoo.rl.hints import HintSchedule
from zoo.rl.losses import PolicyLossConfig
from zoo.rl.schedulers import SyncScheduler, URBScheduler
from zoo.rl.scoring import ScoringConfig
from zoo.rl.task import RLTask, RolloutConfig
from zoo.rl.tasks_text import training_text
from zoo.rl.update import OptimConfig, UpdateConfig
from zoo.tokenizers.text import TextTokenizer

TINY = dict(
    dim=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, expert_hidden=16, top_k=2, max_seq_len=64
)
RL_CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs" / "rl").glob("*.yaml"))


def make_data(model, **overrides) -> RLDataModule:
    args = dict(
        tasks=("add",), difficulties=(1,), train_size=64, heldout_size=16, tokenizer_size=300,
        steps_per_epoch=4, val_batch_size=16,
    )  # fmt: skip
    return RLDataModule(vocab=model.vocab, **{**args, **overrides})


def warm_start(model, data: RLDataModule, steps: int = 50) -> None:
    """A short supervised start on "a+b=c" texts, so that sampled answers are sometimes right."""
    data.setup()
    vocab = model.vocab
    docs = [
        [TextSegment([vocab.bos_id, *data.encode_text(training_text(q)), vocab.eos_id])]
        for q in data.train_queries()
    ]
    builder = SequenceBuilder(vocab, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        start = (step * 16) % len(docs)
        loss = model(builder.collate(docs[start : start + 16])).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.fixture(scope="module")
def warm_state() -> tuple[dict, str]:
    torch.manual_seed(0)
    model = create_model("tiny", **TINY)
    data = make_data(model)
    warm_start(model, data)
    return {k: v.clone() for k, v in model.state_dict().items()}, data.tokenizer.to_json()


def warm_model(state: tuple[dict, str]):
    model = create_model("tiny", **TINY)
    model.load_state_dict(state[0])
    return model


def fit(
    task: RLTask, data: RLDataModule, tmp_path: Path, steps: int = 2, ckpt_path: Path | None = None, **kwargs
) -> L.Trainer:
    settings = dict(
        accelerator="cpu", max_steps=steps, default_root_dir=tmp_path, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        num_sanity_val_steps=0, limit_val_batches=1,
    )  # fmt: skip
    trainer = L.Trainer(**{**settings, **kwargs})
    trainer.fit(task, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def changed(model, before: dict) -> list[str]:
    return [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]


@pytest.mark.parametrize(
    "algorithm, scheduler, precision",
    [("gspo_misc", "urb", "bfloat16"), ("grpo", "sync", "float32")],
)
def test_two_rl_steps_of_a_warm_started_tiny_model_change_its_weights(
    warm_state, tmp_path: Path, algorithm: str, scheduler: str, precision: str
):
    torch.manual_seed(1)
    model = warm_model(warm_state)
    data = make_data(model)
    data.use_tokenizer(TextTokenizer.from_json(warm_state[1]))
    task = RLTask(
        model,
        scheduler=URBScheduler(n_groups=2) if scheduler == "urb" else SyncScheduler(),
        loss=PolicyLossConfig(algorithm=algorithm, wpsm_alpha=0.5, wpsm_tau=0.1, wpsm_eta=5.0),
        rollout=RolloutConfig(precision=precision, max_new_tokens=6),
        # Character hints: most answers here are one token, which a token hint of half would leave out.
        hints=HintSchedule(p_init=0.5, unit="characters", pass_samples=2)
        if scheduler == "urb"
        else HintSchedule(p_init=0.0),
        update=UpdateConfig(batch_size=4, group_size=8, micro_batch_size=12),
        optim=OptimConfig(lr=1e-3),
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = fit(task, data, tmp_path, val_check_interval=2, check_val_every_n_epoch=None)
    assert trainer.global_step == 2 and task.version == 2
    assert changed(model, before), "two RL steps left every weight unchanged"
    metrics = trainer.callback_metrics
    for key in (
        "reward", "accuracy", "entropy", "mismatch_kl", "masked_fraction", "clipped_fraction",
        "response_length", "policy_lag", "hint_ratio", "zero_variance_groups", "trained_samples",
        "wpsm_fraction",
    ):  # fmt: skip
        assert f"train/{key}" in metrics, key
    assert 0.0 <= float(metrics["val/accuracy"]) <= 1.0
    # The engine follows the trainer: synced to the new weights as version 2.
    assert task.engine.version == 2
    if scheduler == "urb":
        assert len(task.hint_controller.pass_init) == data.train_size  # measured once, at the start
        assert float(metrics["train/hint_ratio"]) > 0
        assert float(metrics["train/mismatch_kl"]) > 0  # bfloat16 engine vs float32 trainer


def test_steps_without_any_signal_leave_the_weights_unchanged_but_still_count(tmp_path: Path):
    torch.manual_seed(0)
    model = create_model("tiny", **TINY)  # untrained: every answer wrong, every group's rewards equal
    data = make_data(model)
    task = RLTask(
        model, rollout=RolloutConfig(max_new_tokens=4), update=UpdateConfig(batch_size=2, group_size=4),
        optim=OptimConfig(lr=1e-2),
    )  # fmt: skip
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = fit(task, data, tmp_path, limit_val_batches=0)
    assert trainer.global_step == 2
    assert not changed(model, before)
    assert float(trainer.callback_metrics["train/zero_variance_groups"]) == 2.0
    assert float(trainer.callback_metrics["train/trained_samples"]) == 0.0


def test_a_checkpoint_loads_weights_only_and_carries_the_rl_state(warm_state, tmp_path: Path):
    model = warm_model(warm_state)
    data = make_data(model)
    update = UpdateConfig(batch_size=2, group_size=4)
    task = RLTask(model, rollout=RolloutConfig(max_new_tokens=4), update=update)
    trainer = fit(task, data, tmp_path, steps=1, limit_val_batches=0)
    path = tmp_path / "rl.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    assert checkpoint["rl_state"]["version"] == 1
    assert checkpoint["hyper_parameters"]["model"]["class_path"] == "zoo.models.unified.UnifiedModel"
    assert any(isinstance(v, dict) and "tokenizer" in v for v in checkpoint.values())
    resumed = RLTask(warm_model(warm_state))
    resumed.on_load_checkpoint(checkpoint)
    assert resumed.version == 1


def test_a_resumed_urb_run_continues_its_in_flight_rollouts_exactly_as_an_uninterrupted_one(
    warm_state, tmp_path: Path
):
    def urb_task() -> tuple[RLTask, RLDataModule]:
        torch.manual_seed(1)
        model = warm_model(warm_state)
        data = make_data(model)
        data.use_tokenizer(TextTokenizer.from_json(warm_state[1]))
        task = RLTask(
            model, scheduler=URBScheduler(n_groups=2), rollout=RolloutConfig(max_new_tokens=6),
            update=UpdateConfig(batch_size=2, group_size=4), optim=OptimConfig(lr=1e-3),
        )  # fmt: skip
        return task, data

    straight, data = urb_task()
    fit(straight, data, tmp_path / "straight", steps=4, limit_val_batches=0)
    first, data = urb_task()
    trainer = fit(first, data, tmp_path / "first", steps=2, limit_val_batches=0)
    path = tmp_path / "urb.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, map_location="cpu", weights_only=True)["rl_state"]["scheduler"]
    rollouts = [r for group in state["groups"].values() for r in group]
    # D_2 is queued in the engine when step 2 ends (its partial rollouts: tests/test_rl_schedulers.py).
    in_flight = [r for r in rollouts if r["queued"] >= 0]
    assert in_flight and all(not r["finished"] and not r["truncated"] for r in in_flight)
    resumed, data = urb_task()
    fit(resumed, data, tmp_path / "resumed", steps=4, limit_val_batches=0, ckpt_path=path)
    assert resumed.version == 4 and resumed.scheduler.iteration == 4
    mismatched = [
        k for k, v in straight.model.state_dict().items() if not torch.equal(v, resumed.model.state_dict()[k])
    ]
    assert not mismatched, f"the resumed run diverged from the uninterrupted one in {mismatched[:3]}"


def test_the_run_seed_changes_the_sampled_rollouts_and_the_same_seed_repeats_them(warm_state, tmp_path: Path):
    def one_step(seed: int) -> dict:
        L.seed_everything(seed)  # what `seed_everything: k` in a config does
        model = warm_model(warm_state)
        data = make_data(model)
        data.use_tokenizer(TextTokenizer.from_json(warm_state[1]))
        task = RLTask(
            model, rollout=RolloutConfig(max_new_tokens=6), update=UpdateConfig(batch_size=4, group_size=4),
            optim=OptimConfig(lr=1e-3),
        )  # fmt: skip
        fit(task, data, tmp_path / str(seed), steps=1, limit_val_batches=0)
        assert task.run_seed == seed
        return {k: v.clone() for k, v in model.state_dict().items()}

    first, other, again = one_step(0), one_step(1), one_step(0)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert any(not torch.equal(first[k], other[k]) for k in first), "seed 1 trained exactly as seed 0"


def test_each_rollout_is_scored_as_soon_as_the_engine_finishes_it(warm_state, tmp_path: Path):
    model = warm_model(warm_state)
    data = make_data(model)
    data.use_tokenizer(TextTokenizer.from_json(warm_state[1]))
    update = UpdateConfig(batch_size=4, group_size=4)
    task = RLTask(model, rollout=RolloutConfig(max_new_tokens=6), update=update)
    in_flight_at_submission = []
    submit = task._submit_for_scoring

    def recording_submit(rollout) -> None:
        in_flight_at_submission.append(task.engine.pending)
        submit(rollout)

    task._submit_for_scoring = recording_submit
    trainer = fit(task, data, tmp_path, steps=2, limit_val_batches=0)
    assert len(in_flight_at_submission) == 2 * 4 * 4  # every rollout once, none scored twice
    # Answers end at different lengths: early ones were handed to the verifiers while others generated.
    assert max(in_flight_at_submission) > 0
    assert not task.scorer.in_flight, "a submitted verifier call was never collected"
    assert 0 <= float(trainer.callback_metrics["train/reward"]) <= 1
    assert "train/score_wait_s" in trainer.callback_metrics


def test_init_from_a_pretraining_checkpoint_loads_its_weights_and_tokenizer(tmp_path: Path):
    torch.manual_seed(3)
    source = create_model("tiny", **TINY)
    tokenizer = TextTokenizer.train(["1+2=3", "4+5=9", "12+30=42"] * 10, vocab_size=262)
    path = tmp_path / "pretrain.ckpt"
    torch.save(
        {
            "state_dict": {f"model.{k}": v for k, v in source.state_dict().items()},
            "hyper_parameters": {"model": to_config(source)},
            "TextFilesDataModule": {"tokenizer": tokenizer.to_json()},
        },
        path,
    )
    torch.manual_seed(4)
    task = RLTask(create_model("tiny", **TINY), init_from=str(path))
    assert all(
        torch.equal(a, b)
        for a, b in zip(task.model.state_dict().values(), source.state_dict().values(), strict=True)
    )
    data = make_data(task.model)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    trainer.strategy.connect(task)
    task.trainer = trainer
    trainer.datamodule = data  # what fit() does before setup
    task.setup("fit")
    assert data.tokenizer.to_json() == tokenizer.to_json()
    with pytest.raises(ValueError, match="init_from"):
        RLTask(create_model("tiny", **{**TINY, "dim": 64}), init_from=str(path))
    with pytest.raises(ValueError, match="init_from"):
        RLTask(create_model("tiny", **TINY), init_from=str(tmp_path / "weights.bin"))


def test_frozen_parameters_stay_fixed_under_rl_steps_while_the_others_move(warm_state, tmp_path: Path):
    torch.manual_seed(1)
    model = warm_model(warm_state)
    data = make_data(model)
    data.use_tokenizer(TextTokenizer.from_json(warm_state[1]))
    task = RLTask(
        model, rollout=RolloutConfig(max_new_tokens=4), update=UpdateConfig(batch_size=4, group_size=8),
        optim=OptimConfig(lr=1e-3, frozen=("text_embed", "text_head.output")),
    )  # fmt: skip
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fit(task, data, tmp_path, steps=2, limit_val_batches=0)
    moved = changed(model, before)
    assert moved, "two RL steps left every weight unchanged"
    assert not [k for k in moved if k.startswith(("text_embed.", "text_head.output."))], moved
    trainable = {id(p) for group in task.optimizers().optimizer.param_groups for p in group["params"]}
    assert id(model.text_embed.weight) not in trainable and id(model.text_head.output.weight) not in trainable


def test_bad_rl_arguments_are_refused_by_name():
    model = create_model("tiny", **TINY)
    with pytest.raises(ValueError, match="group_size"):
        RLTask(model, update=UpdateConfig(group_size=0))
    with pytest.raises(ValueError, match="truncated"):
        RLTask(model, scoring=ScoringConfig(truncated="drop"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="frozen: 'text_embedding'"):
        RLTask(model, optim=OptimConfig(frozen=("text_embedding",)))  # no parameter's prefix (text_embed is)


def provide_starting_checkpoint(path: Path, run_dir: Path) -> None:
    """A config whose `init_from` names an earlier run's last.ckpt (configs/rl/grpo_video.yaml: the video
    demo's) builds as it would after that run: an untrained checkpoint of its model is written there."""
    init_args = yaml.safe_load(path.read_text())["model"]["init_args"]
    start = init_args.get("init_from")
    if not isinstance(start, str):
        return
    model = build_from_config(init_args["model"])
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    (run_dir / start).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": state, "hyper_parameters": {"model": to_config(model)}}, run_dir / start)


@pytest.mark.parametrize("path", RL_CONFIGS, ids=lambda p: p.stem)
def test_every_rl_config_builds_an_rl_task_and_its_datamodule(path: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["zoo"])
    monkeypatch.chdir(tmp_path)  # a relative init_from is read from here
    provide_starting_checkpoint(path, tmp_path)
    cli = ZooCLI(args=["--config", str(path), f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert isinstance(cli.model, RLTask) and isinstance(cli.datamodule, QueryDataModule)
    assert cli.datamodule.vocab == cli.model.model.vocab
    assert cli.model.loss_config.algorithm in path.stem or path.stem == "urb"


def correct_probability(model, data: RLDataModule, queries: list) -> float:
    """Mean exact probability of the reference answer + <eos> (what sampled accuracy estimates)."""
    from zoo.rl.records import Rollout
    from zoo.rl.replay import sequence_logprobs

    rollouts = [
        Rollout(q, data.base_prompt_ids(q), [*data.encode_text(q.answer), model.vocab.eos_id],
                torch.zeros(0), None, [], True, False)
        for q in queries
    ]  # fmt: skip
    with torch.no_grad():
        return float(torch.stack([lp.sum().exp() for lp in sequence_logprobs(model, rollouts)]).mean())


def test_rl_steps_raise_the_probability_of_correct_answers_and_the_permuted_control_does_not(
    warm_state, tmp_path: Path
):
    """The end-to-end sign check: rewarded answers become likelier. A flipped advantage, log-probs of the
    wrong tokens or a leak of another loss into the update fails it; the same steps with each group's
    rewards permuted (`permute_rewards`) move the weights as much but not the answers' probability."""
    gains = {}
    for control in (False, True):
        torch.manual_seed(5)
        model = warm_model(warm_state)
        data = make_data(model, train_size=4)
        data.use_tokenizer(TextTokenizer.from_json(warm_state[1]))
        before = correct_probability(model, data, data.train_queries())
        task = RLTask(
            model,
            loss=PolicyLossConfig(algorithm="gspo", icepop=False),
            rollout=RolloutConfig(max_new_tokens=4),
            update=UpdateConfig(batch_size=4, group_size=8, permute_rewards=control),
            optim=OptimConfig(lr=3e-3),
        )  # fmt: skip
        fit(task, data, tmp_path, steps=6, limit_val_batches=0)
        gains[control] = correct_probability(model, data, data.train_queries()) - before
    assert gains[False] > 0.05, gains
    assert gains[False] > gains[True] + 0.05, gains


def test_the_flat_arguments_of_an_older_rl_checkpoint_are_put_in_their_groups():
    old = {
        "model": {"class_path": "zoo.models.unified.UnifiedModel"}, "loss": {"algorithm": "grpo"},
        "batch_size": 16, "lr": 2e-5, "frozen": ("text_embed",), "truncated": "mask", "init_from": None,
    }  # fmt: skip
    grouped = RLTask.upgrade_init_args(old)
    assert grouped == {
        "model": old["model"], "loss": old["loss"], "init_from": None, "update": {"batch_size": 16},
        "optim": {"lr": 2e-5, "frozen": ["text_embed"]}, "scoring": {"truncated": "mask"},
    }  # fmt: skip
    assert RLTask.upgrade_init_args(grouped) == grouped
    task = RLTask(create_model("tiny", **TINY), update=UpdateConfig(**grouped["update"]))
    assert task.update_config.batch_size == 16
