"""Run folders: every `zoo fit` writes into its own versioned folder, and one setting moves all of it.

`trainer.default_root_dir` is the run *root*. A fresh `zoo fit` creates `<root>/version_N` (the next free N)
and points `<root>/latest` at it; the trainer's `default_root_dir` becomes that folder, and every relative
output path of a logger (`save_dir`) or a checkpoint callback (`dirpath`) is taken inside it. So
`--trainer.default_root_dir=/scratch/x` moves the logs, the checkpoints, the samples and the stage's exported
weights together, and a rerun never overwrites (or resumes by accident from) an earlier run's `last.ckpt`.

A resume (`--ckpt_path`) continues in the run folder its checkpoint records (`RunRecord` writes it into
every checkpoint). Processes started by a launcher inherit the folder through `ZOO_RUN_DIR`; setting that
variable by hand names the run folder exactly (no versioning), which is also how a multi-node job whose
ranks start independently (torchrun, SLURM) agrees on one folder: the job id names it.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path
from typing import Any

import lightning as L

RUN_DIR_ENV = "ZOO_RUN_DIR"
RUN_KEY = "zoo_run"  # the checkpoint's record of the run that wrote it
LATEST = "latest"
_VERSION = re.compile(r"version_(\d+)")
_JOB_ENV = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")


def next_version(root: Path) -> Path:
    """Create and return `<root>/version_N` for the smallest N above every existing one (race-safe)."""
    root.mkdir(parents=True, exist_ok=True)
    taken = [int(m.group(1)) for p in root.iterdir() if (m := _VERSION.fullmatch(p.name))]
    n = max(taken, default=-1) + 1
    while True:
        folder = root / f"version_{n}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:  # another run took it between the listing and the mkdir
            n += 1


def point_latest(root: Path, run_dir: Path) -> None:
    """Make `<root>/latest` a relative symlink to `run_dir`, replacing any previous one atomically."""
    link = root / LATEST
    if link.exists() and not link.is_symlink():
        return  # a real folder named `latest` is the user's: leave it
    temporary = root / f".{LATEST}.{os.getpid()}"
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(os.path.relpath(run_dir, root))
    os.replace(temporary, link)


def launched_job_folder(root: Path) -> Path | None:
    """`<root>/job_<id>` when this process is one rank of a job started by torchrun or SLURM."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    for name in _JOB_ENV:
        if os.environ.get(name):
            return root / f"job_{os.environ[name]}"
    return None


def choose_run_dir(root: Path, resume_dir: Path | None) -> Path:
    """The folder this `fit` writes into: an inherited `ZOO_RUN_DIR`, the resumed run's, a launched job's,
    or a new version under `root` (then `latest` points at it)."""
    if os.environ.get(RUN_DIR_ENV):
        folder = Path(os.environ[RUN_DIR_ENV])
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    if resume_dir is not None:
        return resume_dir
    job = launched_job_folder(root)
    if job is not None:
        job.mkdir(parents=True, exist_ok=True)
        return job
    folder = next_version(root)
    point_latest(root, folder)
    return folder


def inside(run_dir: Path, path: Any, default: str) -> str:
    """`path` taken inside `run_dir` when it is relative (or `default` when it is unset); absolute paths
    and URLs (`s3://...`) stay as given."""
    if path is None or path == "":
        return str(run_dir / default)
    text = str(path)
    if "://" in text or Path(text).is_absolute():
        return text
    return str(run_dir / text)


def place_outputs(trainer_config: Any, run_dir: Path) -> None:
    """Point the configured loggers and checkpoint callbacks (a parsed `trainer` namespace) into `run_dir`."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import Logger

    trainer_config["default_root_dir"] = str(run_dir)
    for spec in _specs(trainer_config.get("logger")):
        cls = _spec_class(spec)
        if cls is not None and issubclass(cls, Logger) and "save_dir" in spec.init_args:
            spec.init_args["save_dir"] = inside(run_dir, spec.init_args.get("save_dir"), ".")
            if "version" in spec.init_args and spec.init_args.get("version") is None:
                spec.init_args["version"] = ""  # the run folder is the version: no version_N inside it
    for spec in _specs(trainer_config.get("callbacks")):
        cls = _spec_class(spec)
        if cls is not None and issubclass(cls, ModelCheckpoint):
            spec.init_args["dirpath"] = inside(run_dir, spec.init_args.get("dirpath"), "checkpoints")


def _specs(value: Any) -> list[Any]:
    items = value if isinstance(value, list) else [value]
    return [v for v in items if hasattr(v, "class_path") and hasattr(v, "init_args")]


def _spec_class(spec: Any) -> type | None:
    """The class a parsed spec names; jsonargparse imported it (under the allow-list) while parsing."""
    module, _, name = str(spec.class_path).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return cls if isinstance(cls, type) else None


class RunRecord(L.Callback):
    """Writes the run's folder into every checkpoint (`checkpoint["zoo_run"]`), so a resume can tell its own
    run from another one. Added by the `zoo` command; not a YAML component."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[RUN_KEY] = {"run_dir": str(Path(self.run_dir).resolve())}
