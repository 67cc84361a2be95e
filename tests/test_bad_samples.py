"""Bad samples as a specification (issue 14, item 5): a truncated image, garbage bytes, an empty caption, a
malformed manifest line or a shard cut short are skipped, replaced deterministically (so sample and step
counts stay fixed), counted and named once in the log; past `max_bad_fraction` the loader raises a clear
error in the main process. Real tar shards (webdataset's writer), real JPEGs (Pillow), real workers.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import lightning as L
import pytest
import torch
import webdataset as wds
from PIL import Image

from zoo.datamodules.bad_samples import BadSample, BadSamplePolicy, TooManyBadSamples
from zoo.datamodules.documents import (
    DocumentDataset,
    EpochShuffleSampler,
    ResumableDataLoader,
    replacement_index,
)
from zoo.datamodules.shards import JsonlLines, TarSamples, count_shards, json_record
from zoo.datamodules.streaming import StreamDataset, StreamLoader
from zoo.tasks.data_monitor import BadSampleMonitor

LENIENT = BadSamplePolicy(max_bad_fraction=0.5, min_samples=4)


def jpeg(shade: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (16, 16), (shade, 0, 0)).save(out, "JPEG")
    return out.getvalue()


def write_shard(path: Path, samples: int, broken: dict[int, str]) -> str:
    """`samples` image-caption pairs; `broken` maps a sample number to what is wrong with it."""
    with wds.TarWriter(str(path)) as sink:
        for i in range(samples):
            image, caption = jpeg(i), f"caption {i}"
            if broken.get(i) == "truncated":
                image = image[: len(image) // 2]
            elif broken.get(i) == "garbage":
                image = b"\x00\x01 not a jpeg"
            elif broken.get(i) == "empty caption":
                caption = "  "
            sink.write({"__key__": f"s{i:03d}", "jpg": image, "txt": caption})
    return str(path)


def decode(sample: dict) -> str:
    """The caller's `map`: the caption, after decoding the image in full."""
    caption = sample["txt"].decode("utf-8").strip()
    if not caption:
        raise BadSample("empty caption")
    with Image.open(io.BytesIO(sample["jpg"])) as image:
        image.load()
    return caption


def always_bad(sample: dict) -> str:
    raise BadSample("no 'png' field (this corpus stores 'jpg')")


def stream_of(url: str, policy: BadSamplePolicy = LENIENT, shuffle: bool = False, map=decode):
    return StreamDataset(count_shards([url], TarSamples()), TarSamples(), map, 0, shuffle, 8, policy)


def captions(batches: list[list[str]]) -> list[int]:
    return [int(c.split()[1]) for batch in batches for c in batch]


BROKEN = {3: "truncated", 11: "garbage", 12: "empty caption"}


def test_bad_samples_are_replaced_by_the_next_good_one_of_their_worker_counted_and_named_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    url = write_shard(tmp_path / "broken.tar", 20, BROKEN)
    loader = StreamLoader(stream_of(url), list, batch_size=4, num_workers=2)
    with caplog.at_level(logging.WARNING, logger="zoo.datamodules.bad_samples"):
        batches = list(loader)
    # Worker 0 reads samples 0-11 (3 batches), worker 1 samples 12-19; they hand batches over in turn.
    # 3 -> 4 (the next good one); 11, the last of worker 0 -> 0 (its first good one); 12 -> 13.
    assert captions(batches) == [0, 1, 2, 4, 13, 13, 14, 15, 4, 5, 6, 7, 16, 17, 18, 19, 8, 9, 10, 0]
    assert len(batches) == len(loader) == 5
    assert (loader.bad_samples, loader.samples_seen) == (3, 20)
    named = [r.getMessage() for r in caplog.records]
    assert len(named) == 3
    for key, reason in [("s003", "OSError: Truncated File Read"), ("s011", "cannot identify image"),
                        ("s012", "BadSample: empty caption")]:  # fmt: skip
        assert sum(f"{url} [{key}]" in m and reason in m for m in named) == 1, named


def test_a_resumed_run_replaces_bad_samples_exactly_as_the_uninterrupted_one(tmp_path: Path):
    url = write_shard(tmp_path / "broken.tar", 40, {0: "garbage", 5: "truncated", 17: "empty caption"})
    dataset = stream_of(url, shuffle=True)
    whole = list(StreamLoader(dataset, list, 4, num_workers=2))
    for done in range(1, len(whole)):
        first = StreamLoader(dataset, list, 4, num_workers=2)
        batches = iter(first)
        for _ in range(done):
            next(batches)
        resumed = StreamLoader(dataset, list, 4, num_workers=2)
        resumed.load_state_dict(first.state_dict())
        assert list(resumed) == whole[done:], f"resumed after {done} batches"


