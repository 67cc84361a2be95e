"""The unified model's folder: `config.json`, `model.safetensors` (shards and an index past
`max_shard_size`), `tokenizer.json` and a `README.md` card; loading it back (allow-listed classes, strict
weights) and pushing it.

A folder may name component folders (`components.py`) instead of carrying their tensors; loading pulls them.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from zoo.config import to_config
from zoo.hub.components import (
    check_same_component,
    component_folder,
    component_module,
    component_prefixes,
    load_named_component,
    looks_like_path,
    stored_reference,
)
from zoo.models.unified import UnifiedModel
from zoo.publishing.building import build_from_config
from zoo.publishing.cards import card_data, data_and_usage, render_card
from zoo.publishing.component import load_component, load_weights_strictly
from zoo.publishing.layout import (
    CARD_NAME,
    CONFIG_NAME,
    TOKENIZER_NAME,
    UNIFIED_FORMAT,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    read_config,
)
from zoo.publishing.shards import MAX_SHARD_SIZE, save_weights
from zoo.publishing.shards import load_weights as load_folder_weights
from zoo.publishing.transfer import push_folder, resolve
from zoo.tokenizers.text import TextTokenizer
from zoo.trust import UnsafeConfigError
from zoo.version import __version__

FORMAT = UNIFIED_FORMAT
HUB_ROOT = "https://huggingface.co"

# ---------------------------------------------------------------------------------------------- saving


def save_pretrained(
    model: UnifiedModel,
    directory: str | Path,
    tokenizer: TextTokenizer | None = None,
    *,
    datasets: Sequence[str] = (),
    metrics: Mapping[str, float] | None = None,
    eval_dataset: str | None = None,
    tags: Sequence[str] = (),
    license: str | None = None,
    description: str | None = None,
    repo_id: str | None = None,
    components: Mapping[str, str | Path] | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    max_shard_size: int | str = MAX_SHARD_SIZE,
) -> Path:
    """Write `config.json`, `model.safetensors`, `tokenizer.json` (when given) and a `README.md` model card.

    Args:
        model: the model; an elastic sub-model from `model.extract(...)` saves as a model of its own.
        directory: created if missing; files of the same names are overwritten.
        tokenizer: the text tokenizer the model was trained with.
        datasets: names of the training data, for the card and its metadata.
        metrics: evaluation figures for the card and its model-index, e.g. {"val/loss": 2.1}.
        eval_dataset: the dataset the figures were measured on (default: the first of `datasets`).
        tags: extra hub tags.
        license: an SPDX id for the card metadata.
        description: a paragraph for the card.
        repo_id: the repo the card's usage snippet loads from (the directory otherwise).
        components: component name (`visual_tokenizer`, `audio_codec`, `vision_encoder`) -> the component
            folder (a local path, written relative to `directory`) or hub id it was built with. Their tensors
            stay out of `model.safetensors`; each folder must hold exactly the model's component.
        token, endpoint: for the hub ids in `components` (fetched to check them).
        max_shard_size: past this size (bytes, or "5GB", "200MB") the weights are written as shards
            `model-00001-of-0000N.safetensors` with `model.safetensors.index.json` (huggingface_hub's layout).
    """
    if not isinstance(model, UnifiedModel):
        raise TypeError(f"save_pretrained saves a UnifiedModel, got {type(model).__name__}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    references = _checked_references(model, directory, components or {}, token, endpoint)
    total, active = model.num_parameters(), model.num_parameters(active=True)
    config = {
        "zoo_version": __version__,
        "format": FORMAT,
        "model": to_config(model),
        "tokenizer": TOKENIZER_NAME if tokenizer is not None else None,
        "components": references,
        "num_parameters": {"total": total, "active": active},
        "datasets": list(datasets),
        "metrics": {str(k): float(v) for k, v in (metrics or {}).items()},
    }
    card = model_card(model, config, tags, license, description, repo_id or str(directory), eval_dataset)
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    save_own_weights(model, directory, component_prefixes(list(references)), max_shard_size)
    if tokenizer is not None:
        tokenizer.save(directory / TOKENIZER_NAME)
    card.save(directory / CARD_NAME)
    return directory


def _checked_references(
    model: UnifiedModel, directory: Path, components: Mapping[str, str | Path], token: str | None,
    endpoint: str | None,
) -> dict[str, str]:
    """Each component reference as the config stores it, after checking it holds the model's component."""
    references = {}
    for name, ref in components.items():
        module = component_module(model, name)
        stored, local = stored_reference(ref, directory)
        if local:
            folder = Path(ref).expanduser()
        else:
            folder = component_folder(name, str(ref), directory, token=token, endpoint=endpoint)
        check_same_component(name, module, folder, load_component(folder, type(module)))
        references[name] = stored
    return references


def save_own_weights(
    model: torch.nn.Module, directory: Path, skip_prefixes: tuple[str, ...], max_shard_size: int | str
) -> None:
    """The model's tensors but those under `skip_prefixes`, tied tensors once, in one file or in shards."""
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(skip_prefixes)}
    save_weights(state, directory, max_shard_size=max_shard_size, metadata={"zoo_format": FORMAT})


