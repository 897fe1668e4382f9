"""The figures of README.md, docs/planner.md and docs/head_chunks.md in results regions are what bench.report
generates from bench/results/*.jsonl, so they cannot drift from the records (no matplotlib needed)."""

from __future__ import annotations

import glob
from pathlib import Path

import pytest

from bench.report import regions
from bench.report.records import load_records

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("page", regions.PAGES)
def test_checked_in_regions_equal_the_generated_ones(page):
    """Each results region of the page equals what ``python3 -m bench.report`` writes from the stored records."""
    records = load_records(sorted(glob.glob(str(ROOT / "bench" / "results" / "*.jsonl"))))
    text = (ROOT / page).read_text()
    assert regions.fill(text, records) == text, (
        f"{page}: a results region differs from the records; regenerate with "
        f"python3 -m bench.report bench/results/*.jsonl --doc docs/benchmarks.md --plots docs/plots")


def test_every_region_is_generated_somewhere():
    """Every renderer has a region on some page, and an unknown region name is refused by name."""
    used = {match["name"] for page in regions.PAGES for match in regions.REGION.finditer((ROOT / page).read_text())}
    assert used == set(regions.REGIONS)
    with pytest.raises(ValueError, match="unknown results region 'nothing'"):
        regions.fill("<!-- results:nothing -->\n<!-- /results -->", [])
