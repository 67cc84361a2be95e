"""Publishing: save a unified model as safetensors + JSON config + model card, load it back, push it.

timm's split (STYLE.md): `save_pretrained` writes a complete, offline directory; `push_to_hub` only uploads
it. DESIGN.md, "Hub": `config.json` holds our own `class_path`/`init_args` spec, and `from_pretrained`
rebuilds it through an allow-list (only `Configurable` classes defined under `zoo.`), importing nothing
a downloaded config names before that check; weights load with `strict=True`. Nothing is unpickled.

    save_pretrained(model, "out/", tokenizer=tok, datasets=["shapes-world"], metrics={"val/loss": 2.1})
    model = zoo.load_pretrained("out/")             # or a hub repo id, e.g. "user/zoo-tiny"
    tokenizer = load_tokenizer("out/")
    push_to_hub(model, "user/zoo-tiny", tokenizer=tok)
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import tempfile
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model

from zoo.config import Configurable, to_config
from zoo.models.unified import UnifiedModel
from zoo.tokenizers.text import TextTokenizer
from zoo.trust import UnsafeConfigError, zoo_class
from zoo.version import __version__

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
TOKENIZER_NAME = "tokenizer.json"
CARD_NAME = "README.md"
FORMAT = "zoo.unified_model"
LIBRARY_NAME = "zoo"
TOKENIZER_KEY = "zoo_tokenizer"  # where a checkpoint keeps its text tokenizer, whatever the datamodule

# ---------------------------------------------------------------------------------------------- building


def resolve_class(class_path: object, where: str = "config") -> type:
    """The zoo component `class_path` names, or `UnsafeConfigError`. Only modules under `zoo.` are imported
    (`zoo.trust`), and the class must be a `Configurable` component."""
    cls = zoo_class(class_path, where)
    if not issubclass(cls, Configurable):
        raise UnsafeConfigError(
            f"{where}: refusing class_path {class_path!r}: not a Configurable zoo component"
        )
    return cls


def build_from_config(config: Any, hint: Any = Any, where: str = "config") -> Any:
    """Instantiate a `{"class_path", "init_args"}` tree (the output of `to_config`) without executing code
    from the config: classes pass `resolve_class`, dataclasses and tuples are rebuilt from the constructor's
    type hints, everything else must be plain JSON."""
    if isinstance(config, Mapping) and "class_path" in config:
        extra = set(config) - {"class_path", "init_args"}
        if extra:
            raise ValueError(f"{where}: unexpected keys {sorted(extra)} next to class_path")
        cls = resolve_class(config["class_path"], where)
        init_args = config.get("init_args") or {}
        if not isinstance(init_args, Mapping):
            raise ValueError(f"{where}.init_args must be a mapping, got {type(init_args).__name__}")
        parameters = inspect.signature(cls).parameters
        hints = _type_hints(cls.__init__)
        kwargs = {}
        for name, value in init_args.items():
            if name not in parameters:
                valid = ", ".join(parameters)
                raise ValueError(f"{where}: {config['class_path']} has no argument {name!r} ({valid})")
            kwargs[name] = build_from_config(value, hints.get(name, Any), f"{where}.{name}")
        try:
            return cls(**kwargs)
        except TypeError as err:
            raise ValueError(f"{where}: cannot build {config['class_path']}: {err}") from err
    hint = _strip_optional(hint)
    if isinstance(config, Mapping):
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            names = {f.name for f in dataclasses.fields(hint)}
            unknown = set(config) - names
            if unknown:
                raise ValueError(f"{where}: {hint.__name__} has no fields {sorted(unknown)}")
            hints = _type_hints(hint)
            values = {k: build_from_config(v, hints.get(k, Any), f"{where}.{k}") for k, v in config.items()}
            return hint(**values)
        return {str(k): build_from_config(v, Any, f"{where}.{k}") for k, v in config.items()}
    if isinstance(config, list):
        items = [build_from_config(v, Any, f"{where}[{i}]") for i, v in enumerate(config)]
        origin = typing.get_origin(hint)
        return tuple(items) if origin is tuple or hint is tuple else items
    if config is None or isinstance(config, (bool, int, float, str)):
        return config
    raise ValueError(f"{where}: {type(config).__name__} is not plain configuration")


def _type_hints(obj: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(obj)
    except Exception:  # an annotation that does not resolve just loses its conversion
        return {}


def _strip_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


# ---------------------------------------------------------------------------------------------- saving


def save_pretrained(
    model: UnifiedModel,
    directory: str | Path,
    tokenizer: TextTokenizer | None = None,
    *,
    datasets: Sequence[str] = (),
    metrics: Mapping[str, float] | None = None,
    tags: Sequence[str] = (),
    license: str | None = None,
    description: str | None = None,
    repo_id: str | None = None,
) -> Path:
    """Write `config.json`, `model.safetensors`, `tokenizer.json` (when given) and a `README.md` model card.

    Args:
        model: the model; an elastic sub-model from `model.extract(...)` saves as a model of its own.
        directory: created if missing; files of the same names are overwritten.
        tokenizer: the text tokenizer the model was trained with.
        datasets: names of the training data, for the card and its metadata.
        metrics: evaluation figures for the card, e.g. {"val/loss": 2.1}.
        tags: extra hub tags.
        license: an SPDX id for the card metadata.
        description: a paragraph for the card.
        repo_id: the repo the card's usage snippet loads from (the directory otherwise).
    """
    if not isinstance(model, UnifiedModel):
        raise TypeError(f"save_pretrained saves a UnifiedModel, got {type(model).__name__}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    total, active = model.num_parameters(), model.num_parameters(active=True)
    config = {
        "zoo_version": __version__,
        "format": FORMAT,
        "model": to_config(model),
        "tokenizer": TOKENIZER_NAME if tokenizer is not None else None,
        "num_parameters": {"total": total, "active": active},
        "datasets": list(datasets),
        "metrics": dict(metrics or {}),
    }
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    # save_model drops the duplicate names of tied weights (safetensors refuses shared storage).
    save_model(model, str(directory / WEIGHTS_NAME), metadata={"format": "pt", "zoo_format": FORMAT})
    if tokenizer is not None:
        tokenizer.save(directory / TOKENIZER_NAME)
    card = model_card(model, config, tags, license, description, repo_id or str(directory))
    card.save(directory / CARD_NAME)
    return directory


def model_card(
    model: UnifiedModel,
    config: Mapping[str, Any],
    tags: Sequence[str],
    license: str | None,
    description: str | None,
    repo_id: str,
) -> Any:
    """A huggingface_hub `ModelCard`: architecture, parameters, data, metrics, usage, tags, library name."""
    from huggingface_hub import ModelCard, ModelCardData

    backbone = model.backbone
    total, active = config["num_parameters"]["total"], config["num_parameters"]["active"]
    data = ModelCardData(
        library_name=LIBRARY_NAME,
        tags=[LIBRARY_NAME, "mixture-of-experts", "multimodal", "ernie-5", *tags],
        datasets=list(config["datasets"]) or None,
        license=license,
        pipeline_tag="text-generation",
    )
    metrics = config["metrics"]
    metric_rows = "\n".join(f"| {k} | {v:.4g} |" for k, v in metrics.items())
    vocab = model.vocab
    lines = [
        "---",
        data.to_yaml(),
        "---",
        "",
        "# Unified multimodal MoE (zoo, ERNIE 5.0 recipe)",
        "",
        description or "An autoregressive mixture-of-experts transformer trained with the `zoo` library.",
        "",
        "## Architecture",
        "",
        f"- backbone: {backbone.n_layers} layers ({backbone.n_dense_layers} dense), width {backbone.dim}, "
        f"{backbone.n_experts} routed experts, top-{backbone.top_k}",
        f"- vocabulary: text {vocab.text_size}, visual {vocab.visual_size}, "
        f"audio {vocab.audio_levels} x {vocab.audio_size}",
        f"- total parameters: {total:,}",
        f"- active parameters per token: {active:,} ({100 * active / total:.1f}%)",
        "",
        "## Training data",
        "",
        ", ".join(config["datasets"]) or "not recorded",
        "",
        "## Metrics",
        "",
        "| metric | value |\n|---|---|\n" + metric_rows if metrics else "not recorded",
        "",
        "## Usage",
        "",
        "```python",
        "import zoo",
        "from zoo.hub import load_tokenizer",
        "",
        f'model = zoo.load_pretrained("{repo_id}")',
        f'tokenizer = load_tokenizer("{repo_id}")',
        'prompt = model.vocab.text_to_unified(tokenizer.encode("hello")).tolist()',
        "ids = model.generate([[model.vocab.bos_id, *prompt]], max_new_tokens=32)",
        "print(tokenizer.decode(model.vocab.unified_to_text(ids[0]).tolist()))",
        "```",
        "",
        f"Files: `{CONFIG_NAME}` (rebuilds the module, no code executed), `{WEIGHTS_NAME}`"
        + (f", `{TOKENIZER_NAME}`" if config["tokenizer"] else "")
        + ".",
        "",
    ]
    return ModelCard("\n".join(lines))


def push_to_hub(
    model: UnifiedModel,
    repo_id: str,
    tokenizer: TextTokenizer | None = None,
    *,
    token: str | None = None,
    private: bool = False,
    revision: str | None = None,
    commit_message: str = "Upload zoo model",
    endpoint: str | None = None,
    datasets: Sequence[str] = (),
    metrics: Mapping[str, float] | None = None,
    tags: Sequence[str] = (),
    license: str | None = None,
) -> str:
    """`save_pretrained` into a temporary directory, then `create_repo` + `upload_folder`. Returns the commit
    URL. `endpoint` points at another hub (a mirror, or a local stand-in in tests)."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(
            model,
            tmp,
            tokenizer,
            datasets=datasets,
            metrics=metrics,
            tags=tags,
            license=license,
            repo_id=repo_id,
        )
        api.create_repo(repo_id, private=private, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id, folder_path=tmp, revision=revision, commit_message=commit_message
        )
    return str(getattr(commit, "commit_url", commit))


