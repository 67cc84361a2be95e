"""The streaming core as a specification (issue 14, item 4): shard counts, the exact partition of an epoch
over ranks and workers, the shuffle buffer, the delivery order, and mid-epoch resume of `StreamLoader`.

Real tar shards written with webdataset's own writers, real DataLoader workers; ranks are simulated here
by building one loader per rank (the two-process run is tests/test_streaming_ranks.py).
"""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter
from pathlib import Path

import pytest
import webdataset as wds

from zoo.datamodules.partition import (
    Layout,
    batches_per_rank,
    delivered_per_worker,
    plan_epoch,
    shuffle_buffer,
    slot_rng,
)
from zoo.datamodules.shards import (
    JsonlLines,
    Shard,
    TarSamples,
    count_shards,
    read_index,
    write_index,
)
from zoo.datamodules.streaming import StreamDataset, StreamLoader


def write_shards(folder: Path, samples: int, per_shard: int) -> list[str]:
    """Tar shards of samples `{"txt": caption, "cls": index}` keyed `s00000`, ... (webdataset's writer)."""
    folder.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(folder / "shard-%04d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(samples):
            sink.write({"__key__": f"s{i:05d}", "txt": f"caption {i}", "cls": str(i)})
    return sorted(str(p) for p in folder.glob("shard-*.tar"))


def sample_id(sample: dict) -> int:
    """The `map` of most tests: the sample's own number, from its bytes."""
    return int(sample["cls"])


def stream(urls: list[str], shuffle: bool = True, buffer: int = 8, seed: int = 0) -> StreamDataset:
    return StreamDataset(count_shards(urls, TarSamples()), TarSamples(), sample_id, seed, shuffle, buffer)


def loader(dataset: StreamDataset, batch: int, rank: int = 0, world: int = 1, workers: int = 0, **kw):
    return StreamLoader(dataset, list, batch, rank, world, workers, **kw)


def epoch_ids(dataset: StreamDataset, epoch: int, batch: int, world: int, workers: int) -> list[list[int]]:
    """The sample numbers every rank delivers in `epoch`, one list per rank."""
    dataset.epoch = epoch
    return [[i for b in loader(dataset, batch, rank, world, workers) for i in b] for rank in range(world)]


# --- counts ------------------------------------------------------------------------------------------


def test_tar_counts_from_headers_agree_with_what_webdataset_reads(tmp_path: Path):
    path = tmp_path / "tricky.tar"
    members = [
        ("a.jpg", b"1"), ("a.txt", b"2"),  # one sample, two fields
        ("dir.v2/b.x.TXT", b"3"),  # key 'dir.v2/b' (the basename splits at its first dot), field 'x.txt'
        ("__meta__", b"skipped"),  # webdataset's metadata files are not samples
        ("c.json", b"{}"), ("noextension", b"not a sample"), ("d.txt", b"4"),
        ("a.cls", b"5"),  # key 'a' again, but not next to the first: webdataset makes it a new sample
    ]  # fmt: skip
    with tarfile.open(path, "w") as tar:
        tar.addfile(tarfile.TarInfo("folder"), None)  # a directory entry, not a file
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    read = list(TarSamples().read(str(path), 0))
    assert [s["__key__"] for s in read] == ["a", "dir.v2/b", "c", "d", "a"]
    assert read[1]["x.txt"] == b"3"
    assert TarSamples().count(str(path)) == len(read) == 5
    assert [s["__key__"] for s in TarSamples().read(str(path), 3)] == ["d", "a"]


def test_a_duplicate_field_in_one_sample_is_refused_at_counting_naming_the_shard(tmp_path: Path):
    path = tmp_path / "dup.tar"
    with tarfile.open(path, "w") as tar:
        for name in ("a.txt", "a.TXT"):  # webdataset lowercases extensions: the same field twice
            info = tarfile.TarInfo(name)
            tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(ValueError, match=rf"{path}: a.TXT: duplicate file name"):
        TarSamples().count(str(path))


def test_counts_come_from_an_index_beside_the_shards_or_from_a_scan(tmp_path: Path):
    urls = write_shards(tmp_path / "wds", 10, 4)
    scanned = count_shards([str(tmp_path / "wds" / "shard-{0000..0002}.tar")], TarSamples())
    assert [(s.url, s.samples) for s in scanned] == [(u, n) for u, n in zip(urls, [4, 4, 2], strict=True)]
    write_index(tmp_path / "wds" / "index.json", [Shard(urls[0], 40), Shard(urls[1], 4)])
    assert json.loads((tmp_path / "wds" / "index.json").read_text())["shards"][0]["url"] == "shard-0000.tar"
    assert [s.samples for s in count_shards(urls, TarSamples())] == [40, 4, 2]  # listed ones from the index
    assert [s.samples for s in read_index(tmp_path / "wds" / "index.json")] == [40, 4]


def test_a_remote_source_without_counts_is_refused_saying_how_to_give_them(tmp_path: Path):
    urls = write_shards(tmp_path / "wds", 6, 3)
    piped = [f"pipe:cat {u}" for u in urls]
    with pytest.raises(ValueError, match=r"pipe:cat .* cannot be known without reading it; give an index"):
        count_shards(piped, TarSamples())
    counted = count_shards(piped, TarSamples(), read_remote=True)
    write_index(tmp_path / "index.json", counted)
    shards = count_shards(piped, TarSamples(), index=str(tmp_path / "index.json"))
    assert [s.samples for s in shards] == [3, 3]
    data = StreamDataset(shards, TarSamples(), sample_id, shuffle=False)
    # 3 batches: worker 0 reads samples 0-3, worker 1 samples 4-5; they hand batches over in turn
    assert [i for b in loader(data, 2, workers=2) for i in b] == [0, 1, 4, 5, 2, 3]


def test_jsonl_lines_are_samples_numbered_by_line(tmp_path: Path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"image": "a.png"}\n\n{"image": "b.png"}\n')
    assert JsonlLines().count(str(path)) == 2
    assert [(s["__key__"], s["json"]) for s in JsonlLines().read(str(path), 1)] == [
        ("line 3", b'{"image": "b.png"}\n')
    ]


# --- the partition -----------------------------------------------------------------------------------


@pytest.mark.parametrize("counts", [[7, 5, 12], [24], [1, 1, 1, 1, 20]])
@pytest.mark.parametrize(("ranks", "workers", "batch"), [(1, 0, 4), (2, 2, 2), (3, 2, 1), (2, 3, 3)])
def test_every_sample_of_an_epoch_is_read_by_at_most_one_slot_and_ranks_deliver_equal_batches(
    counts, ranks, workers, batch
):
    total = sum(counts)
    seen: Counter = Counter()
    for rank in range(ranks):
        layout = Layout(rank, ranks, workers, batch, drop_last=True)
        plans = plan_epoch(counts, seed=3, epoch=1, shuffle=True, layout=layout)
        assert sum(p.batches for p in plans) == batches_per_rank(total, layout) == total // ranks // batch
        assert all(p.samples % batch == 0 for p in plans)
        for plan in plans:
            for piece in plan.pieces:
                seen.update((piece.shard, piece.first + k) for k in range(piece.count))
    assert max(seen.values()) == 1
    assert len(seen) == ranks * (total // ranks // batch) * batch
    assert all(0 <= i < counts[s] for s, i in seen)


def test_the_samples_left_out_of_an_epoch_differ_between_epochs():
    counts, layout = [10], Layout(0, 1, 0, 4)  # 10 samples, batches of 4: 2 left out per epoch
    left_out = []
    for epoch in range(4):
        (plan,) = plan_epoch(counts, 0, epoch, True, layout)
        read = {p.first + k for p in plan.pieces for k in range(p.count)}
        assert len(read) == 8
        left_out.append(frozenset(range(10)) - read)
    assert len(set(left_out)) > 1


def test_evaluation_keeps_every_sample_and_pads_the_last_rank_from_the_start():
    counts = [5]  # 2 ranks: 3 samples each, the last rank's third is sample 0 again
    got = []
    for rank in range(2):
        (plan,) = plan_epoch(counts, 0, 0, False, Layout(rank, 2, 0, 2, drop_last=False))
        got.append([p.first + k for p in plan.pieces for k in range(p.count)])
        assert plan.batches == 2  # a full batch and a short one
    assert got == [[0, 1, 2], [3, 4, 0]]


def test_batches_delivered_per_worker_follow_the_dataloaders_round_robin_skipping_exhausted_ones():
    assert delivered_per_worker([3, 1, 2], 0) == ([0, 0, 0], 0)
    assert delivered_per_worker([3, 1, 2], 1) == ([1, 0, 0], 1)
    assert delivered_per_worker([3, 1, 2], 4) == ([2, 1, 1], 2)  # round 1 has no batch of worker 1
    assert delivered_per_worker([3, 1, 2], 5) == ([2, 1, 2], 0)
    assert delivered_per_worker([3, 1, 2], 6) == ([3, 1, 2], 0)
    with pytest.raises(ValueError, match="hold only 6"):
        delivered_per_worker([3, 1, 2], 7)


def test_the_shuffle_buffer_permutes_and_its_draws_depend_on_the_seed_only():
    items = list(range(50))
    once = list(shuffle_buffer(items, 10, slot_rng(0, 1, 2)))
    assert sorted(once) == items and once != items
    assert once == list(shuffle_buffer(items, 10, slot_rng(0, 1, 2)))
    letters = list(shuffle_buffer([f"x{i}" for i in items], 10, slot_rng(0, 1, 2)))
    assert letters == [f"x{i}" for i in once]  # the same draws for any items
    assert once != list(shuffle_buffer(items, 10, slot_rng(0, 2, 2)))


# --- the stream through DataLoader workers -----------------------------------------------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_shards(tmp_path_factory.mktemp("wds"), 48, 10)  # 10, 10, 10, 10, 8 samples


def test_ranks_and_workers_together_deliver_every_sample_exactly_once(shards):
    dataset = stream(shards)
    ranks = epoch_ids(dataset, 0, batch=3, world=2, workers=2)
    assert [len(r) for r in ranks] == [24, 24]
    assert sorted(ranks[0] + ranks[1]) == list(range(48))


@pytest.mark.slow  # each spawned worker imports torch and the zoo afresh: ~10 s on a busy 2-core machine
def test_spawned_workers_read_only_their_rank_s_part(shards):
    # The layout travels with the dataset into each worker; nothing is read from the environment there,
    # where a spawned worker would find no process group and take the whole corpus (REFERENCES Part C §1).
    dataset = stream(shards)
    ranks = [
        [i for b in StreamLoader(dataset, list, 4, rank, 2, 2, multiprocessing_context="spawn") for i in b]
        for rank in range(2)
    ]
    assert [len(r) for r in ranks] == [24, 24] and sorted(ranks[0] + ranks[1]) == list(range(48))


def test_the_order_is_a_function_of_seed_and_epoch_and_the_sampler_lists_it_without_reading(shards):
    dataset = stream(shards)
    first = epoch_ids(dataset, 0, 4, 1, 2)[0]
    assert first == epoch_ids(dataset, 0, 4, 1, 2)[0] == epoch_ids(stream(shards), 0, 4, 1, 2)[0]
    second = epoch_ids(dataset, 1, 4, 1, 2)[0]
    assert second != first and sorted(second) == sorted(first) == list(range(48))
    assert epoch_ids(stream(shards, seed=1), 0, 4, 1, 2)[0] != first
    listed = loader(dataset, 4, workers=2).sampler
    listed.set_epoch(1)
    assert [index for index, _ in listed] == second  # the source index of shard files in order = the id
    assert dataset.epoch == 1 and len(listed) == 48


def test_len_is_the_exact_batch_count_per_rank(shards):
    dataset = stream(shards)
    for world, workers, batch in [(1, 0, 5), (2, 2, 3), (3, 2, 4)]:
        for rank in range(world):
            train = loader(dataset, batch, rank, world, workers)
            assert len(train) == len(list(train)) == 48 // world // batch


def test_evaluation_streams_keep_file_order_and_every_sample(shards):
    dataset = stream(shards, shuffle=False)
    batches = list(loader(dataset, 5, drop_last=False))
    assert [i for b in batches for i in b] == list(range(48)) and len(batches) == 10


@pytest.mark.parametrize(("world", "batch", "workers"), [(2, 4, 0), (2, 4, 2), (1, 5, 2)])
def test_a_stream_loader_restored_mid_epoch_yields_exactly_the_rest_of_that_epoch(
    shards, world, batch, workers
):
    dataset = stream(shards)
    dataset.epoch = 1
    whole = list(loader(dataset, batch, 0, world, workers))  # (1, 5, 2): 9 batches, 5 + 4 over the workers
    for done in range(1, len(whole)):
        first = loader(dataset, batch, 0, world, workers)
        batches = iter(first)
        for _ in range(done):
            next(batches)
        state = first.state_dict()
        assert state["epoch"] == 1 and state["batches"] == done
        resumed = loader(dataset, batch, 0, world, workers)
        resumed.load_state_dict(state)
        assert list(resumed) == whole[done:], f"resumed after {done} batches"
    assert list(resumed) == whole  # the skip applies to the resumed epoch only


def test_a_stream_resumes_mid_epoch_only_with_the_layout_it_was_saved_with(shards):
    dataset = stream(shards)
    saved = {"epoch": 0, "batches": 2, "world_size": 1, "num_workers": 2, "batch_size": 4}
    with pytest.raises(
        ValueError, match=r"layout it was saved with; \(saved, now\): \{'num_workers': \(2, 0\)"
    ):
        loader(dataset, 4).load_state_dict(saved)
    loader(dataset, 4).load_state_dict({**saved, "batches": 12})  # a finished epoch: any layout resumes
