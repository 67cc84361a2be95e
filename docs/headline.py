"""Writes the headline-figure tables of docs/results.md and docs/benchmarks.md from docs/figures.json, the one
source of each headline figure (issue 20, item 7).

    .venv/bin/python docs/headline.py          # rewrite both tables
    .venv/bin/python docs/headline.py --check  # exit 1 if a page's table is not what the JSON says

Prose elsewhere in the docs quotes a figure as `<!--fig:KEY-->VALUE`; tests/test_docs_figures.py checks that
every such VALUE is the JSON's and that every missed target is listed under "Targets not met".
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
FIGURES = DOCS / "figures.json"
PAGES = (DOCS / "results.md", DOCS / "benchmarks.md")
START, END = "<!-- headline:start -->", "<!-- headline:end -->"
MARKER = re.compile(r"<!--fig:([a-z0-9_]+)-->\*{0,2}([-+]?[0-9][0-9.,]*)")


def load_figures(path: Path = FIGURES) -> list[dict]:
    figures = json.loads(path.read_text())["figures"]
    keys = [figure["key"] for figure in figures]
    duplicated = sorted({key for key in keys if keys.count(key) > 1})
    if duplicated:
        raise ValueError(f"{path}: keys given twice: {duplicated}")
    return figures


def _verdict(figure: dict) -> str:
    return {True: "met", False: "**not met**", None: ""}[figure["met"]]


def render_table(figures: list[dict]) -> str:
    """The markdown block between START and END: one row a figure, then the notes on baselines that
    cannot lose by construction."""
    lines = [
        START,
        "<!-- written by docs/headline.py from docs/figures.json: edit the JSON, not this table -->",
        "",
        "| figure | key | value | target | | command (commit) |",
        "|---|---|---|---|---|---|",
    ]
    for figure in figures:
        commit = f" (`{figure['commit']}`)" if figure.get("commit") else ""
        note = " (baseline loses by construction, see below)" if figure.get("by_construction") else ""
        lines.append(
            f"| {figure['what']}{note} | `{figure['key']}` | **{figure['value']}** "
            f"| {figure['target'] or ''} | {_verdict(figure)} | `{figure['command']}`{commit} |"
        )
    notes = [figure for figure in figures if figure.get("by_construction")]
    if notes:
        lines += ["", "Baselines that cannot lose by construction:", ""]
        lines += [f"- `{figure['key']}`: {figure['by_construction']}." for figure in notes]
    lines.append(END)
    return "\n".join(lines)


def with_table(text: str, table: str, page: Path) -> str:
    if START not in text or END not in text:
        raise ValueError(f"{page}: no {START} ... {END} block for the headline table")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return head + table + tail


def marked_figures(text: str) -> list[tuple[str, str]]:
    """Every `<!--fig:KEY-->VALUE` in a page, as (key, value) pairs."""
    return [(key, value.rstrip(".,")) for key, value in MARKER.findall(text)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report stale tables instead of writing them")
    args = parser.parse_args(argv)
    table = render_table(load_figures())
    stale = []
    for page in PAGES:
        text = page.read_text()
        new = with_table(text, table, page)
        if new != text:
            stale.append(page)
            if not args.check:
                page.write_text(new)
    if args.check and stale:
        print("stale headline tables: " + ", ".join(str(page) for page in stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
