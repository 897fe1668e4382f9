"""PNG plots of the training runs: peak GPU memory and MFU against the sequence length, one line per system, fpdt
variant and depth, one pair per card, GPU count and model. matplotlib is not a dependency of the project: without it
the plots are skipped with a message and the page says so."""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections import defaultdict
from typing import Any, Callable, Optional

from bench.report.records import GIB, card_name, latest, model_name, of_kind, timed, variant

Record = dict[str, Any]


@dataclasses.dataclass
class Plot:
    """One PNG and the records its points come from (the page cites their commands and commits under it)."""

    path: str
    title: str
    records: list[Record]


def tokens_label(value: float) -> str:
    """256K, 1M, 1.5M: the axis labels of sequence lengths."""
    if value >= 2**20:
        return f"{value / 2**20:g}M"
    return f"{value / 2**10:g}K" if value >= 2**10 else f"{value:g}"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _memory_gib(record: Record) -> Optional[float]:
    return record.get("peak_gpu_bytes") and record["peak_gpu_bytes"] / GIB


def _mfu_percent(record: Record) -> Optional[float]:
    return record.get("mfu") and timed(record) and 100 * record["mfu"] or None


METRICS: tuple[tuple[str, str, Callable[[Record], Optional[float]]], ...] = (
    ("memory", "peak GPU memory (GiB)", _memory_gib),
    ("mfu", "MFU, causal (%)", _mfu_percent),
)


Line = list[tuple[int, float, Record]]


def _lines(group: list[Record], value: Callable[[Record], Optional[float]]) -> dict[str, Line]:
    """``{label: [(S, y, record), ...]}``: one line per system, fpdt variant and depth."""
    lines: dict[str, Line] = defaultdict(list)
    for record in group:
        y = value(record)
        if y is not None:
            depth = model_name(record).split("(", 1)[1].rstrip(")")
            name = ", ".join(filter(None, (record["system"], variant(record))))
            lines[f"{name} ({depth})"].append((record["seq_len"], y, record))
    return lines


def _draw(plt: Any, ticker: Any, lines: dict[str, Line], *, metric: str, ylabel: str,
          title: str, group: list[Record], path: str) -> None:
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for label, points in sorted(lines.items()):
        points.sort(key=lambda point: point[0])
        axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    limit = group[0].get("gpu_memory_cap_bytes") or group[0].get("card_memory_bytes")
    if metric == "memory" and limit:
        axes.axhline(limit / GIB, color="grey", linestyle="--", linewidth=1,
                     label="memory cap" if group[0].get("gpu_memory_cap_bytes") else "card memory")
    axes.set_xscale("log", base=2)
    axes.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: tokens_label(x)))
    axes.set_ylim(bottom=0)
    axes.set_xlabel("sequence length (tokens)")
    axes.set_ylabel(ylabel)
    axes.set_title(title, fontsize=10)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _groups(records: list[Record]) -> dict[tuple[str, int, str], list[Record]]:
    runs = latest([r for r in of_kind(records, "run") if r.get("status") == "ok"],
                  key=lambda r: (card_name(r), r["gpus"], r["model"], r["system"], variant(r), r["layers"],
                                 r["seq_len"]))
    groups: dict[tuple[str, int, str], list[Record]] = defaultdict(list)
    for record in runs:
        groups[(card_name(record), record["gpus"], record["model"])].append(record)
    return groups


def write_plots(records: list[Record], folder: str) -> Optional[list[Plot]]:
    """The plots of ``records`` in ``folder``; ``None`` (and a message) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker as ticker
    except ImportError:
        print("bench.report: matplotlib is not installed, plots skipped (pip install matplotlib to draw them; the "
              "tables are written all the same)", file=sys.stderr)
        return None
    os.makedirs(folder, exist_ok=True)
    written = []
    for (card, gpus, model), group in sorted(_groups(records).items()):
        for metric, ylabel, value in METRICS:
            lines = _lines(group, value)
            if not lines:
                continue
            title = f"{card}, {gpus} GPU{'s' if gpus > 1 else ''}, {model}"
            path = os.path.join(folder, f"peers_{metric}_{slug(card)}_{gpus}gpu_{slug(model)}.png")
            _draw(plt, ticker, lines, metric=metric, ylabel=ylabel, title=title, group=group, path=path)
            points = [point[2] for line in lines.values() for point in line]
            written.append(Plot(path=path, title=f"{ylabel}: {title}", records=points))
    return written