# ---------------------------------------------------------------------------------------------- loading


def resolve(
    path_or_repo_id: str | Path,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    token: str | None = None,
    local_files_only: bool = False,
) -> Path:
    """A local directory as is; a hub repo id downloaded (only the files this format uses)."""
    path = Path(path_or_repo_id)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{path} is a file; from_pretrained takes a directory or a hub repo id")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(
            snapshot_download(
                str(path_or_repo_id),
                revision=revision,
                cache_dir=cache_dir,
                token=token,
                local_files_only=local_files_only,
                allow_patterns=[CONFIG_NAME, WEIGHTS_NAME, TOKENIZER_NAME, CARD_NAME],
            )
        )
    except (HFValidationError, OSError) as err:  # hub errors are OSErrors (HTTP, offline, not found)
        raise FileNotFoundError(
            f"{path_or_repo_id}: no such local folder (looked in {path.resolve()}), and fetching it as a hub "
            f"repo id failed: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
        ) from err


def load_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: not a saved zoo model")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(config, dict) or config.get("format") != FORMAT or "model" not in config:
        raise ValueError(f"{path} is not a zoo model config (expected format {FORMAT!r} and a 'model' entry)")
    return config


def from_pretrained(
    path_or_repo_id: str | Path,
    revision: str | None = None,
    *,
    device: str | torch.device = "cpu",
    cache_dir: str | Path | None = None,
    token: str | None = None,
    local_files_only: bool = False,
) -> UnifiedModel:
    """Rebuild the model from `config.json` (allow-listed zoo classes only) and load `model.safetensors`
    with `strict=True`. A tampered or truncated weights file raises a ValueError naming the file."""
    directory = resolve(path_or_repo_id, revision, cache_dir, token, local_files_only)
    config = load_config(directory)
    model = build_from_config(config["model"], where=f"{directory / CONFIG_NAME}:model")
    if not isinstance(model, UnifiedModel):
        kind = type(model).__name__
        raise UnsafeConfigError(f"{directory / CONFIG_NAME} describes a {kind}, not a UnifiedModel")
    load_weights(model, directory / WEIGHTS_NAME, device)
    return model.eval()