def model_card(
    model: UnifiedModel,
    config: Mapping[str, Any],
    tags: Sequence[str],
    license: str | None,
    description: str | None,
    repo_id: str,
    eval_dataset: str | None = None,
) -> Any:
    """A huggingface_hub `ModelCard`: architecture, parameters, components, data, metrics (also as a
    model-index), usage, tags, library name, and `any-to-any` as the Hub's task."""
    backbone = model.backbone
    total, active = config["num_parameters"]["total"], config["num_parameters"]["active"]
    data = card_data(
        model_name=repo_id.rstrip("/").split("/")[-1] or "zoo-unified",
        pipeline_tag="any-to-any",
        tags=["mixture-of-experts", "multimodal", "ernie-5", *tags],
        datasets=config["datasets"],
        metrics=config["metrics"],
        eval_dataset=eval_dataset,
        license=license,
    )
    vocab = model.vocab
    references = config.get("components") or {}
    components = [f"- {name}: {_linked(ref)}" for name, ref in references.items()]
    lines = [
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
        *(["## Components", "", "Loaded from their own folders (not stored here):", "", *components, ""]
          if components else []),
        *data_and_usage(config["datasets"], config["metrics"], [
            "import zoo",
            "from zoo.hub import load_tokenizer",
            "",
            f'model = zoo.load_pretrained("{repo_id}")',
            f'tokenizer = load_tokenizer("{repo_id}")',
            'prompt = model.vocab.text_to_unified(tokenizer.encode("hello")).tolist()',
            "ids = model.generate([[model.vocab.bos_id, *prompt]], max_new_tokens=32)",
            "print(tokenizer.decode(model.vocab.unified_to_text(ids[0]).tolist()))",
        ]),
        f"Files: `{CONFIG_NAME}` (rebuilds the module, no code executed), `{WEIGHTS_NAME}` (or its shards "
        f"and `{WEIGHTS_INDEX_NAME}` when large)"
        + (f", `{TOKENIZER_NAME}`" if config["tokenizer"] else "")
        + ".",
    ]
    return render_card(data, "Unified multimodal MoE (zoo, ERNIE 5.0 recipe)", lines)


