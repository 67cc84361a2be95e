"""Where raw paired samples come from: jsonl manifests and WebDataset tar shards (issue 14, item 1); the
pre-tokenized kind, `zoo tokenize`'s code shards, is `zoo.datamodules.code_shards.CodeShardSource`.

A source lists its files (counted once, `zoo.datamodules.shards`) and turns one undecoded record into a
media sample (stage (a) of `zoo.datamodules.media_samples`): the caption and the medium, decoded to the
model's sizes, or texts and media in order for an interleaved document. Anything wrong with a record (a
malformed line, a missing or undecodable file, no caption or an empty one, two media where one was
expected) raises `BadSample` or `MediaError` naming the file and the record, which the streaming core
counts and replaces.

Each source also says how much of an epoch it makes (`weight`, see `zoo.datamodules.mixture`), which tasks
it feeds (`TaskWeights`) and the prompts of its documents (`Prompts`).

Manifest records (one JSON object per line; media paths relative to the manifest, or absolute):

    {"image": "a.jpg", "caption": "a cat"}      {"audio": "a.flac", "text": "hello"}
    {"video": "a.mp4", "caption": "a dog runs"}
    {"segments": [{"text": "Look:"}, {"image": "a.jpg"}, {"text": "a cat."}]}

Tar samples (webdataset's key rule: `000123.jpg` is field `jpg` of sample `000123`): one media field by
suffix (jpg/png/webp/..., wav/flac/ogg/mp3, mp4/webm/gif; `media_keys` narrows them) and the caption in a
text field (`txt`, ...) or in the `json` field's "caption"/"text". A `json` with "segments" makes an
interleaved document whose media name fields of the same sample (`{"image": "0.jpg"}` reads
`000123.0.jpg`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from zoo.config import Configurable
from zoo.datamodules.bad_samples import BadSample
from zoo.datamodules.media_samples import (
    InterleavedSample,
    Media,
    MediaSample,
    MediaSpec,
    PairedSample,
    checked_text,
    decode_media,
    sample_id,
)
from zoo.datamodules.paired_documents import Prompts, TaskWeights
from zoo.datamodules.sequence import MediaLayout
from zoo.datamodules.shards import (
    JsonlLines,
    SampleFormat,
    Shard,
    TarSamples,
    count_shards,
    expand,
    is_local,
    json_record,
    local_path,
)
from zoo.media import MediaSource, kind_of
from zoo.media.kinds import MediaKind

MEDIA_KEYS: tuple[MediaKind, ...] = ("image", "video", "audio")
Resolve = Callable[[MediaKind, object, str], tuple[MediaSource, str | None]]


class PairedSource(Configurable):
    """What every source of `PairedDataModule` shares.

    Args:
        weight: this source's share of an epoch: `round(weight * samples)` samples of it per epoch (whole
            passes, then a fixed part; `zoo.datamodules.mixture`). 1: each sample once.
        tasks: the tasks its samples feed, with relative weights.
        prompts: text right after `<bos>` in its documents, per task (never predicted).
        caption_keys: the JSON fields that hold a sample's text, first present wins.
    """

    format: SampleFormat

    def __init__(
        self,
        weight: float = 1.0,
        tasks: TaskWeights = TaskWeights(),
        prompts: Prompts = Prompts(),
        caption_keys: tuple[str, ...] = ("caption", "text"),
    ) -> None:
        if not weight > 0:
            raise ValueError(f"a source's weight must be > 0 (leave the source out instead), got {weight!r}")
        if not caption_keys:
            raise ValueError("caption_keys is empty: name the field(s) that hold a sample's text")
        self.weight, self.tasks, self.prompts = float(weight), tasks, prompts
        self.caption_keys = tuple(caption_keys)

    # -- what a kind of source provides ------------------------------------------------------------
    def count(self) -> list[Shard]:
        """The source's files with their sample counts."""
        raise NotImplementedError

    def decode(self, sample: dict, spec: MediaSpec) -> MediaSample:
        """Stage (a): one undecoded record -> a media sample at the sizes of a resolved `spec`."""
        raise NotImplementedError

    def texts(self, sample: dict) -> list[str]:
        """The texts of one record without decoding its media (to train a tokenizer); [] when bad."""
        raise NotImplementedError

    def check_model(self, model: object | None, layout: MediaLayout) -> None:
        """Called before loaders are built with the model being trained (None: not known) and its layout.
        Raw media suit any model (they are decoded to its sizes); a source that only one model can read
        (code shards of its tokenizers) refuses the others here."""

    # -- shared parsing -----------------------------------------------------------------------------
    def caption(self, record: dict, where: str) -> str:
        for key in self.caption_keys:
            if key in record:
                return checked_text(record[key], f"{where} {key!r}")
        raise BadSample(f"{where}: no caption; expected one of the fields {list(self.caption_keys)}")

    def segments(
        self, record: dict, where: str, identity: str, resolve: Resolve, spec: MediaSpec
    ) -> InterleavedSample:
        """An interleaved record's `segments`, each `{"text": ...}` or `{"image"|"video"|"audio": ...}`."""
        parts: list[str | Media] = []
        for i, (kind, value) in enumerate(self.segment_items(record, where)):
            at = f"{where} segment {i}"
            if kind == "text":
                parts.append(checked_text(value, at, "text"))
            else:
                source, name = resolve(kind, value, at)
                parts.append(decode_media(kind, source, spec, name))
        return InterleavedSample(where, tuple(parts), identity)

    @staticmethod
    def segment_items(record: dict, where: str) -> list[tuple[str, object]]:
        segments = record["segments"]
        if not isinstance(segments, list) or not segments:
            raise BadSample(f"{where}: 'segments' must be a non-empty list of objects")
        items = []
        for i, segment in enumerate(segments):
            keys = list(segment) if isinstance(segment, dict) else []
            if len(keys) != 1 or keys[0] not in ("text", *MEDIA_KEYS):
                raise BadSample(
                    f"{where} segment {i}: expected one of {{'text': ...}}, {{'image': ...}}, "
                    f"{{'video': ...}}, {{'audio': ...}}, got {segment!r}"[:300]
                )
            items.append((keys[0], segment[keys[0]]))
        return items

    def record_texts(self, record: dict, where: str) -> list[str]:
        if "segments" in record:
            return [v for k, v in self.segment_items(record, where) if k == "text" and isinstance(v, str)]
        return [self.caption(record, where)]


