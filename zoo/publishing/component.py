"""`PretrainedComponent`: `save_pretrained` / `from_pretrained` / `push_to_hub` for every reusable part.

The visual tokenizer (2D and 3D), the audio codec, the vision encoder and the refiner mix it in. A folder is
`config.json` (format `zoo.component`: the component's `{class_path, init_args}` as `to_config` writes it,
its parameter count, data and figures), `model.safetensors` (or, past `max_shard_size`, shards and their
index: `shards.py`) and a `README.md` card. Loading rebuilds the
class through the allow-list (`building.py`), refuses a folder that holds another kind of component, and
loads the weights with `strict=True`; nothing is unpickled and no code from the folder runs.

huggingface_hub's `PyTorchModelHubMixin` would rebuild `cls(**config)` and load with `strict=False`, and it
cannot express injected modules (a tokenizer's quantiser) as config; the zoo keeps its own spec and uses the
Hub's pieces for cards (`cards.py`) and transfers (`transfer.py`).

    tokenizer.save_pretrained("out/vt", datasets=["shapes-world"], metrics={"val/psnr": 24.1})
    tokenizer = VisualTokenizer.from_pretrained("out/vt")     # or "user/zoo-visual-tokenizer"
    tokenizer.push_to_hub("user/zoo-visual-tokenizer")        # an existing Hub README is kept
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from zoo.config import Configurable, to_config
from zoo.publishing.building import build_from_config, resolve_class
from zoo.publishing.cards import card_data, data_and_usage, render_card
from zoo.publishing.layout import (
    CARD_NAME,
    COMPONENT_FORMAT,
    CONFIG_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    read_config,
)
from zoo.publishing.shards import MAX_SHARD_SIZE, load_weights, save_weights
from zoo.publishing.transfer import push_folder, resolve
from zoo.trust import UnsafeConfigError
from zoo.version import __version__

C = TypeVar("C", bound="PretrainedComponent")


class PretrainedComponent(Configurable):
    """Mixin of a publishable `nn.Module` component (listed before `nn.Module` in the bases).

    A subclass names its Hub task (`hub_pipeline_tag`, or `pipeline_tag()` when it depends on the
    configuration), its card title and tags, one usage line, and may add facts (`card_facts`)."""

    hub_pipeline_tag: ClassVar[str] = "feature-extraction"
    hub_title: ClassVar[str] = "zoo component"
    hub_tags: ClassVar[tuple[str, ...]] = ()
    hub_usage: ClassVar[str] = ""  # what one does with the loaded component, one line of Python

    def pipeline_tag(self) -> str:
        return self.hub_pipeline_tag

    def card_facts(self) -> list[str]:
        """Markdown bullet lines about this component's configuration for its card."""
        return []

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # type: ignore[attr-defined]

    def save_pretrained(
        self,
        directory: str | Path,
        *,
        datasets: Sequence[str] = (),
        metrics: Mapping[str, float] | None = None,
        eval_dataset: str | None = None,
        tags: Sequence[str] = (),
        license: str | None = None,
        description: str | None = None,
        repo_id: str | None = None,
        max_shard_size: int | str = MAX_SHARD_SIZE,
    ) -> Path:
        """Write `config.json`, `model.safetensors` and a `README.md` card into `directory` (created).

        Args:
            directory: the folder; files of the same names are overwritten.
            datasets: what the component was trained on, for the card and its metadata.
            metrics: measured figures, e.g. {"val/psnr": 24.1}: a table and the card's model-index.
            eval_dataset: the dataset the figures were measured on (default: the first of `datasets`).
            tags: extra Hub tags.
            license: an SPDX id for the card metadata.
            description: a paragraph for the card.
            repo_id: the repo the card's usage snippet loads from (the directory otherwise).
            max_shard_size: past this size (bytes, or "5GB", "200MB") the weights are written as shards
                `model-00001-of-0000N.safetensors` with `model.safetensors.index.json`.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        metrics = {str(k): float(v) for k, v in (metrics or {}).items()}
        config = {
            "zoo_version": __version__,
            "format": COMPONENT_FORMAT,
            "component": to_config(self),
            "num_parameters": self.num_parameters(),
            "datasets": list(datasets),
            "metrics": metrics,
        }
        card = self.model_card(config, eval_dataset, tags, license, description, repo_id or str(directory))
        (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        # Tied tensors are stored once (safetensors refuses shared storage); loading knows their other names.
        state = self.state_dict()  # type: ignore[attr-defined]
        metadata = {"zoo_format": COMPONENT_FORMAT}
        save_weights(state, directory, max_shard_size=max_shard_size, metadata=metadata)
        card.save(directory / CARD_NAME)
        return directory

    def model_card(
        self,
        config: Mapping[str, Any],
        eval_dataset: str | None,
        tags: Sequence[str],
        license: str | None,
        description: str | None,
        repo_id: str,
    ) -> Any:
        """A huggingface_hub `ModelCard` of this component: what it is, its data and figures, usage."""
        cls = type(self)
        data = card_data(
            model_name=repo_id.rstrip("/").split("/")[-1] or cls.__name__,
            pipeline_tag=self.pipeline_tag(),
            tags=[*cls.hub_tags, *tags],
            datasets=config["datasets"],
            metrics=config["metrics"],
            eval_dataset=eval_dataset,
            license=license,
        )
        usage = [
            f"from {cls.__module__} import {cls.__name__}",
            "",
            f'model = {cls.__name__}.from_pretrained("{repo_id}")',
        ]
        body = [
            description or f"A `{cls.__name__}` trained with the `zoo` library (ERNIE 5.0 recipe).",
            "",
            "## Configuration",
            "",
            f"- class: `{cls.__module__}.{cls.__name__}`",
            f"- parameters: {config['num_parameters']:,}",
            *self.card_facts(),
            "",
            *data_and_usage(
                config["datasets"], config["metrics"], [*usage, *([cls.hub_usage] if cls.hub_usage else [])]
            ),
            f"Files: `{CONFIG_NAME}` (rebuilds the module through the zoo's allow-list, no code executed), "
            f"`{WEIGHTS_NAME}` (or its shards and `{WEIGHTS_INDEX_NAME}` when large; loaded strictly).",
        ]
        return render_card(data, f"{cls.hub_title} (zoo, ERNIE 5.0 recipe)", body)

    @classmethod
    def from_pretrained(
        cls: type[C],
        path_or_repo_id: str | Path,
        revision: str | None = None,
        *,
        device: str | torch.device = "cpu",
        cache_dir: str | Path | None = None,
        token: str | None = None,
        local_files_only: bool = False,
        endpoint: str | None = None,
    ) -> C:
        """The component saved in a folder or a hub repo, refused unless it is a `cls` (any component when
        called on `PretrainedComponent`); weights loaded strictly, in eval mode."""
        directory = resolve(path_or_repo_id, revision, cache_dir, token, local_files_only, endpoint)
        return load_component(directory, cls, device)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        token: str | None = None,
        private: bool = False,
        revision: str | None = None,
        commit_message: str | None = None,
        endpoint: str | None = None,
        overwrite_card: bool = False,
        datasets: Sequence[str] = (),
        metrics: Mapping[str, float] | None = None,
        eval_dataset: str | None = None,
        tags: Sequence[str] = (),
        license: str | None = None,
        max_shard_size: int | str = MAX_SHARD_SIZE,
    ) -> str:
        """`save_pretrained` into a temporary folder, then upload it; returns the commit URL. The README on
        the Hub is kept when there is one, unless `overwrite_card`; weight files of an earlier push that this
        one does not write (the other layout, more shards) are deleted in the same commit."""
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(
                tmp, datasets=datasets, metrics=metrics, eval_dataset=eval_dataset, tags=tags,
                license=license, repo_id=repo_id, max_shard_size=max_shard_size,
            )
            return push_folder(
                tmp, repo_id, token=token, private=private, revision=revision, endpoint=endpoint,
                commit_message=commit_message or f"Upload zoo {type(self).__name__}",
                overwrite_card=overwrite_card,
            )


def load_component(
    directory: str | Path, expected: type[C] = PretrainedComponent, device: str | torch.device = "cpu"
) -> C:
    """Rebuild the component of a local folder (allow-listed classes only), check that it is an `expected`,
    and load its weights (`model.safetensors`, or the shards its index names) into it with `strict=True`."""
    directory = Path(directory)
    config = read_config(directory, (COMPONENT_FORMAT,))
    where = f"{directory / CONFIG_NAME}:component"
    spec = config["component"]
    if isinstance(spec, Mapping):  # refuse another kind before building it
        built_class = resolve_class(spec.get("class_path"), where)
        if not issubclass(built_class, expected):
            raise UnsafeConfigError(
                f"{directory / CONFIG_NAME} describes a {built_class.__name__}, not a {expected.__name__}"
            )
    component = build_from_config(spec, where=where)
    if not isinstance(component, expected):
        raise UnsafeConfigError(
            f"{directory / CONFIG_NAME} describes a {type(component).__name__}, not a {expected.__name__}"
        )
    load_weights_strictly(component, directory / WEIGHTS_NAME, device)
    return component.eval()  # type: ignore[attr-defined]


def load_weights_strictly(module: torch.nn.Module, path: Path, device: str | torch.device = "cpu") -> None:
    """`path` (a folder's `model.safetensors`, or the folder: the shards its index names when sharded) into
    `module` with `strict=True`; a missing, tampered, truncated or foreign file raises an error naming it."""
    load_weights(module, path, device)