def _linked(ref: str) -> str:
    if looks_like_path(ref) or ref.count("/") != 1:
        return f"`{ref}` (a folder beside this one)"
    repo_id = ref.partition("@")[0]
    return f"[{ref}]({HUB_ROOT}/{repo_id})"


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
    overwrite_card: bool = False,
    datasets: Sequence[str] = (),
    metrics: Mapping[str, float] | None = None,
    eval_dataset: str | None = None,
    tags: Sequence[str] = (),
    license: str | None = None,
    components: Mapping[str, str] | None = None,
    max_shard_size: int | str = MAX_SHARD_SIZE,
) -> str:
    """`save_pretrained` into a temporary directory, then `create_repo` + `upload_folder`. Returns the commit
    URL. `endpoint` points at another hub (a mirror, or a local stand-in in tests). Components must be named
    by hub id (a local folder cannot be followed from the Hub). The README already on the Hub is kept unless
    `overwrite_card`; weight files of an earlier push that this one does not write are deleted."""
    for name, ref in (components or {}).items():
        if Path(ref).expanduser().is_dir():
            raise ValueError(
                f"component {name!r}: {ref} is a local folder, which a pushed model cannot point at; push it "
                "first (its `push_to_hub`, or `zoo push --folder`) and name its hub id"
            )
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(
            model, tmp, tokenizer, datasets=datasets, metrics=metrics, eval_dataset=eval_dataset, tags=tags,
            license=license, repo_id=repo_id, components=components, token=token, endpoint=endpoint,
            max_shard_size=max_shard_size,
        )
        return push_folder(
            tmp, repo_id, token=token, private=private, revision=revision, commit_message=commit_message,
            endpoint=endpoint, overwrite_card=overwrite_card,
        )


# ---------------------------------------------------------------------------------------------- loading


def load_config(directory: str | Path) -> dict[str, Any]:
    return read_config(directory, (FORMAT,))


def from_pretrained(
    path_or_repo_id: str | Path,
    revision: str | None = None,
    *,
    device: str | torch.device = "cpu",
    cache_dir: str | Path | None = None,
    token: str | None = None,
    local_files_only: bool = False,
    endpoint: str | None = None,
) -> UnifiedModel:
    """Rebuild the model from `config.json` (allow-listed zoo classes only) and load `model.safetensors` (or
    the shards its index names, one at a time) with `strict=True`, and each component folder the config
    names (pulled from the Hub for a hub id). A tampered or truncated weights file raises a ValueError
    naming the file."""
    directory = resolve(path_or_repo_id, revision, cache_dir, token, local_files_only, endpoint)
    config = load_config(directory)
    model = build_from_config(config["model"], where=f"{directory / CONFIG_NAME}:model")
    if not isinstance(model, UnifiedModel):
        kind = type(model).__name__
        raise UnsafeConfigError(f"{directory / CONFIG_NAME} describes a {kind}, not a UnifiedModel")
    references = config.get("components") or {}
    if not isinstance(references, Mapping) or not all(isinstance(v, str) for v in references.values()):
        raise ValueError(f"{directory / CONFIG_NAME}: 'components' must map names to folders or hub ids")
    if not references:
        load_weights(model, directory / WEIGHTS_NAME, device)
        return model.eval()
    load_weights_without(model, directory / WEIGHTS_NAME, component_prefixes(list(references)), device)
    for name, ref in references.items():
        folder = component_folder(
            name, ref, directory, token=token, endpoint=endpoint, cache_dir=cache_dir,
            local_files_only=local_files_only,
        )
        load_named_component(name, component_module(model, name), folder, device)
    return model.eval()


def load_weights(model: torch.nn.Module, path: Path, device: str | torch.device = "cpu") -> None:
    load_weights_strictly(model, path, device)


def load_weights_without(
    model: torch.nn.Module, path: Path, prefixes: tuple[str, ...], device: str | torch.device
) -> None:
    """`path` into `model`: every tensor but those under `prefixes` must be there, and nothing else (a tensor
    under `prefixes` is refused: a folder names a component or stores it, not both)."""
    load_folder_weights(model, path, device, skip_prefixes=prefixes)


def load_tokenizer(
    path_or_repo_id: str | Path,
    revision: str | None = None,
    *,
    cache_dir: str | Path | None = None,
    token: str | None = None,
    local_files_only: bool = False,
    endpoint: str | None = None,
) -> TextTokenizer | None:
    """The tokenizer saved next to the model, or None when none was saved."""
    directory = resolve(path_or_repo_id, revision, cache_dir, token, local_files_only, endpoint)
    path = directory / TOKENIZER_NAME
    return TextTokenizer.load(path) if path.is_file() else None
