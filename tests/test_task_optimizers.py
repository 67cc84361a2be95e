"""Every task's optimizer and schedule come from YAML (zoo/tasks/optim.py): unset, they are exactly the
recipe the tasks hard-coded before (AdamW, their parameter groups, warm-up-cosine); set, the trainer steps the
optimizer the YAML names, torch's or torchao's, with the task's parameter groups kept."""

from __future__ import annotations

import functools
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from zoo.cli import main
from zoo.cli.lightning_cli import ZooCLI
from zoo.rl.task import RLTask
from zoo.tasks.pretrain import UnifiedPretraining
from zoo.tasks.schedules import warmup_cosine
from zoo.trust import UnsafeConfigError, check_checkpoint_classes

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TOTAL = 30  # the run length the schedules are compared over


@pytest.fixture(autouse=True)
def clean_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["zoo"])


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def build(config: str, *flags: str) -> L.LightningModule:
    return ZooCLI(args=["--config", str(CONFIGS / config), *flags], run=False).model


def attach_trainer(task: L.LightningModule) -> None:
    """A real Trainer whose run length is known without data (step-limited, no epoch limit)."""
    task.trainer = L.Trainer(max_steps=TOTAL, max_epochs=-1, logger=False, enable_checkpointing=False)


def split_by_dim(parameters, weight_decay: float) -> list[dict]:
    decay = [p for p in parameters if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in parameters if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# What each task's configure_optimizers built before the optimizer became configurable, copied verbatim.
def recipe_before(task: L.LightningModule) -> tuple[torch.optim.Optimizer, int, float]:
    name = type(task).__name__
    if name == "UnifiedPretraining":
        groups = split_by_dim(list(task.model.parameters()), task.weight_decay)
        return torch.optim.AdamW(groups, lr=task.lr, betas=task.betas), task.warmup_steps, task.min_lr_ratio
    if name == "VisualTokenizerTraining":
        split = split_by_dim(list(task.tokenizer.parameters()), task.weight_decay)
        groups = [{**g, "lr": task.lr} for g in split]
        if task.adversarial is not None:
            params = list(task.adversarial.parameters())
            groups.append({"params": params, "weight_decay": 0.0, "lr": task.adversarial.lr})
        return torch.optim.AdamW(groups, betas=task.betas), task.warmup_steps, task.min_lr_ratio
    if name == "AudioTokenizerTask":
        params = [p for p in task.codec.parameters() if p.requires_grad]
        if task.distill_proj is not None:
            params += list(task.distill_proj.parameters())
        optimizer = torch.optim.AdamW(params, lr=task.lr, betas=task.betas, weight_decay=0.0)
        return optimizer, max(1, task.warmup_steps), task.min_lr_ratio
    if name == "VisionEncoderPretraining":
        groups = split_by_dim(list(task.parameters()), task.weight_decay)
        return torch.optim.AdamW(groups, lr=task.lr), task.warmup_steps, task.min_lr_ratio
    if name == "RefinerTraining":
        optimizer = torch.optim.AdamW(task.refiner.parameters(), lr=task.lr, weight_decay=task.weight_decay)
        return optimizer, task.warmup_steps, task.min_lr_ratio
    raise AssertionError(name)


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [id(p) for p in g["params"]]}
        for g in optimizer.param_groups
    ]


def rates(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler) -> list[list]:
    out = []
    for _ in range(TOTAL + 2):
        out.append([g["lr"] for g in optimizer.param_groups])
        scheduler.step()
    return out


STAGES = [
    "quickstart.yaml",
    "tokenizers/visual_2d.yaml",
    "tokenizers/visual_3d.yaml",
    "tokenizers/audio.yaml",
    "vision/encoder_dual.yaml",
    "refiner/shapes.yaml",
]


@pytest.mark.parametrize("config", STAGES)
def test_the_default_optimizer_and_schedule_are_the_recipe_the_task_had_before(config: str, in_tmp: Path):
    adversarial = "--model.init_args.adversarial=zoo.tasks.visual_tokenizer.AdversarialLoss"
    task = build(config, *([adversarial] if "2d" in config else []))
    attach_trainer(task)
    configured = task.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    assert configured["lr_scheduler"]["interval"] == "step"
    reference, warmup, floor = recipe_before(task)
    expected = warmup_cosine(reference, warmup, lambda: TOTAL, floor)["lr_scheduler"]["scheduler"]
    assert type(optimizer) is torch.optim.AdamW
    assert group_settings(optimizer) == group_settings(reference)
    assert rates(optimizer, scheduler) == rates(reference, expected)


