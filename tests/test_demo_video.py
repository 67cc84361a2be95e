"""Specifications of the video demo, `make demo-video`: configs/demo/video_tokenizer.yaml, then
configs/demo/video.yaml.

The stages hand weights on by path: `make demo`'s 2D tokenizer is inflated into the causal 3D one, which the
unified video model loads frozen. These tests build each stage through `zoo.cli.ZooCLI` from the real YAML,
with untrained weights written where the earlier stage would have written them, so a path, an architecture or
a task weight that drifted fails here rather than after minutes of training.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from zoo.cli import ZooCLI
from zoo.datamodules.sequence import VisualSegment, document_length
from zoo.hub import build_from_config
from zoo.task_names import Task
from zoo.tasks.callbacks import MultimodalGallery
from zoo.tasks.multimodal_eval import evaluate, supported_tasks, write_gallery
from zoo.weights import save_weights_file

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "configs" / "demo"
WEIGHTS = "visual_tokenizer.safetensors"


def load(name: str) -> dict:
    return yaml.safe_load((DEMO / name).read_text())


def tokenizer_spec(config: dict) -> dict:
    """The visual tokenizer's class_path and init_args, wherever the config keeps it."""
    init_args = config["model"]["init_args"]
    if "tokenizer" in init_args:
        return init_args["tokenizer"]
    return init_args["model"]["init_args"]["visual_tokenizer"]


def written_by(config: dict) -> str:
    """Where a tokenizer stage writes its weights (ZooCheckpoint's component folder under `latest`)."""
    return f"{config['trainer']['default_root_dir']}/latest/{WEIGHTS}"


def write_untrained(spec: dict, target: Path) -> None:
    """The component of `spec`, untrained, saved at `target`: what its stage would leave there."""
    target.parent.mkdir(parents=True, exist_ok=True)
    spec = {"class_path": spec["class_path"], "init_args": {**spec["init_args"], "weights": None}}
    save_weights_file(build_from_config(spec), target)


def write_video_demo_inputs(root: Path) -> None:
    """Untrained stand-ins for what the video demo loads: the video tokenizer stage's weights and `make demo`
    stage 3's vision encoder."""
    write_untrained(tokenizer_spec(load("video.yaml")), root / written_by(load("video_tokenizer.yaml")))
    encoder = load("video.yaml")["model"]["init_args"]["model"]["init_args"]["vision_encoder"]
    write_untrained(encoder, root / encoder["init_args"]["weights"])


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # the configs' relative runs/ paths land here, never in the repo
    return tmp_path


def test_the_video_tokenizer_inflates_the_2d_tokenizer_that_make_demo_trains_first(in_tmp: Path):
    image_stage, video_stage = load("visual_tokenizer.yaml"), load("video_tokenizer.yaml")
    assert video_stage["model"]["init_args"]["init_from_2d"] == written_by(image_stage)
    write_untrained(tokenizer_spec(image_stage), in_tmp / written_by(image_stage))
    cli = ZooCLI(args=["--config", str(DEMO / "video_tokenizer.yaml")], run=False)
    tokenizer = cli.model.tokenizer
    assert tokenizer.temporal
    before = tokenizer.encoder[0].weight.detach().clone()
    cli.model.setup("fit")  # inflation: the 2D kernels land in the last temporal slice, the rest is zero
    after = tokenizer.encoder[0].weight.detach()
    assert not after.equal(before)
    assert after[:, :, :-1].abs().sum() == 0 and after[:, :, -1].abs().sum() > 0


def test_the_video_demo_loads_the_tokenizer_the_video_tokenizer_stage_writes():
    trained, loaded = tokenizer_spec(load("video_tokenizer.yaml")), tokenizer_spec(load("video.yaml"))
    assert loaded["init_args"]["weights"] == written_by(load("video_tokenizer.yaml"))
    assert loaded["class_path"] == trained["class_path"]
    assert {k: v for k, v in loaded["init_args"].items() if k != "weights"} == trained["init_args"]


