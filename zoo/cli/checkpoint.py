"""`--ckpt_path` made safe and explicit: what a checkpoint says, checked before anything is built from it.

LightningCLI 2.6 rebuilds the model from a checkpoint's hyper-parameters and lets them *replace* the user's
config (a `--model...` flag is ignored without a word), and hands their class paths to jsonargparse, which
imports whatever they name. The zoo reads the checkpoint itself instead (`read_checkpoint`: weights-only,
memory-mapped, or `meta.pt` of a distributed folder), refuses every class path outside the zoo before any
import (`zoo.trust`), and gives the hyper-parameters to the parser *under* the user's arguments
(`model_spec`), so YAML and flags win key by key; `config_differences` names every key where they differ, and
`weight_mismatches` refuses a model whose weights the checkpoint cannot fill, before they are loaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zoo.hub import checkpoint_tokenizer_json
from zoo.trust import check_checkpoint_classes, zoo_class


@dataclass
class CheckpointSummary:
    """What the CLI needs of a checkpoint, without its optimiser state."""

    path: Path
    hparams: dict[str, Any]  # the task's hyper-parameters, class paths checked
    shapes: dict[str, tuple[int, ...]]  # tensor name (as in the task's state_dict) -> shape
    global_step: int
    epochs_done: int
    run: dict[str, Any] | None
    tokenizer: str | None

    def run_dir(self) -> Path | None:
        folder = (self.run or {}).get("run_dir")
        return Path(folder) if isinstance(folder, str) else None


def read_checkpoint(path: str | Path) -> CheckpointSummary:
    """A checkpoint file or an FSDP2 distributed folder, read weights-only; class paths refused unless zoo."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--ckpt_path {path}: no such file or folder")
    try:
        if path.is_dir():
            checkpoint, shapes = _read_distributed(path)
        else:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            shapes = {k: tuple(v.shape) for k, v in (checkpoint.get("state_dict") or {}).items()}
    except (ValueError, FileNotFoundError):
        raise
    except Exception as err:  # torch raises several kinds for a truncated or pickled file
        raise ValueError(f"cannot read checkpoint {path} (truncated, or not weights-only): {err}") from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint and not shapes:
        raise ValueError(f"{path} is not a Lightning checkpoint (no state_dict)")
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    check_checkpoint_classes(hparams, f"{path}:hyper_parameters")
    epochs = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
    return CheckpointSummary(
        path=path,
        hparams=hparams,
        shapes=shapes,
        global_step=int(checkpoint.get("global_step", 0)),
        epochs_done=int(epochs.get("processed", checkpoint.get("epoch", 0))),
        run=checkpoint.get("zoo_run") if isinstance(checkpoint.get("zoo_run"), dict) else None,
        tokenizer=checkpoint_tokenizer_json(checkpoint),
    )


def _read_distributed(path: Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    from torch.distributed.checkpoint import FileSystemReader

    meta = path / "meta.pt"
    if not meta.is_file():
        raise ValueError(f"{path} is a folder but not a Lightning distributed checkpoint (no meta.pt in it)")
    checkpoint = torch.load(meta, map_location="cpu", weights_only=True)
    metadata = FileSystemReader(str(path)).read_metadata()
    prefix = "state_dict."
    shapes = {
        name[len(prefix) :]: tuple(item.size)
        for name, item in metadata.state_dict_metadata.items()
        if name.startswith(prefix) and hasattr(item, "size")
    }
    return checkpoint, shapes


def model_spec(summary: CheckpointSummary) -> dict[str, Any] | None:
    """The checkpoint's task as a `{class_path, init_args}` spec for the parser (None: it holds none)."""
    hparams = {k: v for k, v in summary.hparams.items() if k != "_instantiator"}
    if "_class_path" not in hparams:
        return None
    class_path = hparams.pop("_class_path")
    upgrade = getattr(zoo_class(class_path), "upgrade_init_args", None)  # older checkpoints' arguments
    return {"class_path": class_path, "init_args": upgrade(hparams) if upgrade else hparams}


def inject_model(args: list[str], subcommand: str, spec: Mapping[str, Any]) -> list[str]:
    """`args` with `--model <spec>` placed right after the subcommand: every later config file and flag
    is parsed on top of it, so the user's values win over the checkpoint's."""
    at = args.index(subcommand) + 1
    return [*args[:at], "--model", json.dumps(spec), *args[at:]]


def _plain(value: Any) -> Any:
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    return json.loads(json.dumps(value, default=str))


def _flatten(tree: Any, prefix: str, out: dict[str, Any]) -> None:
    if not isinstance(tree, dict):
        out[prefix] = tree
        return
    skip = _construction_only(tree)
    for key, value in tree.items():
        if key == "init_args" and isinstance(value, dict):
            value = {k: v for k, v in value.items() if k not in skip}
        _flatten(value, f"{prefix}.{key}" if prefix else key, out)


def _construction_only(tree: dict[str, Any]) -> frozenset[str]:
    """Arguments a zoo component reads once at construction (e.g. `weights`): a checkpoint records them as
    None by design (`zoo.config.Configurable`), so a config that sets them is no conflict."""
    class_path = tree.get("class_path")
    if not isinstance(class_path, str) or not class_path.startswith("zoo."):
        return frozenset()
    try:
        return frozenset(getattr(zoo_class(class_path), "construction_only", ()))
    except ValueError:
        return frozenset()


def config_differences(saved: Mapping[str, Any], configured: Any) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (checkpoint value, configured value) wherever the configured model differs from the one
    the checkpoint was trained with. Keys the checkpoint lacks (arguments added since) are not differences."""
    ours: dict[str, Any] = {}
    theirs: dict[str, Any] = {}
    _flatten(_plain(configured), "", ours)
    _flatten(_plain(dict(saved)), "", theirs)
    return {k: (v, ours.get(k, "<absent>")) for k, v in theirs.items() if ours.get(k, "<absent>") != v}


def describe_differences(differences: Mapping[str, tuple[Any, Any]], limit: int = 12) -> str:
    rows = [
        f"  model.{k}: checkpoint {v!r} -> config {c!r}" for k, (v, c) in list(differences.items())[:limit]
    ]
    more = len(differences) - limit
    return "\n".join(rows + ([f"  ... and {more} more"] if more > 0 else []))


def weight_mismatches(model: torch.nn.Module, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Why the checkpoint's tensors cannot fill `model`'s state dict (missing, unexpected, other shapes)."""
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problems = [f"missing from the checkpoint: {k}" for k in ours if k not in shapes]
    problems += [f"not in the configured model: {k}" for k in shapes if k not in ours]
    problems += [
        f"{k}: checkpoint {list(shapes[k])} vs model {list(s)}"
        for k, s in ours.items()
        if k in shapes and tuple(shapes[k]) != s
    ]
    return problems
