"""The folder `zoo tokenize` writes, and how it survives being killed.

    out/
      tokenize.json        which tokenizers (fingerprint, config) and decoding settings made the shards
      codes-00000.tar      one WebDataset shard of code records per unit (`zoo.datamodules.code_records`)
      progress/codes-00000.json   what went into that shard: its unit, samples, the samples refused
      index.json           {"shards": [{"url", "samples"}]}: what the streaming core reads
      failures.jsonl       every input sample (or whole input) that was not tokenized, and why

A shard is written, once its unit is read, under a temporary name (`codes-00000.tar.tmp`), then its
progress record, then the shard is renamed: the rename is the commit. A shard exists only complete, and
only with its record beside it, so a rerun skips every shard that exists (after checking it was made from
the same unit) and rewrites the rest from scratch; a killed run leaves at most temporary files, which the
rerun overwrites. The index and the failure manifest are rewritten at the end of every run from the
progress records.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from webdataset import TarWriter

from zoo.datamodules.code_records import CodeRecord, InterleavedRecord
from zoo.datamodules.shards import INDEX_NAME, Shard, write_index
from zoo.pretokenize.sources import Unit

RUN_NAME = "tokenize.json"
FAILURES_NAME = "failures.jsonl"
PROGRESS_DIR = "progress"
RUN_FORMAT = "zoo.code_shards/1"


def write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    temporary.replace(path)


class ShardOutput:
    """One output shard being made: its records and the failures of its unit, until `commit` writes it."""

    def __init__(self, folder: OutputFolder, unit: Unit) -> None:
        self.folder, self.unit = folder, unit
        self.path = folder.shard_path(unit)
        self.temporary = self.path.with_name(self.path.name + ".tmp")
        self.records: dict[int, CodeRecord | InterleavedRecord] = {}
        self.samples = 0
        self.kinds: dict[str, int] = {}
        self.audio_seconds = 0.0
        self.failures: list[dict[str, Any]] = []

    def write(self, record: CodeRecord | InterleavedRecord, position: int) -> None:
        """Keep `record` (of input sample `position`) for the shard; records are a few kB each."""
        self.records[position] = record
        self.samples += 1
        self.kinds[record.kind] = self.kinds.get(record.kind, 0) + 1
        media = record.media if isinstance(record, InterleavedRecord) else [record]
        for medium in media:
            if medium.kind == "audio":
                self.audio_seconds += medium.info["samples"] / medium.info["sample_rate"]

    def fail(self, position: int, key: str, reason: str) -> None:
        self.failures.append({"position": position, "key": key, "reason": reason})

    def _write_shard(self) -> None:
        """The records in input order, keyed by their input position: the same bytes whatever the batch
        size, the workers or an earlier interruption (member times are fixed)."""
        with open(self.temporary, "wb") as file:
            with TarWriter(file, encoder=False, mtime=0) as writer:
                for position in sorted(self.records):
                    writer.write(self.records[position].to_sample(f"{position:09d}"))
            file.flush()
            os.fsync(file.fileno())

    def commit(self) -> dict[str, Any]:
        """Write the shard under its temporary name, then its progress record, then rename it into place;
        returns the progress record."""
        self._write_shard()
        state = {
            "unit": self.unit.as_json(),
            "shard": self.path.name,
            "samples": self.samples,
            "kinds": self.kinds,
            "audio_seconds": round(self.audio_seconds, 6),
            "failures": self.failures,
        }
        write_atomically(self.folder.state_path(self.unit), json.dumps(state, indent=1) + "\n")
        self.temporary.replace(self.path)
        return state

    def abort(self) -> None:
        """Drop the shard (its unit could not be read to the end, or the run stopped)."""
        self.records.clear()
        self.temporary.unlink(missing_ok=True)


class OutputFolder:
    """The output folder of one tokenization (module docstring). `run` describes the tokenizers and the
    decoding; a folder written by another run (other tokenizers or settings) is refused."""

    def __init__(self, root: str | Path, run: dict[str, Any]) -> None:
        self.root = Path(root)
        (self.root / PROGRESS_DIR).mkdir(parents=True, exist_ok=True)
        self.run = json.loads(json.dumps({"format": RUN_FORMAT, **run}))  # as JSON reads it back
        self._check_run()

    def _check_run(self) -> None:
        path = self.root / RUN_NAME
        if not path.exists():
            write_atomically(path, json.dumps(self.run, indent=1, sort_keys=True) + "\n")
            return
        try:
            saved = json.loads(path.read_text())
        except ValueError as error:
            raise ValueError(f"{path}: unreadable ({error}); delete the folder or write elsewhere") from None
        differ = sorted(k for k in set(saved) | set(self.run) if saved.get(k) != self.run.get(k))
        if differ:
            details = "; ".join(f"{k}: saved {saved.get(k)!r}, now {self.run.get(k)!r}" for k in differ)
            raise ValueError(
                f"{self.root} holds code shards of another tokenization ({', '.join(differ)} differ): "
                f"write them to a new --out folder, or delete this one. {details[:600]}"
            )

    def shard_path(self, unit: Unit) -> Path:
        return self.root / unit.name

    def state_path(self, unit: Unit) -> Path:
        return self.root / PROGRESS_DIR / unit.name.replace(".tar", ".json")

    def finished(self, unit: Unit) -> dict[str, Any] | None:
        """The progress record of `unit`'s shard when it was committed, else None. A committed shard made
        from another unit (the inputs were reordered or changed) is refused."""
        state_path = self.state_path(unit)
        if not (self.shard_path(unit).exists() and state_path.exists()):
            return None
        state = json.loads(state_path.read_text())
        if state.get("unit") != unit.as_json():
            raise ValueError(
                f"{self.shard_path(unit)} was made from {state.get('unit')}, but unit {unit.index} of this "
                f"run is {unit.as_json()}: the inputs changed; give them in the same order, or write to a "
                "new --out"
            )
        return state

    def open(self, unit: Unit) -> ShardOutput:
        return ShardOutput(self, unit)

    def write_index(self, finished: list[tuple[Unit, dict[str, Any]]]) -> Path:
        """index.json over the committed shards that hold samples, in unit order."""
        shards = [Shard(str(self.shard_path(u)), s["samples"]) for u, s in finished if s["samples"]]
        path = self.root / INDEX_NAME
        write_index(path, shards)
        return path

    def write_failures(self, entries: list[dict[str, Any]]) -> Path:
        path = self.root / FAILURES_NAME
        write_atomically(path, "".join(json.dumps(e, sort_keys=True) + "\n" for e in entries))
        return path
