"""The docs quote each headline figure from one source, docs/figures.json (issue 20, item 7)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("headline", ROOT / "docs" / "headline.py")
headline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(headline)

FIGURES = {figure["key"]: figure for figure in headline.load_figures()}
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def test_both_pages_carry_the_table_the_json_gives():
    assert headline.main(["--check"]) == 0, "run docs/headline.py after editing docs/figures.json"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_marked_figure_is_the_one_in_the_json(page):
    for key, value in headline.marked_figures(page.read_text()):
        assert key in FIGURES, f"{page.name}: <!--fig:{key}--> names no figure of docs/figures.json"
        expected = FIGURES[key]["value"]
        assert value == expected, f"{page.name}: {key} quoted as {value}, figures.json has it at {expected}"


def test_every_missed_target_is_listed_under_targets_not_met():
    text = (ROOT / "docs" / "results.md").read_text()
    section = text.split("## Targets not met", 1)[1].split("\n## ", 1)[0]
    listed = {key for key, _ in headline.marked_figures(section)}
    missed = {key for key, figure in FIGURES.items() if figure["met"] is False}
    assert missed <= listed, f"missed targets not under Targets not met: {sorted(missed - listed)}"


def test_baselines_that_lose_by_construction_say_so_beside_their_figures():
    for key in (key for key, figure in FIGURES.items() if figure.get("by_construction")):
        for page in (ROOT / "docs" / "results.md", ROOT / "docs" / "benchmarks.md"):
            lines = [line for line in page.read_text().splitlines() if f"<!--fig:{key}-->" in line]
            assert lines, f"{page.name} quotes no {key} outside the headline table"
            context = page.read_text()
            for line in lines:
                at = context.index(line)
                assert "by construction" in context[at - 200 : at + len(line) + 300], (
                    f"{page.name}: {key} is quoted without saying its baseline loses by construction"
                )


def test_a_figure_quoted_differently_is_caught():
    figure = next(iter(FIGURES.values()))
    assert headline.marked_figures(f"x <!--fig:{figure['key']}-->**9{figure['value']}** y") == [
        (figure["key"], "9" + figure["value"])
    ]