def test_the_rl_default_is_adamw_with_its_betas_and_a_warm_up_to_a_constant_rate(in_tmp: Path):
    task = build("rl/grpo.yaml", "--model.init_args.optim.warmup_steps=4")
    scheduler = task.configure_optimizers()["lr_scheduler"]["scheduler"]
    optimizer = scheduler.optimizer
    lr = task.optim_config.lr
    assert type(optimizer) is torch.optim.AdamW
    reference = torch.optim.AdamW(
        split_by_dim(list(task.model.parameters()), task.optim_config.weight_decay), lr=lr, betas=(0.9, 0.99)
    )
    torch.optim.lr_scheduler.LambdaLR(reference, lambda s: min(1.0, (s + 1) / 4))
    assert group_settings(optimizer) == group_settings(reference)
    first = [r[0] for r in rates(optimizer, scheduler)][:6]
    assert first == pytest.approx([lr / 4, lr / 2, 3 * lr / 4, lr, lr, lr])


def write_overlay(folder: Path, model_args: dict) -> str:
    path = folder / "optimizer.yaml"
    path.write_text(yaml.safe_dump({"model": {"init_args": model_args}}))
    return str(path)


def fit_quickstart(folder: Path, overlay: str, *flags: str) -> ZooCLI:
    args = [
        "fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config", overlay,
        "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        "--trainer.logger=false", "--trainer.callbacks=[]", f"--trainer.default_root_dir={folder / 'run'}",
        "--data.init_args.train_size=32", "--data.init_args.val_size=4", *flags,
    ]  # fmt: skip
    return ZooCLI(args=args)


def test_an_optimizer_torch_ships_is_set_in_yaml_and_is_what_the_trainer_steps(in_tmp: Path):
    overlay = write_overlay(
        in_tmp,
        {
            "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.05, "momentum": 0.9}},
            "lr_scheduler": {"class_path": "torch.optim.lr_scheduler.StepLR", "init_args": {"step_size": 1}},
            "warmup_steps": 50,  # the quickstart's 40, set back: the StepLR replaces the warm-up
        },
    )
    cli = fit_quickstart(in_tmp, overlay)
    (optimizer,) = cli.trainer.optimizers
    assert type(optimizer) is torch.optim.SGD
    assert cli.trainer.global_step == 2 and optimizer.state, "the SGD really stepped (momentum buffers)"
    # The task's groups are kept: no weight decay on vectors, the task's on matrices; StepLR's 0.1 twice.
    decays = sorted({g["weight_decay"] for g in optimizer.param_groups})
    assert decays == [0.0, cli.model.weight_decay]
    groups = optimizer.param_groups
    assert all(g["lr"] == pytest.approx(0.05 * 0.1**2) and g["momentum"] == 0.9 for g in groups)
    # The checkpoint names torch's classes, which the checkpoint check allows, and loads code-free.
    checkpoint = in_tmp / "sgd.ckpt"
    cli.trainer.save_checkpoint(checkpoint)
    hparams = torch.load(checkpoint, map_location="cpu", weights_only=True)["hyper_parameters"]
    check_checkpoint_classes(hparams, str(checkpoint))
    assert hparams["optimizer"]["class_path"] == "torch.optim.SGD"
    reloaded = UnifiedPretraining.load_from_checkpoint(checkpoint, map_location="cpu")
    reloaded.trainer = cli.trainer
    assert type(reloaded.configure_optimizers()["optimizer"]) is torch.optim.SGD


