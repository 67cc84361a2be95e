"""The throughput measurement of `data_pipeline.py` (issue 14, "How it is measured"): what the data pipeline
delivers from raw media and from code shards, beside what the `tiny` and `small` models consume.

The corpus is ShapesWorld rendered to real files: `--throughput-samples` image-caption pairs (PNG) and half
as many speech-transcript pairs (WAV), written as WebDataset tar shards, images and speech apart. The
tokenizers have the project's architectures (configs/tokenizers/visual_2d.yaml, audio.yaml), untrained:
speed does not depend on the weights.

- `zoo tokenize` runs over each half (`tokenize_corpus`, `--workers` DataLoader workers): images/s and
  audio seconds/s.
- (a) raw: the raw shards through `PairedDataModule` (a `TarSource`: decoding in the workers, documents,
  batches) and each batch's media tokenized by the model (`UnifiedModel.encode_media` on pixels and
  waves), as training on raw media does; (b) shards: the code shards through the same datamodule (a
  `CodeShardSource`), each batch through `encode_media` (on codes that computes the teacher-forcing inputs
  only). Both at 0 and `--workers` workers over one epoch; the clock starts at the first batch (worker
  start-up is left out). Delivered: documents/s and tokens/s (the valid positions of the packed batches).
- consumption: training steps (forward, backward, AdamW) of the `tiny` and the `small` preset holding the
  same tokenizers, on batches of the code shards, in tokens/s and documents/s. `small` reserves 8 audio
  levels and the codec has 4, so `small` is built with `audio_levels=4, audio_size=256`.

`shards_over_small_consumption` = code-shard tokens/s at `--workers` workers over small's training tokens/s
(target >= 3). The figures are only as good as the machine is quiet: run it alone.
"""

from __future__ import annotations

import argparse
import copy
import io
import logging
import tempfile
import time
from itertools import islice
from pathlib import Path

import lightning as L
import soundfile as sf
import torch
import webdataset as wds
import yaml
from _common import log, machine_info
from PIL import Image

from zoo.batch import GroupBatch
from zoo.datamodules.code_shards import CodeShardSource
from zoo.datamodules.paired import PairedDataModule
from zoo.datamodules.sources import PairedSource, TarSource
from zoo.hub import build_from_config
from zoo.models.unified import UnifiedModel
from zoo.pretokenize import FrozenTokenizers, tokenize_corpus
from zoo.pretokenize.frozen import find_spec
from zoo.registry import create_model
from zoo.tasks.pretrain import UnifiedPretraining
from zoo.tokenizers.audio import AudioCodec
from zoo.tokenizers.text import TextTokenizer
from zoo.tokenizers.visual import VisualTokenizer
from zoo.world.render import render_image
from zoo.world.scenes import ShapesWorld
from zoo.world.speech import SAMPLE_RATE, render_speech

ROOT = Path(__file__).resolve().parents[1]
BATCH = 16  # documents per batch
SEQ_LEN = 512  # the tiny preset's max_seq_len
SHARDS_PER_HALF = 4  # raw tar shards of images, and of speech: several per worker
SMALL_OVERRIDES = {"audio_levels": 4, "audio_size": 256}
logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)  # no banner per Trainer


def untrained(config: str, cls: type, **overrides: object) -> torch.nn.Module:
    """The component `cls` of a project config, built untrained (its `weights` dropped)."""
    spec = find_spec(yaml.safe_load((ROOT / config).read_text()), f"{cls.__module__}.{cls.__qualname__}")
    assert spec is not None, f"{config} holds no {cls.__name__}"
    torch.manual_seed(0)
    init_args = {**(spec.get("init_args") or {}), **overrides, "weights": None}
    return build_from_config({"class_path": spec["class_path"], "init_args": init_args}, where=config)


def project_tokenizers() -> FrozenTokenizers:
    visual = untrained("configs/tokenizers/visual_2d.yaml", VisualTokenizer)
    audio = untrained("configs/tokenizers/audio.yaml", AudioCodec, kmeans_init=False)  # no first-batch init
    return FrozenTokenizers(visual, audio)


# --- the corpus -------------------------------------------------------------------------------------


def png(array) -> bytes:  # noqa: ANN001 (uint8 [H, W, 3])
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def wav(wave) -> bytes:  # noqa: ANN001 (float32 [N])
    buffer = io.BytesIO()
    sf.write(buffer, wave, SAMPLE_RATE, format="WAV")
    return buffer.getvalue()


