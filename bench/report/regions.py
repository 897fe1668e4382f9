"""Figures of other pages generated from the records, as docs/benchmarks.md is: each marked region
``<!-- results:NAME -->`` … ``<!-- /results -->`` of :data:`PAGES` is rewritten from the records by :data:`REGIONS`
(``python3 -m bench.report`` fills them beside the page; ``tests/unit/test_results_regions.py`` checks that the
checked-in pages equal what it would write, so their figures cannot drift from the records). Prose that states a
figure cites docs/benchmarks.md instead."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from bench.report.markdown import length, number, table
from bench.report.records import of_kind

PAGES = ("README.md", "docs/planner.md", "docs/head_chunks.md")
"""The pages, relative to the repository root, whose figures come from the records."""

REGION = re.compile(r"(<!-- results:(?P<name>[a-z_]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.DOTALL)


def _percent_change(value: float, base: float) -> str:
    return f"{100 * (value / base - 1):+.0f}%"


def head_chunks(records: list[dict[str, Any]]) -> list[str]:
    """The head-group table of docs/head_chunks.md: peak and step time of each case at ``G = 1`` and the largest
    ``G`` measured, from the latest head-chunking record."""
    runs = of_kind(records, "head_chunks")
    if not runs:
        return ["No head-chunking records."]
    r = runs[-1]
    ok = [row for row in r["rows"] if row["status"] == "ok"]
    groups = max(row["head_chunks"] for row in ok)
    rows = []
    for case in dict.fromkeys(row["case"] for row in ok):
        base = next(row for row in ok if row["case"] == case and row["head_chunks"] == 1)
        top = next(row for row in ok if row["case"] == case and row["head_chunks"] == groups)
        rows.append([case, number(base["peak_gib"], 2),
                     f"{number(top['peak_gib'], 2)} ({_percent_change(top['peak_gib'], base['peak_gib'])})",
                     _percent_change(top["step_s"], base["step_s"])])
    intro = (f"Measured on one {r['card']} ({r['gpus']} GPU), {r['geometry']}, {length(r['seq_len'])} tokens, chunks "
             f"{r['chunks']}, attention offload {r['offload']}, forward + backward (`bench/head_chunks.py`, commit "
             f"`{r['commit']}`; every G in [benchmarks.md](benchmarks.md#head-group-chunking)):")
    header = ["case", "peak GiB, `G = 1`", f"peak GiB, `G = {groups}`", f"time at `G = {groups}`"]
    return [intro, "", *table(header, rows, "No head-chunking records.")]


REGIONS: dict[str, Callable[[list[dict[str, Any]]], list[str]]] = {"head_chunks": head_chunks}
"""Each region's renderer: the records in, the region's lines out."""


def fill(text: str, records: list[dict[str, Any]]) -> str:
    """``text`` with every marked region rewritten from ``records``; ``ValueError`` for a region no renderer knows."""
    def rendered(match: re.Match) -> str:
        name = match["name"]
        if name not in REGIONS:
            raise ValueError(f"unknown results region {name!r}: bench/report/regions.py renders {sorted(REGIONS)}")
        return match.group(1) + "\n".join(REGIONS[name](records)) + "\n" + match.group(4)
    return REGION.sub(rendered, text)


def fill_pages(root: Path, records: list[dict[str, Any]]) -> list[str]:
    """Rewrite the regions of :data:`PAGES` under ``root``; the pages that changed."""
    changed = []
    for page in PAGES:
        path = root / page
        text = path.read_text()
        filled = fill(text, records)
        if filled != text:
            path.write_text(filled)
            changed.append(page)
    return changed