def load_weights(model: torch.nn.Module, path: Path, device: str | torch.device = "cpu") -> None:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    try:
        load_model(model, str(path), strict=True, device=str(device))
    except (SafetensorError, RuntimeError, ValueError, OSError) as err:
        message = f"cannot load weights from {path} (tampered, truncated or another model's): {err}"
        raise ValueError(message) from err
    model.to(device)


def load_tokenizer(
    path_or_repo_id: str | Path,
    revision: str | None = None,
    *,
    cache_dir: str | Path | None = None,
    token: str | None = None,
    local_files_only: bool = False,
) -> TextTokenizer | None:
    """The tokenizer saved next to the model, or None when none was saved."""
    directory = resolve(path_or_repo_id, revision, cache_dir, token, local_files_only)
    path = directory / TOKENIZER_NAME
    return TextTokenizer.load(path) if path.is_file() else None


def _read_checkpoint(path: Path) -> dict:
    """A Lightning checkpoint as one dict: a file, or a distributed (DCP) folder, one shard per rank plus
    Lightning's `meta.pt`, consolidated into full tensors on this process."""
    if not path.is_dir():
        return torch.load(path, map_location="cpu", weights_only=True)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    meta = path / "meta.pt"
    if not meta.is_file():
        raise ValueError(f"{path} is a folder but not a Lightning distributed checkpoint (no meta.pt in it)")
    checkpoint = torch.load(meta, map_location="cpu", weights_only=True)
    with tempfile.TemporaryDirectory() as tmp:
        merged = Path(tmp) / "consolidated.pt"
        dcp_to_torch_save(path, merged)  # torch's converter: Lightning's own fails on these folders
        checkpoint["state_dict"] = torch.load(merged, map_location="cpu", weights_only=True)["state_dict"]
    return checkpoint