def write_corpus(folder: Path, images: int, clips: int) -> tuple[list[str], list[str]]:
    """Raw tar shards of ShapesWorld image-caption and speech-transcript pairs: (image urls, speech urls)."""
    world = ShapesWorld(seed=0)
    scenes = world.scenes("train", max(images, clips))
    halves = {"images": [], "speech": []}
    for name, count in (("images", images), ("speech", clips)):
        per_shard = -(-count // SHARDS_PER_HALF)
        with wds.ShardWriter(str(folder / f"{name}-%04d.tar"), maxcount=per_shard, verbose=0) as sink:
            for i, scene in enumerate(scenes[:count]):
                caption = world.caption(scene)
                if name == "images":
                    sink.write({"__key__": f"i{i:06d}", "png": png(render_image(scene, 32)), "txt": caption})
                else:
                    sink.write(
                        {"__key__": f"a{i:06d}", "wav": wav(render_speech(caption, i)), "txt": caption}
                    )
        halves[name] = sorted(str(p) for p in folder.glob(f"{name}-*.tar"))
    return halves["images"], halves["speech"]


# --- the pipelines ----------------------------------------------------------------------------------


def paired_data(sources: list[PairedSource], model: UnifiedModel, workers: int) -> PairedDataModule:
    """The datamodule `zoo fit` builds for `sources`, attached to `model` as fit attaches it (sizes, layout,
    the code shards' fingerprint check), with the byte-level text tokenizer; both directions of each medium
    equally often (the sources' default tasks)."""
    dm = PairedDataModule(
        sources, vocab=model.vocab, val_fraction=0.0, seq_len=SEQ_LEN, batch_size=BATCH, num_workers=workers,
        shuffle_buffer=64,
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.strategy.connect(UnifiedPretraining(model))
    dm.trainer, dm.tokenizer = trainer, TextTokenizer.byte_level()
    dm.setup("fit")
    return dm


def deliver(dm: PairedDataModule, model: UnifiedModel) -> dict:
    """Documents/s and tokens/s of one epoch of `dm`, each batch through `encode_media`."""
    batches = iter(dm.train_dataloader())
    with torch.no_grad():
        model.encode_media(next(batches))
        start, documents, tokens = time.perf_counter(), 0, 0
        for batch in batches:
            model.encode_media(batch)
            documents += BATCH
            tokens += int(batch.valid.sum())
    seconds = time.perf_counter() - start
    if not documents:
        raise RuntimeError("the corpus gives one batch only: raise --throughput-samples")
    return {"docs_per_s": documents / seconds, "tokens_per_s": tokens / seconds}


def training_batches(dm: PairedDataModule, count: int) -> list[GroupBatch]:
    """`count` batches of `dm`, epoch after epoch."""
    batches: list[GroupBatch] = []
    for epoch in range(count):
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(epoch)
        batches += islice(loader, count - len(batches))
        if len(batches) == count:
            break
    return batches


def consume(preset: str, tokenizers: FrozenTokenizers, indexes: list[str], steps: int) -> dict:
    """Tokens/s and documents/s of training steps of `preset` on batches of the code shards `indexes`."""
    overrides = SMALL_OVERRIDES if preset == "small" else {}
    torch.manual_seed(0)
    visual, audio = copy.deepcopy(tokenizers.visual), copy.deepcopy(tokenizers.audio)
    model = create_model(preset, visual_tokenizer=visual, audio_codec=audio, **overrides).train()
    batches = training_batches(paired_data([CodeShardSource(indexes)], model, 0), steps + 1)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step(batch: GroupBatch) -> None:
        optimizer.zero_grad(set_to_none=True)
        model(batch).loss.backward()
        optimizer.step()

    step(batches[0])  # warm-up: allocations, first-call paths
    start = time.perf_counter()
    for batch in batches[1:]:
        step(batch)
    seconds = time.perf_counter() - start
    tokens = sum(int(b.valid.sum()) for b in batches[1:])
    return {"tokens_per_s": tokens / seconds, "docs_per_s": steps * BATCH / seconds}


# --- the measurement --------------------------------------------------------------------------------


def measure_throughput(args: argparse.Namespace) -> dict[str, object]:
    result: dict[str, object] = {**machine_info(args.threads)}
    tokenizers = project_tokenizers()
    images, clips = args.throughput_samples, max(1, args.throughput_samples // 2)
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        folder = Path(tmp)
        log(f"writing {images} image and {clips} speech pairs as tar shards to {folder}")
        image_urls, speech_urls = write_corpus(folder, images, clips)

        log(f"zoo tokenize with {args.workers} workers")
        tokenized = {}
        for name, urls in (("images", image_urls), ("speech", speech_urls)):
            tokenized[name] = tokenize_corpus(
                urls, folder / f"codes-{name}", tokenizers, num_workers=args.workers, progress=False
            )
        result["tokenize_images_per_s"] = round(tokenized["images"].images_per_second, 2)
        result["tokenize_audio_seconds_per_s"] = round(tokenized["speech"].audio_seconds_per_second, 2)
        result["tokenize_workers"] = args.workers

        model = create_model("tiny", visual_tokenizer=tokenizers.visual, audio_codec=tokenizers.audio).eval()
        indexes = [str(folder / f"codes-{n}" / "index.json") for n in tokenized]
        for workers in sorted({0, args.workers}):
            streams = {"raw": TarSource(image_urls + speech_urls), "shards": CodeShardSource(indexes)}
            for name, source in streams.items():
                log(f"streaming {name} with {workers} workers")
                for key, value in deliver(paired_data([source], model, workers), model).items():
                    result[f"{name}_w{workers}_{key}"] = round(value, 1)

        for preset in args.presets:
            log(f"training steps of {preset}")
            for key, value in consume(preset, tokenizers, indexes, args.train_steps).items():
                result[f"{preset}_train_{key}"] = round(value, 1)
    w = args.workers
    for preset in args.presets:
        consumed = result[f"{preset}_train_tokens_per_s"]
        for name in ("shards", "raw"):
            result[f"{name}_over_{preset}_consumption"] = round(
                result[f"{name}_w{w}_tokens_per_s"] / consumed, 2
            )
    result.update(
        throughput_images=images, throughput_speech_clips=clips, throughput_batch_documents=BATCH,
        throughput_seq_len=SEQ_LEN, throughput_workers=w, throughput_train_steps=args.train_steps,
        small_vocab_overrides="audio_levels=4, audio_size=256",
    )  # fmt: skip
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--throughput-samples", type=int, default=512, help="image pairs (speech: half)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers besides 0")
    parser.add_argument("--train-steps", type=int, default=8, help="timed training steps per preset")
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"], help="whose consumption")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the main process")
