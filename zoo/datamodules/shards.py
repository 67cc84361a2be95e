"""Shards and their sample counts: what a stream reads, and how many samples each file holds.

An exact partition over ranks and workers needs every shard's sample count before the first sample is
read. Counts come from an index JSON written beside the shards (`index.json`, as `write_index` writes it;
`zoo tokenize` writes one with its code shards) or, for local files, from one scan at setup. A source whose
count cannot be known without reading it (`pipe:`, `http(s)://`, ...) needs an index: `count_shards(...,
read_remote=True)` reads it once and `write_index` stores the counts. Nothing is guessed.

Formats say how to count and read one file. A sample is a dict of undecoded fields plus `__url__` and
`__key__` (where it is, for error messages):
- `TarSamples`: WebDataset tar shards, read with the `webdataset` library's own tar iterators (its key
  rule: the basename splits at its *first* dot, so `a.b.jpg` is key `a`, field `b.jpg`); counted from tar
  headers alone with the same rule, without reading the members;
- `JsonlLines`: jsonl manifests, one sample per non-empty line (`json`: the line's bytes; `json_record`
  parses it, naming the file and line when it cannot).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Protocol

from webdataset import tariterators
from webdataset.gopen import gopen
from webdataset.shardlists import expand_urls

from zoo.datamodules.bad_samples import BadSample

INDEX_NAME = "index.json"


@dataclass(frozen=True)
class Shard:
    """`samples` samples of the file at `url`, starting at its sample `start` (a split may take part of a
    file: the head for training, the tail for validation)."""

    url: str
    samples: int
    start: int = 0


class SampleFormat(Protocol):
    """How to count and read one file of samples (picklable: workers receive it)."""

    def count(self, path: str) -> int: ...

    def read(self, url: str, start: int) -> Iterator[dict]:
        """The samples of `url` in file order, from sample number `start` on."""
        ...


def is_local(url: str) -> bool:
    return ":" not in url.split("/", 1)[0] or url.startswith("file:")


def local_path(url: str) -> str:
    return re.sub(r"^file://?", "", url) if url.startswith("file:") else url


# --- WebDataset tar shards ---------------------------------------------------------------------------

# webdataset's own filter of member names (its default argument), so that counting agrees with reading.
_SKIP_META = inspect.signature(tariterators.tar_file_iterator).parameters["skip_meta"].default


def _counted_member(info: tarfile.TarInfo) -> bool:
    """Whether webdataset's `tar_file_iterator` yields this member (regular files, no metadata)."""
    name = info.name
    if not info.isreg():
        return False
    prefix, suffix = tariterators.meta_prefix, tariterators.meta_suffix
    if "/" not in name and name.startswith(prefix) and name.endswith(suffix):
        return False
    return not (_SKIP_META is not None and re.match(_SKIP_META, name))


class TarSamples:
    """WebDataset tar shards: a sample is the members sharing a key, `{"__key__", "__url__", ext: bytes}`."""

    def count(self, path: str) -> int:
        """Samples of a local tar from its headers alone (no member is read), with webdataset's grouping."""
        try:
            with tarfile.open(path, "r:*") as tar:
                names = [{"fname": i.name, "data": b"", "__url__": path} for i in tar if _counted_member(i)]
        except (tarfile.TarError, OSError) as e:
            raise ValueError(f"{path}: not a readable tar file ({e})") from None
        try:
            return sum(1 for _ in tariterators.group_by_keys(iter(names)))
        except ValueError as e:  # a duplicate field within one sample
            raise ValueError(f"{path}: {e.args[0]}") from None

    def read(self, url: str, start: int) -> Iterator[dict]:
        stream = gopen(url)
        try:
            files = tariterators.tar_file_expander([{"url": url, "stream": stream}], eof_value=None)
            yield from islice(tariterators.group_by_keys(files), start, None)
        finally:
            stream.close()


# --- jsonl manifests ---------------------------------------------------------------------------------


