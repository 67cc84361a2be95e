"""jsonl manifests of real media files: which samples a data source holds (DESIGN.md, "ShapesWorld", last
paragraph; issue 14). Decoding the files is `zoo.media`'s job; this module only reads and checks the list.
"""

from __future__ import annotations

import json
from pathlib import Path

from zoo.media.errors import MediaError, existing

MEDIA_KINDS = ("image", "video", "audio")


def read_manifest(path: str | Path) -> list[dict]:
    """The samples of a jsonl manifest, one JSON object per line (blank lines skipped).

    A line is {"image": ...} or {"video": ...} or {"audio": ...} (a path relative to the manifest's folder,
    or absolute) with an optional "text" (a string); other keys are kept. Each returned dict holds the
    line's keys with the media path made absolute, plus "kind" (the media key) and "line" (its number).
    Any bad line raises `MediaError` naming file:line and what was expected; media files must exist.
    """
    path = existing(path, "a jsonl manifest")
    root = path.parent
    samples = []
    with open(path, encoding="utf-8") as handle:
        for number, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            try:
                entry = json.loads(raw)
            except json.JSONDecodeError as error:
                raise MediaError(
                    f"{where}: not valid JSON ({error.msg}); expected one object per line"
                ) from error
            if not isinstance(entry, dict):
                raise MediaError(f"{where}: expected a JSON object, got {type(entry).__name__}")
            kinds = [k for k in MEDIA_KINDS if k in entry]
            if len(kinds) != 1:
                raise MediaError(f"{where}: expected exactly one of {MEDIA_KINDS} keys, got {sorted(entry)}")
            kind = kinds[0]
            if not isinstance(entry[kind], str) or not entry[kind]:
                raise MediaError(f"{where}: {kind!r} must be a non-empty path string, got {entry[kind]!r}")
            if "text" in entry and not isinstance(entry["text"], str):
                raise MediaError(f"{where}: 'text' must be a string, got {type(entry['text']).__name__}")
            media = (root / entry[kind]).resolve()
            if not media.exists():
                raise MediaError(f"{where}: {kind} file {media} does not exist")
            samples.append({**entry, kind: str(media), "kind": kind, "line": number})
    if not samples:
        raise MediaError(f"{path}: manifest is empty; expected one JSON object per line")
    return samples
