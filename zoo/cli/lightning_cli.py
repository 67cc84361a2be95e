"""`zoo fit|validate|test|predict`: LightningCLI with the allow-list, checkpoint checks and run folders.

On top of Lightning's CLI (subclass mode: the task and the datamodule are chosen by `class_path` in YAML):
- every class path a YAML file or a flag names passes `zoo.trust`'s allow-list before it is imported;
- `--ckpt_path` is read by the zoo (`zoo.cli.checkpoint`), never by Lightning's `_parse_ckpt_path`: its class
  paths must be zoo classes, its hyper-parameters sit under the user's config (which wins, key by key), every
  difference is named, and a model the checkpoint's weights do not fit is refused before loading;
- `--ckpt_overrides`: `auto` (default) refuses a resumed `fit` whose model config differs from the
  checkpoint's, or whose checkpoint belongs to another run, and lets `validate/test/predict` override with a
  warning; `allow` and `refuse` say so for every subcommand;
- `fit` writes into its own run folder (`zoo.cli.runs`), and the tokenizer comes from the checkpoint;
- the progress bar counts steps against `max_steps` on step-limited runs (`zoo.cli.progress`);
- a short class name (`--model UnifiedPretraining`, `--data.help ShapesDataModule`) names the zoo class of
  that name (`zoo.cli.short_names` imports its module before parsing, so that jsonargparse knows it).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path
from typing import Any, Literal

import lightning as L
from jsonargparse import ActionConfigFile
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from zoo.cli.checkpoint import (
    CheckpointSummary,
    config_differences,
    describe_differences,
    inject_model,
    model_spec,
    read_checkpoint,
    weight_mismatches,
)
from zoo.cli.errors import show_zoo_messages
from zoo.cli.progress import StepProgressBar
from zoo.cli.runs import RUN_DIR_ENV, RunRecord, choose_run_dir, place_outputs
from zoo.cli.short_names import import_modules_of, short_names_used
from zoo.trust import enforce_import_allowlist

log = logging.getLogger("zoo.cli")
CkptOverrides = Literal["auto", "allow", "refuse"]
CONFIG_HELP = (
    "Path to a configuration file in json or yaml format (repeat to overlay). A relative path that is not in "
    "the working directory is read from the configs shipped with the zoo: --config configs/quickstart.yaml "
    "works from any directory"
)


class ZooCLI(LightningCLI):
    """LightningCLI in subclass mode, made safe for shared configs and checkpoints (module docstring)."""

    def __init__(self, args: list[str] | None = None, run: bool = True) -> None:
        enforce_import_allowlist()
        show_zoo_messages()
        argv = list(args) if isinstance(args, (list, tuple)) else None
        if args is None or argv is not None:
            import_modules_of(short_names_used(sys.argv[1:] if argv is None else argv))
        self.checkpoint: CheckpointSummary | None = None
        self.run_folder: Path | None = None
        inherited = os.environ.get(RUN_DIR_ENV)
        # LightningCLI reads sys.argv itself and warns when it is given `args` beside other command-line
        # arguments (Lightning's launcher re-runs sys.argv in every further process): so while this CLI parses
        # and runs, sys.argv is the command it was given, whoever calls it (`zoo`, tests, ablations, scripts).
        saved_argv = sys.argv
        if argv is not None:
            sys.argv, args = [sys.argv[0] if sys.argv else "zoo", *argv], None
        try:
            super().__init__(
                model_class=L.LightningModule,
                datamodule_class=L.LightningDataModule,
                subclass_mode_model=True,
                subclass_mode_data=True,
                save_config_kwargs={"overwrite": True},
                args=args,
                run=run,
                auto_configure_optimizers=False,
            )
        finally:  # the run folder is handed to this run's child processes only
            sys.argv = saved_argv
            if inherited is None:
                os.environ.pop(RUN_DIR_ENV, None)
            else:
                os.environ[RUN_DIR_ENV] = inherited

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """Lightning's parser, with `--config` saying where a relative path is looked for."""
        kwargs.setdefault("dump_header", [f"lightning.pytorch=={L.__version__}"])
        parser = self.parser_class(**kwargs)
        parser.add_argument("-c", "--config", action=ActionConfigFile, help=CONFIG_HELP)
        return parser

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--ckpt_overrides",
            type=CkptOverrides,
            default="auto",
            help="with --ckpt_path, when the config differs from the checkpoint or the checkpoint belongs to "
            "another run: refuse, allow (with a warning), or auto (refuse for fit, allow otherwise)",
        )

    # ------------------------------------------------------------------------------------------ parsing

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not ckpt_path:
            return
        self.checkpoint = read_checkpoint(ckpt_path)  # refuses non-zoo class paths before any import
        spec = model_spec(self.checkpoint)
        if spec is None or not isinstance(args, (list, tuple, type(None))):
            return
        argv = list(sys.argv[1:] if args is None else args)
        self.config = parser.parse_args(inject_model(argv, subcommand, spec))

    def _parse_ckpt_path(self) -> None:
        """Lightning's version lets the checkpoint replace the user's config; `parse_arguments` does it."""

    # ------------------------------------------------------------------------------------------ checks

    def _section(self) -> Any:
        return self.config[self.subcommand] if self.subcommand else self.config

    def _policy(self) -> str:
        policy = self._section().get("ckpt_overrides") or "auto"
        if policy == "auto":
            return "refuse" if self.subcommand == "fit" else "allow"
        return policy

    def before_instantiate_classes(self) -> None:
        config = self._section()
        resume_dir = None
        if self.checkpoint is not None:
            self._check_config_against_checkpoint(config)
            if self.subcommand == "fit":
                self._check_not_finished(config)
                resume_dir = self._resumed_run(config)
        root = config["trainer"].get("default_root_dir")
        if self.subcommand == "fit":
            self.run_folder = choose_run_dir(Path(root or "runs/default"), resume_dir)
            if RUN_DIR_ENV not in os.environ:
                print(f"run folder: {self.run_folder}", flush=True)
                os.environ[RUN_DIR_ENV] = str(self.run_folder)  # ranks started by Lightning's launcher
            place_outputs(config["trainer"], self.run_folder)
        elif root:
            place_outputs(config["trainer"], Path(root))

    def _check_config_against_checkpoint(self, config: Any) -> None:
        assert self.checkpoint is not None
        spec = model_spec(self.checkpoint)
        if spec is None:
            return
        differences = config_differences(spec, config["model"])
        if not differences:
            return
        where = f"--ckpt_path {self.checkpoint.path}"
        table = describe_differences(differences)
        if self._policy() == "refuse":
            raise ValueError(
                f"{where}: the configured model differs from the checkpoint's:\n{table}\n"
                "A resumed run must train what the checkpoint trained: use the checkpoint's settings, or "
                "pass "
                "--ckpt_overrides=allow to go on with these."
            )
        log.warning("%s: the config overrides the checkpoint's hyper-parameters:\n%s", where, table)

    def _check_not_finished(self, config: Any) -> None:
        assert self.checkpoint is not None
        trainer, step = config["trainer"], self.checkpoint.global_step
        max_steps, max_epochs = trainer.get("max_steps"), trainer.get("max_epochs")
        where = f"--ckpt_path {self.checkpoint.path}"
        if max_steps is not None and max_steps > 0 and step >= max_steps:
            raise ValueError(
                f"{where} is at step {step} and trainer.max_steps is {max_steps}: that run has finished, "
                "nothing is left to resume. Raise --trainer.max_steps to train it further."
            )
        epochs = self.checkpoint.epochs_done
        if (max_steps is None or max_steps < 0) and max_epochs is not None and 0 < max_epochs <= epochs:
            raise ValueError(
                f"{where} has finished {epochs} epochs and trainer.max_epochs is {max_epochs}: nothing is "
                "left "
                "to resume. Raise --trainer.max_epochs to train it further."
            )

    def _resumed_run(self, config: Any) -> Path | None:
        """The run folder a resume continues in, or None for a new one (refused unless allowed)."""
        assert self.checkpoint is not None
        recorded = self.checkpoint.run_dir()
        root = Path(config["trainer"].get("default_root_dir") or "runs/default").resolve()
        where = f"--ckpt_path {self.checkpoint.path}"
        if recorded is None or not recorded.is_dir():
            log.warning(
                "%s: the checkpoint records no run folder that exists here; it continues as a new run", where
            )
            return None
        if root in (recorded, recorded.parent) or os.environ.get(RUN_DIR_ENV) == str(recorded):
            return recorded
        if self._policy() == "refuse":
            raise ValueError(
                f"{where} belongs to the run {recorded}, not to a run under {root}. Resume it where it was "
                f"trained (--trainer.default_root_dir={recorded.parent}), or pass --ckpt_overrides=allow to "
                f"continue it as a new run under {root}."
            )
        log.warning("%s: continuing the run %s as a new run under %s", where, recorded, root)
        return None

    def instantiate_classes(self) -> None:
        """Under `parallel.fsdp`, a task that materialises deferred models (`meta_init_with_fsdp`) gets its
        model built with parameters on `meta` (`zoo.meta_init`): no rank ever holds the whole model, and
        `parallelize` gives each its shards of the single-process weights. Everything instantiated here is
        deferred alike, so nothing else of the config may own parameters (no datamodule or callback does)."""
        if not self._defers_model_init():
            super().instantiate_classes()
            return
        from zoo.meta_init import deferred_init

        with deferred_init():
            super().instantiate_classes()

    def _defers_model_init(self) -> bool:
        config = self._section()
        class_path = config.get("model.class_path")
        fsdp = config.get("model.init_args.parallel.fsdp")
        if not class_path or not fsdp:
            return False
        module, _, name = class_path.rpartition(".")
        task = getattr(importlib.import_module(module), name, None)  # allow-listed when parsed
        return bool(getattr(task, "meta_init_with_fsdp", False))

    def after_instantiate_classes(self) -> None:
        if self.checkpoint is None:
            return
        model = self.model
        problems = weight_mismatches(model, self.checkpoint.shapes) if self.checkpoint.shapes else []
        if problems:
            listed = "\n".join(f"  {p}" for p in problems[:8])
            more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
            spec = model_spec(self.checkpoint)
            differences = config_differences(spec, self._section()["model"]) if spec else {}
            keys = f"\nwhere the config differs:\n{describe_differences(differences)}" if differences else ""
            raise ValueError(
                f"--ckpt_path {self.checkpoint.path}: the configured model does not match the checkpoint's "
                f"weights ({len(problems)} tensors):\n{listed}{more}{keys}\n"
                "Use the config the checkpoint was trained with (its model section), or a matching one."
            )
        tokenizer = self.checkpoint.tokenizer
        if tokenizer is not None and hasattr(self.datamodule, "tokenizer"):
            from zoo.tokenizers.text import TextTokenizer

            self.datamodule.tokenizer = TextTokenizer.from_json(tokenizer, source=str(self.checkpoint.path))

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        self._install_step_progress_bar()
        trainer = super().instantiate_trainer(**kwargs)
        if self.run_folder is not None:
            trainer.callbacks.append(RunRecord(str(self.run_folder)))
        return trainer

    def _install_step_progress_bar(self) -> None:
        """Add `StepProgressBar` unless the config names a progress bar or turns it off."""
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        trainer = config["trainer"]
        callbacks = trainer.get("callbacks")
        if not isinstance(callbacks, list):
            callbacks = [] if callbacks is None else [callbacks]
        if trainer.get("enable_progress_bar") is False or any(isinstance(c, ProgressBar) for c in callbacks):
            return
        trainer["callbacks"] = [*callbacks, StepProgressBar()]