class ManifestSource(PairedSource):
    """Samples listed in jsonl manifests (module docstring); several manifests make one source.

    Args:
        manifests: jsonl files (local paths; brace patterns expand: `parts/{0..3}.jsonl`).
        weight, tasks, prompts, caption_keys: see `PairedSource`.
    """

    format = JsonlLines()

    def __init__(
        self,
        manifests: list[str],
        weight: float = 1.0,
        tasks: TaskWeights = TaskWeights(),
        prompts: Prompts = Prompts(),
        caption_keys: tuple[str, ...] = ("caption", "text"),
    ) -> None:
        super().__init__(weight, tasks, prompts, caption_keys)
        if not manifests:
            raise ValueError("manifests is empty: give at least one jsonl manifest")
        self.manifests = list(manifests)

    def __repr__(self) -> str:
        return f"ManifestSource({', '.join(self.manifests)})"

    def count(self) -> list[Shard]:
        remote = [url for url in expand(self.manifests) if not is_local(url)]
        if remote:
            raise ValueError(
                f"manifests are local jsonl files (their media paths are relative to them): {remote}"
            )
        return count_shards(self.manifests, self.format)

    def decode(self, sample: dict, spec: MediaSpec) -> MediaSample:
        record = json_record(sample)
        where = f"{sample['__url__']} {sample['__key__']}"
        identity = sample_id(sample["__url__"], sample["__key__"])
        root = Path(local_path(sample["__url__"])).parent

        def resolve(kind: MediaKind, value: object, at: str) -> tuple[MediaSource, None]:
            if not isinstance(value, str) or not value:
                raise BadSample(f"{at}: {kind!r} must be a non-empty path string, got {value!r}")
            return root / value, None  # a missing file: MissingMediaError naming the path

        if "segments" in record:
            return self.segments(record, where, identity, resolve, spec)
        kinds = [k for k in MEDIA_KEYS if k in record]
        if len(kinds) != 1:
            raise BadSample(
                f"{where}: expected exactly one of {list(MEDIA_KEYS)} (or 'segments'), got the keys "
                f"{sorted(record)}"
            )
        caption = self.caption(record, where)
        path, _ = resolve(kinds[0], record[kinds[0]], where)
        return PairedSample(where, caption, decode_media(kinds[0], path, spec), identity)

    def texts(self, sample: dict) -> list[str]:
        try:
            return self.record_texts(json_record(sample), str(sample.get("__key__")))
        except (BadSample, KeyError):
            return []