class JsonlLines:
    """jsonl manifests: one sample per non-empty line, `{"__url__", "__key__": "line N", "json": bytes}`."""

    def count(self, path: str) -> int:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())

    def read(self, url: str, start: int) -> Iterator[dict]:
        with open(local_path(url), "rb") as f:
            samples = (
                {"__url__": url, "__key__": f"line {number}", "json": line}
                for number, line in enumerate(f, start=1)
                if line.strip()
            )
            yield from islice(samples, start, None)


def json_record(sample: dict) -> dict:
    """The JSON object of a `JsonlLines` sample; `BadSample` naming the file and line when it is not one."""
    where = f"{sample.get('__url__')} {sample.get('__key__')}"
    try:
        record = json.loads(sample["json"])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadSample(f"{where}: invalid JSON ({e})") from None
    if not isinstance(record, dict):
        raise BadSample(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


# --- counts: an index or a scan ----------------------------------------------------------------------


def expand(sources: Sequence[str]) -> list[str]:
    """Brace patterns and `::`-joined lists (webdataset's syntax) expanded, in order."""
    return [url for source in sources for url in expand_urls(source)]


def write_index(path: str | Path, shards: Sequence[Shard]) -> None:
    """Writes an index JSON; urls under its folder are stored relative to it. Atomic: a temporary file is
    renamed, so a reader never sees half an index."""
    path = Path(path)
    folder = path.parent.resolve()
    entries = []
    for shard in shards:
        url = shard.url
        if is_local(url) and Path(local_path(url)).resolve().is_relative_to(folder):
            url = os.path.relpath(Path(local_path(url)).resolve(), folder)
        entries.append({"url": url, "samples": shard.samples})
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps({"shards": entries}, indent=1) + "\n")
    temporary.replace(path)


def read_index(path: str | Path) -> list[Shard]:
    """The shards an index JSON lists (`{"shards": [{"url": ..., "samples": n}, ...]}`), local relative urls
    resolved against its folder."""
    path = Path(path)
    try:
        entries = json.loads(path.read_text())["shards"]
        shards = [(str(e["url"]), int(e["samples"])) for e in entries]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f'{path}: not a shard index (expected {{"shards": [{{"url": ..., "samples": n}}]}}): {e}'
        ) from None
    return [
        Shard(str(path.parent / url) if is_local(url) and not os.path.isabs(url) else url, samples)
        for url, samples in shards
    ]


def count_shards(
    sources: Sequence[str], format: SampleFormat, index: str | None = None, read_remote: bool = False
) -> list[Shard]:
    """The shards of `sources` (paths, urls, brace patterns) with their sample counts.

    Counts come from `index` when given, else from an `index.json` beside a local shard that lists it, else
    from a scan of the local file. A remote source without an index is refused unless `read_remote`, which
    reads it once (use that to write an index, not at every setup).
    """
    urls = expand(sources)
    if not urls:
        raise ValueError("no shards given")
    known = {_key(s.url): s.samples for s in read_index(index)} if index else {}
    shards = []
    for url in urls:
        samples = known.get(_key(url))
        if samples is None and not index:
            samples = _beside(url)
        if samples is None:
            samples = _count_one(url, format, index, read_remote)
        shards.append(Shard(url, samples))
    return shards


def _key(url: str) -> str:
    return str(Path(local_path(url)).resolve()) if is_local(url) else url


def _beside(url: str) -> int | None:
    if not is_local(url):
        return None
    beside = Path(local_path(url)).parent / INDEX_NAME
    if not beside.is_file():
        return None
    return {_key(s.url): s.samples for s in read_index(beside)}.get(_key(url))


def _count_one(url: str, format: SampleFormat, index: str | None, read_remote: bool) -> int:
    if index:
        raise ValueError(f"{url} is not listed in the index {index}")
    if is_local(url):
        path = local_path(url)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"shard not found: {path}")
        return format.count(path)
    if read_remote:
        return sum(1 for _ in format.read(url, 0))
    raise ValueError(
        f"{url}: the number of samples of a remote source cannot be known without reading it; give an "
        f'index JSON ({{"shards": [{{"url": ..., "samples": n}}]}}) as `index`, e.g. written once by '
        f"zoo.datamodules.shards.write_index(path, count_shards(urls, format, read_remote=True))"
    )
