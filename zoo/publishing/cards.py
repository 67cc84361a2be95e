"""Model cards with the metadata the Hub reads: `pipeline_tag`, `library_name`, `datasets`, and the measured
figures as a `model-index` (huggingface_hub's `EvalResult`), so the Hub lists them as evaluation results.

Pipeline tags are the Hub's task names (huggingface.js `@huggingface/tasks` PIPELINE_DATA): `any-to-any` for
the unified model, `image-to-image` for a 2D visual tokenizer (pixels -> codes -> pixels) and the refiner,
`video-to-video` for the causal 3D tokenizer, `audio-to-audio` for the codec, `image-feature-extraction` for
the vision encoder.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from zoo.publishing.layout import LIBRARY_NAME

# A metric key's first part says which split it was measured on ("val/psnr", "test/si_snr").
_SPLITS = {"val": "validation", "validation": "validation", "test": "test", "train": "train"}


def eval_results(
    metrics: Mapping[str, float], pipeline_tag: str, dataset: str | None, model_name: str
) -> list[Any]:
    """One `EvalResult` per metric: `metric_type` is the key's last part, `metric_name` the whole key, the
    split comes from its first part. Figures need the dataset they were measured on."""
    from huggingface_hub import EvalResult

    if not metrics:
        return []
    if not dataset:
        raise ValueError(
            f"{model_name}: metrics {sorted(metrics)} need the dataset they were measured on "
            "(pass datasets=[...] or eval_dataset=...)"
        )
    results = []
    for key, value in metrics.items():
        parts = str(key).split("/")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{model_name}: metric {key!r} must be a number, got {value!r}")
        results.append(
            EvalResult(
                task_type=pipeline_tag,
                dataset_type=dataset,
                dataset_name=dataset,
                dataset_split=_SPLITS.get(parts[0]) if len(parts) > 1 else None,
                metric_type=parts[-1],
                metric_name=str(key),
                metric_value=float(value),
            )
        )
    return results


def card_data(
    *,
    model_name: str,
    pipeline_tag: str,
    tags: Sequence[str],
    datasets: Sequence[str],
    metrics: Mapping[str, float],
    eval_dataset: str | None,
    license: str | None,
) -> Any:
    """The card's YAML header as a `ModelCardData` (library name, tags, datasets, model-index)."""
    from huggingface_hub import ModelCardData

    dataset = eval_dataset or (datasets[0] if datasets else None)
    results = eval_results(metrics, pipeline_tag, dataset, model_name)
    return ModelCardData(
        library_name=LIBRARY_NAME,
        pipeline_tag=pipeline_tag,
        tags=[LIBRARY_NAME, *dict.fromkeys(tags)],
        datasets=list(datasets) or None,
        license=license,
        model_name=model_name if results else None,
        eval_results=results or None,
    )


def metrics_table(metrics: Mapping[str, float]) -> str:
    if not metrics:
        return "not recorded"
    return "| metric | value |\n|---|---|\n" + "\n".join(f"| {k} | {v:.4g} |" for k, v in metrics.items())


def data_and_usage(datasets: Sequence[str], metrics: Mapping[str, float], usage: Sequence[str]) -> list[str]:
    """The card sections every published folder shares: training data, metrics, and a usage snippet."""
    return [
        "## Training data", "", ", ".join(datasets) or "not recorded", "",
        "## Metrics", "", metrics_table(metrics), "",
        "## Usage", "", "```python", *usage, "```", "",
    ]  # fmt: skip


def render_card(data: Any, title: str, body: Sequence[str]) -> Any:
    """A `ModelCard`: the metadata header, a title and the body's lines."""
    from huggingface_hub import ModelCard

    return ModelCard("\n".join(["---", data.to_yaml(), "---", "", f"# {title}", "", *body, ""]))
