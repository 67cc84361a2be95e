"""Paired data through the command line (issue 14, items 1, 3 and 7): every shipped paired config reads the
files its placeholders name (written here: media, or code shards of the configured model's own visual
tokenizer) into batches the configured model takes, and `zoo fit` on a tiny manifest with a tiny untrained
visual tokenizer and audio codec trains, checkpoints mid-epoch and resumes, with the tokenizer it trained
coming back from the checkpoint, and `zoo predict` answers from the checkpoint."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from batch_helpers import batch_tensors
from paired_corpus import corpus, write_interleaved, write_manifest, write_tar
from test_configs import cli_args, deep_merge, load, provide_weight_files

from zoo.cli import ZooCLI, main
from zoo.datamodules.code_shards import CodeShardSource
from zoo.datamodules.paired import PairedDataModule
from zoo.datamodules.shards import expand
from zoo.datamodules.sources import ManifestSource, TarSource
from zoo.hub import TOKENIZER_KEY
from zoo.models.unified import UnifiedModel
from zoo.pretokenize import FrozenTokenizers, tokenize_corpus
from zoo.tokenizers.text import TextTokenizer

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PAIRED = {  # config -> what its placeholder files hold (images, audio, videos per file)
    "pretrain/real_media.yaml": (3, 2, 0),
    "data/image_text.yaml": (4, 0, 0),
    "data/speech_text.yaml": (0, 3, 0),
    "data/video_text.yaml": (0, 0, 2),
    "data/interleaved.yaml": None,
    "data/code_shards.yaml": (4, 0, 0),  # tokenized: the untrained codec's k-means never ran, so images only
}
PIXELS = ("visual.image_pixels", "visual.video_pixels", "audio.waves")
CODES = ("visual.codes", "audio.codes")


@pytest.fixture(autouse=True)
def clean_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["zoo"])


def write_placeholders(
    dm: PairedDataModule, model: UnifiedModel, folder: Path, content: tuple[int, int, int] | None
) -> None:
    """Real files wherever the config's sources point (relative paths: under the run folder)."""
    for source in dm.sources:
        if isinstance(source, ManifestSource):
            for path in map(Path, expand(source.manifests)):
                if content is None:
                    interleaved, _ = write_interleaved(path.parent)
                    interleaved.rename(path)
                else:
                    write_manifest(path.parent, corpus(folder, *content), name=path.name)
        elif isinstance(source, CodeShardSource):
            (index,) = map(Path, source.shards)
            manifest = write_manifest(folder / "raw", corpus(folder, *content))
            frozen = FrozenTokenizers(copy.deepcopy(model.visual_tokenizer), None)
            tokenize_corpus([str(manifest)], index.parent, frozen, progress=False)
            assert index.is_file()
        else:
            assert isinstance(source, TarSource)
            for number, path in enumerate(map(Path, expand(source.shards))):
                write_tar(path, corpus(folder, *content), first=100 * number)