def test_an_optimizer_torchao_ships_is_set_in_yaml_and_runs_on_cpu(in_tmp: Path):
    overlay = write_overlay(
        in_tmp, {"optimizer": {"class_path": "torchao.optim.AdamW8bit", "init_args": {"lr": 1e-3}}}
    )
    # torchao compiles its step per parameter shape (minutes for this model on 2 CPU cores); eager runs the
    # same 8-bit update, which is what is under test here.
    with torch._dynamo.config.patch(disable=True):
        cli = fit_quickstart(in_tmp, overlay)
    (optimizer,) = cli.trainer.optimizers
    assert type(optimizer).__module__.startswith("torchao.optim") and type(optimizer).__name__ == "AdamW8bit"
    assert cli.trainer.global_step == 2
    # Its groups are the task's, and the default warm-up-cosine still schedules it.
    assert sorted({g["weight_decay"] for g in optimizer.param_groups}) == [0.0, cli.model.weight_decay]
    reference = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    schedule = warmup_cosine(reference, 40, lambda: 2, 0.1)["lr_scheduler"]["scheduler"]
    for _ in range(2):
        reference.step()
        schedule.step()
    assert float(optimizer.param_groups[0]["lr"]) == pytest.approx(reference.param_groups[0]["lr"])


def test_an_optimizer_outside_torch_and_torchao_is_refused_before_anything_is_imported(in_tmp: Path, capsys):
    overlay = write_overlay(in_tmp, {"optimizer": {"class_path": "os.system", "init_args": {}}})
    with pytest.raises(SystemExit):
        ZooCLI(args=["--config", str(CONFIGS / "quickstart.yaml"), "--config", overlay], run=False)
    assert "os.system" in capsys.readouterr().err
    with pytest.raises(UnsafeConfigError, match="not an optimizer"):
        check_checkpoint_classes({"optimizer": {"class_path": "torch.optim.lr_scheduler.Tensor"}}, "ckpt")
    with pytest.raises(UnsafeConfigError, match="only classes defined under"):
        check_checkpoint_classes({"optimizer": {"class_path": "torchvision.ops.nms"}}, "ckpt")


def test_a_default_recipe_argument_a_configured_optimizer_would_ignore_is_refused_by_name(in_tmp: Path):
    model = build("quickstart.yaml").model
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"lr=0.01 belong to the default recipe.*optimizer.init_args"):
        UnifiedPretraining(model, lr=0.01, optimizer=sgd)
    step = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=10)
    with pytest.raises(ValueError, match=r"warmup_steps=5 .*lr_scheduler"):
        UnifiedPretraining(model, warmup_steps=5, lr_scheduler=step)
    with pytest.raises(ValueError, match=r"OptimConfig: lr=0.001 belong"):
        build(
            "rl/grpo.yaml", "--model.init_args.optim.lr=1e-3", "--model.init_args.optimizer=torch.optim.SGD"
        )


def test_an_optimizer_given_in_python_is_saved_as_the_yaml_that_rebuilds_it(in_tmp: Path):
    model = build("quickstart.yaml").model
    task = UnifiedPretraining(model, optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.5))
    assert task.hparams["optimizer"] == {
        "class_path": "torch.optim.sgd.SGD",
        "init_args": {"lr": 0.1, "momentum": 0.5},
    }
    attach_trainer(task)
    optimizer = task.configure_optimizers()["optimizer"]
    assert type(optimizer) is torch.optim.SGD and optimizer.param_groups[0]["momentum"] == 0.5


def test_rl_takes_its_optimizer_and_schedule_from_yaml_and_keeps_its_groups(in_tmp: Path):
    task = build(
        "rl/grpo.yaml",
        "--model.init_args.optim.lr=1e-5",  # grpo.yaml's 2e-5 set back to the default: SGD has its own
        "--model.init_args.optimizer=torch.optim.SGD",
        "--model.init_args.optimizer.lr=0.2",
        "--model.init_args.lr_scheduler=torch.optim.lr_scheduler.ConstantLR",
    )
    assert isinstance(task, RLTask)
    configured = task.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    assert type(optimizer) is torch.optim.SGD and type(scheduler) is torch.optim.lr_scheduler.ConstantLR
    assert [g["weight_decay"] for g in optimizer.param_groups] == [task.optim_config.weight_decay, 0.0]
    trainable = sum(p.numel() for p in task.model.parameters() if p.requires_grad)
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == trainable


def test_zoo_fit_print_config_shows_the_optimizer_and_schedule_slots(in_tmp: Path, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(CONFIGS / "tokenizers" / "audio.yaml"), "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["init_args"]["optimizer"] is None
    assert printed["model"]["init_args"]["lr_scheduler"] is None