def test_past_max_bad_fraction_the_main_process_raises_a_clear_error(tmp_path: Path):
    url = write_shard(tmp_path / "broken.tar", 20, BROKEN)
    strict = BadSamplePolicy(max_bad_fraction=0.1, min_samples=8)
    loader = StreamLoader(stream_of(url, strict), list, batch_size=4, num_workers=2)
    batches = iter(loader)
    next(batches)  # 4 samples, 1 bad: not judged before min_samples
    with pytest.raises(
        TooManyBadSamples,
        match=r"^2 of 8 samples were bad \(25.0%\), more than max_bad_fraction=0.1; .*s003.*s012",
    ):
        next(batches)


def test_a_corpus_where_every_sample_is_bad_stops_at_once_naming_the_reason(tmp_path: Path):
    url = write_shard(tmp_path / "fine.tar", 400, {})
    loader = StreamLoader(stream_of(url, map=always_bad), list, batch_size=4, num_workers=2)
    batches = iter(loader)
    with pytest.raises(TooManyBadSamples, match=r"4 consecutive bad samples.*no 'png' field"):
        next(batches)  # the very first batch: no worker reads on through 200 samples for a good one
    assert loader.samples_seen <= 8


def test_a_shard_cut_short_makes_its_missing_samples_bad_and_keeps_the_count(tmp_path: Path):
    url = write_shard(tmp_path / "whole.tar", 12, {})
    dataset = stream_of(url)
    data = Path(url).read_bytes()
    Path(url).write_bytes(data[: len(data) * 2 // 3])  # the file loses its last third after counting
    loader = StreamLoader(dataset, list, batch_size=4)
    batches = list(loader)
    assert len(batches) == 3 and all(len(b) == 4 for b in batches)
    assert 3 <= loader.bad_samples <= 5
    assert "could not be read past sample" in str(loader.ledger.latest[-1])


def test_a_malformed_manifest_line_is_a_bad_sample_named_by_its_line(tmp_path: Path):
    path = tmp_path / "manifest.jsonl"
    path.write_text(
        '{"caption": "one"}\n{"caption": oops}\n\n{"caption": "three"}\n[1, 2]\n{"caption": "5"}\n'
    )
    shards = count_shards([str(path)], JsonlLines())
    dataset = StreamDataset(shards, JsonlLines(), lambda s: json_record(s)["caption"], 0, False, 8, LENIENT)
    loader = StreamLoader(dataset, list, batch_size=5, drop_last=False)
    assert list(loader) == [["one", "three", "three", "5", "5"]]
    assert [r.key for r in loader.ledger.latest] == ["line 2", "line 5"]
    assert "invalid JSON" in loader.ledger.latest[0].reason
    assert "expected a JSON object, got list" in loader.ledger.latest[1].reason


# --- map-style document datasets ------------------------------------------------------------------------


def make_or_refuse(index: int, epoch: int) -> list[int]:
    if index in (2, 5):
        raise BadSample(f"document {index} has no text")
    return [index, epoch]


def test_a_bad_map_style_document_is_replaced_by_a_hashed_index_counted_the_same_every_run():
    sampler = EpochShuffleSampler(8, seed=3, shuffle=False)
    documents = DocumentDataset(8, make_or_refuse, sampler, name="toy train")

    def epoch() -> tuple[list, int]:
        loader = ResumableDataLoader(documents.replacing(), list, LENIENT, batch_size=4, sampler=sampler)
        return list(loader), loader.bad_samples

    batches, bad = epoch()
    assert bad == 2 and [len(b) for b in batches] == [4, 4]
    flat = [d for b in batches for d in b]
    for index in (2, 5):
        attempt = 1
        while (stand_in := replacement_index(3, 0, index, attempt, 8)) in (2, 5):
            attempt += 1
        assert flat[index] == [stand_in, 0]
    assert epoch() == (batches, bad)
    assert documents[0] == [0, 0]  # direct access is unchanged: no replacement, no report


# --- the log ----------------------------------------------------------------------------------------


class Probe(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch: list[str], batch_idx: int) -> torch.Tensor:
        return (self.weight - len(batch)).pow(2).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_monitor_logs_bad_samples_and_their_fraction(tmp_path: Path):
    url = write_shard(tmp_path / "broken.tar", 20, BROKEN)
    loader = StreamLoader(stream_of(url), list, batch_size=4, num_workers=2)
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, logger=L.pytorch.loggers.CSVLogger(tmp_path), log_every_n_steps=1,
        callbacks=[BadSampleMonitor()], enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(Probe(), train_dataloaders=loader)
    rows = (Path(trainer.logger.log_dir) / "metrics.csv").read_text().splitlines()
    header, last = rows[0].split(","), rows[-1].split(",")
    assert float(last[header.index("data/bad_samples")]) == 3
    assert float(last[header.index("data/bad_fraction")]) == pytest.approx(3 / 20)