@pytest.mark.parametrize("name", PAIRED)
def test_every_paired_config_reads_its_files_into_batches_its_model_takes(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(tmp_path)
    args = [*cli_args(CONFIGS / name), "--data.init_args.num_workers=0"]
    merged: dict = {}
    for flag, value in zip(args, args[1:], strict=False):
        if flag == "--config":
            merged = deep_merge(merged, load(Path(value)))
    provide_weight_files(merged, tmp_path)
    cli = ZooCLI(args=args, run=False)
    dm = cli.datamodule
    assert isinstance(dm, PairedDataModule) and dm.sources
    model = cli.model.model
    write_placeholders(dm, model, tmp_path, PAIRED[name])
    cli.trainer.strategy.connect(cli.model)  # what fit does: the datamodule reads the model's sizes
    dm.trainer = cli.trainer
    dm.setup("fit")
    assert dm.spec.image_size == model.visual_tokenizer.image_size
    batch = next(iter(dm.train_dataloader()))
    assert dm.bad_samples == 0
    coded = any(isinstance(s, CodeShardSource) for s in dm.sources)
    kinds = {k for k in (CODES if coded else PIXELS) if k in batch_tensors(batch)}
    assert kinds, "a paired batch holds media"
    if "visual.video_pixels" in kinds:
        assert batch.visual.video_pixels.shape[1:] == (3, dm.video_frames, 32, 32)
    with torch.no_grad():
        out = model.eval()(batch)
    assert torch.isfinite(out.loss)


TINY = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 4
  val_check_interval: 2
  check_val_every_n_epoch: null
  limit_val_batches: 1
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {root}
  callbacks:
  - class_path: lightning.pytorch.callbacks.ModelCheckpoint
    init_args:
      save_last: true
      enable_version_counter: false
      every_n_train_steps: 2
  - class_path: zoo.tasks.data_monitor.BadSampleMonitor
model:
  class_path: zoo.tasks.pretrain.UnifiedPretraining
  init_args:
    model:
      class_path: zoo.models.unified.UnifiedModel
      init_args:
        backbone:
          class_path: zoo.models.backbone.UnifiedTransformer
          init_args:
            dim: 32
            n_layers: 2
            n_heads: 2
            n_kv_heads: 1
            n_experts: 4
            expert_hidden: 16
            top_k: 2
            max_seq_len: 256
        vocab: &vocab
          text_size: 320
          visual_size: 64
          audio_size: 64
          audio_levels: 2
        visual_tokenizer:
          class_path: zoo.tokenizers.visual.VisualTokenizer
          init_args:
            image_size: 16
            channels: [8, 16, 16]
            quantizer:
              class_path: zoo.tokenizers.visual_quantizer.MultiScaleQuantizer
              init_args:
                dim: 8
                codebook_size: 64
                scales: [1, 2, 4]
        audio_codec:
          class_path: zoo.tokenizers.audio.AudioCodec
          init_args:
            codebook_sizes: [64, 64]
            max_channels: 32
    lr: 0.003
    warmup_steps: 2
data:
  class_path: zoo.datamodules.paired.PairedDataModule
  init_args:
    vocab: *vocab
    sources:
    - class_path: zoo.datamodules.sources.ManifestSource
      init_args:
        manifests: [{manifest}]
    val_fraction: 0.1
    tokenizer_size: 300
    seq_len: 256
    batch_size: 2
"""


PREDICT = """
trainer:
  callbacks:
  - class_path: zoo.tasks.callbacks.GenerationWriter
    init_args:
      output: {output}
model:
  init_args:
    sampling:
      max_new_tokens: 4
      max_audio_frames: 4
data:
  init_args:
    predict_samples: 1
    predict_captions: [picture 1]
    predict_files: [{file}/000000.jpg]
"""


def last_checkpoint(root: Path) -> Path:
    found = sorted(root.rglob("last.ckpt"), key=lambda p: p.stat().st_mtime)
    assert found, f"no last.ckpt under {root}"
    return found[-1]


def test_zoo_fit_on_a_tiny_manifest_trains_and_resumes_mid_epoch_with_its_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(tmp_path)
    manifest = write_manifest(tmp_path / "corpus", corpus(tmp_path, images=8, audio=5, videos=0))
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY.format(root=tmp_path / "runs", manifest=manifest))
    main(["fit", "--config", str(config)])
    first = last_checkpoint(tmp_path / "runs")
    state = torch.load(first, map_location="cpu", weights_only=True)
    assert state["global_step"] == 4
    loader_state = state["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert (loader_state["epoch"], loader_state["batches"]) == (0, 4)  # 12 samples: 6 batches an epoch
    trained = state[TOKENIZER_KEY]
    assert TextTokenizer.from_json(trained).vocab_size > 257  # trained on the manifest's captions

    # A one-merge tokenizer would be trained at setup this time: the checkpoint's must win.
    main([
        "fit", "--config", str(config), "--trainer.max_steps=6", "--data.init_args.tokenizer_size=257",
        f"--ckpt_path={first}",
    ])  # fmt: skip
    resumed = torch.load(last_checkpoint(tmp_path / "runs"), map_location="cpu", weights_only=True)
    assert resumed["global_step"] == 6
    assert resumed[TOKENIZER_KEY] == trained
    loader_state = resumed["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert (loader_state["epoch"], loader_state["batches"]) == (0, 6)  # the rest of epoch 0, not a new one

    # zoo predict: a validation sample both ways, a caption rendered, a file captioned.
    predict = tmp_path / "predict.yaml"
    predict.write_text(PREDICT.format(output=tmp_path / "predictions.jsonl", file=manifest.parent / "media"))
    main(["predict", "--config", str(config), "--config", str(predict), f"--ckpt_path={first}"])
    rows = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    answered = {(r["task"], r["name"]) for r in rows if "error" not in r}
    assert {
        ("text_to_image", "caption000"),
        ("text_to_audio", "caption000"),
        ("image_to_text", "000000"),
    } <= answered
    assert any(name == "val000" for _, name in answered)
    assert all(Path(r["media"]).is_file() for r in rows if "media" in r)