def test_the_video_demo_trains_and_scores_only_captions_and_the_two_video_tasks(in_tmp: Path):
    write_video_demo_inputs(in_tmp)
    cli = ZooCLI(args=["--config", str(DEMO / "video.yaml")], run=False)
    model, data = cli.model.model, cli.datamodule
    data.setup("fit")
    trained = {t for t, w in data.weights.items() if w > 0}
    assert trained == {Task.CAPTION, Task.TEXT_TO_VIDEO, Task.VIDEO_TO_TEXT}
    assert supported_tasks(model, data) == [Task.TEXT_TO_VIDEO, Task.VIDEO_TO_TEXT]
    for task in (Task.TEXT_TO_VIDEO, Task.VIDEO_TO_TEXT):  # a clip's document is never cut at a row's end
        longest = max(document_length(data.task_document(task, "train", i), data.layout) for i in range(64))
        assert longest <= data.builder.seq_len <= model.backbone.max_seq_len
    gallery = next(c for c in cli.trainer.callbacks if isinstance(c, MultimodalGallery))
    assert gallery.num_samples >= 64 and gallery.score_splits == ["test"]


def test_the_video_gallery_keys_scores_by_task_and_shows_every_clip(in_tmp: Path):
    write_video_demo_inputs(in_tmp)
    cli = ZooCLI(args=["--config", str(DEMO / "video.yaml")], run=False)
    result = evaluate(cli.model.model, cli.datamodule, n=2, max_caption_tokens=4)
    for task in ("text_to_video", "video_to_text"):
        for key in ("exact", "attribute_accuracy", "baseline_exact", "exact_ci95_low", "exact_ci95_high"):
            assert f"{task}/{key}" in result.metrics
    page = write_gallery(result, in_tmp / "gallery").read_text()
    for name in ("text_to_video_000.gif", "text_to_video_001.gif", "video_to_text_000.gif"):
        assert f"({name})" in page and (in_tmp / "gallery" / name).is_file()
    assert (in_tmp / "gallery" / "overview.png").is_file()


def test_make_demo_video_runs_the_video_tokenizer_then_the_video_demo():
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(r"^demo-video:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe is not None, "the Makefile has no demo-video target"
    configs = re.findall(r"--config (\S+)", recipe.group(1))
    assert configs == ["configs/demo/video_tokenizer.yaml", "configs/demo/video.yaml"]


def test_the_video_demo_reads_clips_through_the_vision_encoder_make_demo_trains(in_tmp: Path):
    encoder = load("video.yaml")["model"]["init_args"]["model"]["init_args"]["vision_encoder"]
    demo_encoder = load("multimodal.yaml")["model"]["init_args"]["model"]["init_args"]["vision_encoder"]
    assert encoder == demo_encoder  # the encoder `make demo` stage 3 trains, loaded from where it writes it
    write_video_demo_inputs(in_tmp)
    codes_overlay = REPO / "configs" / "experiments" / "demo_video_codes.yaml"
    for args, context in ((["--config", str(DEMO / "video.yaml")], True),
                          (["--config", str(DEMO / "video.yaml"), "--config", str(codes_overlay)], False)):
        cli = ZooCLI(args=args, run=False)
        model, data = cli.model.model, cli.datamodule
        data.setup("fit")
        assert supported_tasks(model, data) == [Task.TEXT_TO_VIDEO, Task.VIDEO_TO_TEXT]
        document = data.task_document(Task.VIDEO_TO_TEXT, "train", 0)
        batch = data.builder.collate([document])
        assert (batch.context is not None) == context and (batch.visual is None) == context
        if context:  # 5 frames of 4x4 tokens instead of 255 codes
            assert document[1].pixels.shape[1] == data.video_frames
            assert document_length(document, data.layout) < document_length(
                [document[0], VisualSegment(document[1].pixels, predict=False), document[2]], data.layout
            )
        assert model(batch).loss.isfinite()
