"""Numbers as the page shows them, Markdown tables, and the numbered commands every figure cites."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Optional

from bench.report.records import GIB

NONE = "–"


def length(value: Optional[int]) -> str:
    return NONE if value is None else f"{value:,}"


def gib(value: Optional[float], digits: int = 1) -> str:
    """Bytes in GiB, one decimal (or ``digits``)."""
    return NONE if value is None else f"{value / GIB:.{digits}f}"


def number(value: Optional[float], digits: int = 1) -> str:
    return NONE if value is None else f"{value:,.{digits}f}"


def percent(value: Optional[float]) -> str:
    return NONE if value is None else f"{100 * value:.1f}%"


def ratio(a: Optional[float], b: Optional[float]) -> str:
    return NONE if not a or not b else f"{a / b:.2f}×"


def percent_change(value: float, base: float, digits: int = 0) -> str:
    """``value`` against ``base`` as a signed change: ``"+3%"``, ``"-12.5%"`` (``digits`` decimals)."""
    return f"{100 * (value / base - 1):+.{digits}f}%"


def plan_ratio(planned: Optional[float], measured: Optional[float]) -> str:
    """A planned figure over the measured one, three decimals (above 1: the plan is the larger)."""
    return NONE if not planned or not measured else f"{planned / measured:.3f}"


def host_cells(record: dict[str, Any], digits: int = 1) -> list[str]:
    """A run's measured host memory beside its GPU peak: the largest process's peak resident memory (RSS) within the
    timed steps and the pinned bytes at the end of its last step, in GiB; ``NONE`` where the record has no such
    figure (records from before these readings, a strategy that cannot count its pinned buffers)."""
    return [gib(record.get("peak_host_rss_bytes"), digits), gib(record.get("pinned_host_bytes"), digits)]


HOST_COLUMNS = ("host peak GiB", "pinned GiB")
"""The columns of :func:`host_cells`."""
HOST_NOTE = ("\"host peak GiB\" is the peak resident memory (RSS: pinned and pageable pages) of a training process "
             "within the timed steps, the largest over the ranks; \"pinned GiB\" the page-locked host bytes a process "
             "held at the end of its last step (the fpdt strategy's own buffers and PyTorch's caching host "
             "allocator's blocks); – where the record has none (records from before these readings).")
"""What the page says of :data:`HOST_COLUMNS`."""


def table(header: list[str], rows: list[list[str]], empty: str) -> list[str]:
    """A Markdown table, or the sentence ``empty`` when there are no rows."""
    if not rows:
        return [empty]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def commits(records: Iterable[Optional[dict[str, Any]]]) -> str:
    """The commits of ``records``, each once, in order: a table's commit cell."""
    seen: list[str] = []
    for record in records:
        if record and record.get("commit") and record["commit"] not in seen:
            seen.append(record["commit"])
    return ", ".join(f"`{commit}`" for commit in seen) or NONE


class Commands:
    """Numbers the commands: a figure cites ``[n]``, and the list at the end gives each with the environment it ran in,
    the commit of the code that ran, and the raw logs or the source of a transcribed figure."""

    def __init__(self) -> None:
        self._numbers: dict[tuple[str, str], int] = {}
        self._notes: dict[tuple[str, str], str] = {}

    def ref(self, record: dict[str, Any]) -> str:
        env = " ".join(f"{name}={value}" for name, value in sorted((record.get("env") or {}).items()))
        key = (f"{env} {record['command']}".strip(), record["commit"])
        if key not in self._numbers:
            self._numbers[key] = len(self._numbers) + 1
            self._notes[key] = _note(record)
        return f"[{self._numbers[key]}]"

    def cells(self, record: dict[str, Any]) -> list[str]:
        """The two cells a row of one record ends with: its command and its commit."""
        return [self.ref(record), f"`{record['commit']}`"]

    def markdown(self) -> list[str]:
        return [f"{n}. `{line}` at commit `{commit}`{self._notes[(line, commit)]}"
                for (line, commit), n in self._numbers.items()]


def _note(record: dict[str, Any]) -> str:
    logs = record.get("logs") or []
    parts = [f"raw log{'s' if len(logs) > 1 else ''}: {', '.join(logs)}"] if logs else []
    if record.get("source"):
        parts.append(record["source"])
    return f"; {'; '.join(parts)}" if parts else ""


Record = dict[str, Any]
Rows = Callable[[list[Record]], Iterable[tuple[Record, list[str]]]]


@dataclasses.dataclass(frozen=True)
class Section:
    """A titled table of one record per row: ``rows(records)`` gives each row's record and cells, and every row ends
    with that record's command and commit."""

    title: str
    intro: str
    columns: tuple[str, ...]
    rows: Rows
    empty: str

    def render(self, records: list[Record], commands: Commands) -> list[str]:
        cells = [[*row, *commands.cells(record)] for record, row in self.rows(records)]
        return [self.title, "", self.intro, "", *table([*self.columns, "cmd", "commit"], cells, self.empty)]