def checkpoint_tokenizer_json(checkpoint: Mapping[str, Any]) -> str | None:
    """The text tokenizer (JSON) a checkpoint was trained with: under `TOKENIZER_KEY`, where the zoo's tasks
    store it, or (older checkpoints) in the datamodule state Lightning keeps under the datamodule's class
    name, which another datamodule class would not find."""
    if isinstance(checkpoint.get(TOKENIZER_KEY), str):
        return checkpoint[TOKENIZER_KEY]
    for value in checkpoint.values():
        if isinstance(value, Mapping) and isinstance(value.get("tokenizer"), str):
            return value["tokenizer"]
    return None


def load_lightning_checkpoint(path: str | Path) -> tuple[UnifiedModel, TextTokenizer | None]:
    """The unified model of a `UnifiedPretraining` checkpoint (a file, or an FSDP2 distributed folder, which
    this consolidates), and the tokenizer the datamodule stored in it.

    Read with `weights_only=True` (nothing unpickled); the model is rebuilt from the task's `model`
    hyper-parameter through the same allow-list as hub configs, and its weights load with `strict=True`.
    """
    path = Path(path)
    try:
        checkpoint = _read_checkpoint(path)
    except ValueError:
        raise
    except Exception as err:
        raise ValueError(f"cannot read checkpoint {path} (truncated, or not weights-only): {err}") from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ValueError(f"{path} is not a Lightning checkpoint (no 'state_dict')")
    spec = (checkpoint.get("hyper_parameters") or {}).get("model")
    if not isinstance(spec, Mapping) or "class_path" not in spec:
        raise ValueError(f"{path}: the task's hyper-parameters hold no model {{class_path, init_args}}")
    model = build_from_config(spec, where=f"{path}:hyper_parameters.model")
    if not isinstance(model, UnifiedModel):
        raise ValueError(f"{path}: the task's model is a {type(model).__name__}, not a UnifiedModel")
    prefix = "model."
    state = {k[len(prefix) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(f"{path}: weights do not fit the model its hyper-parameters name: {err}") from err
    text = checkpoint_tokenizer_json(checkpoint)
    tokenizer = TextTokenizer.from_json(text, source=f"{path} (checkpoint)") if text is not None else None
    return model.eval(), tokenizer


load_pretrained = from_pretrained