class TarSource(PairedSource):
    """Samples in WebDataset tar shards (module docstring).

    Args:
        shards: tar files or urls: local paths, brace patterns (`shards/{000000..000099}.tar`), or anything
            webdataset opens (`pipe:curl -s https://...`); remote ones want `index`.
        weight, tasks, prompts: see `PairedSource`.
        media_keys: the fields that may hold the medium (e.g. `[jpg]` when samples also carry a `png` mask);
            None: any field whose suffix is an image, video or audio format.
        text_keys: fields holding the caption as UTF-8 text, first present wins.
        caption_keys: the caption's field in the `json` field, when no text field is present.
        json_key: the field holding JSON metadata (a caption, or `segments` for an interleaved document).
        index: an index JSON with every shard's sample count (`shards.write_index`); None: an `index.json`
            beside local shards, else a scan of their headers.
        read_remote: count remote shards without an index by reading them once (slow; write an index).
    """

    format = TarSamples()

    def __init__(
        self,
        shards: list[str],
        weight: float = 1.0,
        tasks: TaskWeights = TaskWeights(),
        prompts: Prompts = Prompts(),
        media_keys: tuple[str, ...] | None = None,
        text_keys: tuple[str, ...] = ("txt", "text", "caption"),
        caption_keys: tuple[str, ...] = ("caption", "text"),
        json_key: str = "json",
        index: str | None = None,
        read_remote: bool = False,
    ) -> None:
        super().__init__(weight, tasks, prompts, caption_keys)
        if not shards:
            raise ValueError("shards is empty: give at least one tar shard")
        unknown = [k for k in media_keys or () if kind_of(k) is None]
        if unknown:
            raise ValueError(
                f"media_keys {unknown} are not image, video or audio suffixes (jpg, flac, mp4, ...)"
            )
        self.shards = list(shards)
        self.media_keys = None if media_keys is None else tuple(k.lower() for k in media_keys)
        self.text_keys, self.json_key = tuple(text_keys), json_key
        self.index, self.read_remote = index, read_remote

    def __repr__(self) -> str:
        return f"TarSource({', '.join(self.shards)})"

    def count(self) -> list[Shard]:
        return count_shards(self.shards, self.format, self.index, self.read_remote)

    def decode(self, sample: dict, spec: MediaSpec) -> MediaSample:
        url, key = sample["__url__"], sample["__key__"]
        where = f"{url} [{key}]"
        fields = {k.lower(): v for k, v in sample.items() if not k.startswith("__")}
        record = self.json(fields, where)

        def resolve(kind: MediaKind, value: object, at: str) -> tuple[MediaSource, str]:
            field = value.lower() if isinstance(value, str) else None
            if field not in fields:
                raise BadSample(
                    f"{at}: {kind} {value!r} names no field of the sample (fields: {sorted(fields)})"
                )
            return fields[field], f"{url}:{key}.{field}"

        identity = sample_id(url, key)
        if record is not None and "segments" in record:
            return self.segments(record, where, identity, resolve, spec)
        media = [f for f in fields if self.is_media(f)]
        if len(media) != 1:
            wanted = list(self.media_keys) if self.media_keys else "image, video or audio suffixes"
            raise BadSample(f"{where}: expected one media field ({wanted}), got the fields {sorted(fields)}")
        caption = self.caption_of(fields, record, where)
        source, name = resolve(kind_of(media[0]), media[0], where)
        return PairedSample(where, caption, decode_media(kind_of(media[0]), source, spec, name), identity)

    def is_media(self, field: str) -> bool:
        return kind_of(field) is not None and (self.media_keys is None or field in self.media_keys)

    def json(self, fields: dict, where: str) -> dict | None:
        if self.json_key not in fields:
            return None
        try:
            record = json.loads(fields[self.json_key])
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadSample(f"{where}: the {self.json_key!r} field is not valid JSON ({e})") from None
        if not isinstance(record, dict):
            raise BadSample(f"{where}: the {self.json_key!r} field is not a JSON object")
        return record

    def caption_of(self, fields: dict, record: dict | None, where: str) -> str:
        for key in self.text_keys:
            if key in fields:
                try:
                    text = bytes(fields[key]).decode("utf-8")
                except UnicodeDecodeError as e:
                    raise BadSample(f"{where}: the {key!r} field is not UTF-8 text ({e})") from None
                return checked_text(text, f"{where} {key!r}")
        if record is not None:
            return self.caption(record, where)
        raise BadSample(
            f"{where}: no caption; expected a field among {list(self.text_keys)} or a {self.json_key!r} "
            f"field with one of {list(self.caption_keys)}, got the fields {sorted(fields)}"
        )

    def texts(self, sample: dict) -> list[str]:
        fields = {k.lower(): v for k, v in sample.items() if not k.startswith("__")}
        where = str(sample.get("__key__"))
        try:
            record = self.json(fields, where)
            if record is not None and "segments" in record:
                return self.record_texts(record, where)
            return [self.caption_of(fields, record, where)]
        except BadSample:
            return []
