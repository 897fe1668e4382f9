"""The table "auto against its neighbours": the cells of each ``python3 -m bench.neighbours`` grid
(bench/neighbours.py), the planner's choice and the configurations one option away from it, each with its measured
step, its MFU, the planner's estimate of its own step, and its step against the grid's fastest."""

from __future__ import annotations

from collections import defaultdict
from typing import Iterator, Optional

from bench.report.markdown import NONE, Record, Section, length, number, percent
from bench.report.records import card_name, model_name, of_kind, timed


def full_depth_step(record: Record) -> Optional[float]:
    """The cell's step as the full depth's: measured, times the planner's ratio of the depths where it ran fewer
    layers with the full-depth ballast (``full_depth.step_time_s``)."""
    return (record.get("full_depth") or {}).get("step_time_s") or record.get("step_time_s")


def grids(records: list[Record]) -> list[list[Record]]:
    """The cells of each grid that ran and timed a step, ``"auto"`` first, then fastest first; the last record of a
    cell name stands."""
    found: dict[tuple, dict[str, Record]] = defaultdict(dict)
    for r in of_kind(records, "run"):
        grid = r.get("neighbours")
        if not grid or r.get("status") != "ok" or not timed(r) or not r.get("step_time_s"):
            continue
        found[(grid["grid"], card_name(r), r["gpus"], r["model"], r["seq_len"], r.get("commit"))][grid["cell"]] = r
    return [sorted(cells.values(), key=lambda r: (r["neighbours"]["cell"] != "auto", full_depth_step(r)))
            for cells in found.values()]


def _rows(records: list[Record]) -> Iterator[tuple[Record, list[str]]]:
    for cells in grids(records):
        fastest = min(full_depth_step(r) for r in cells)
        for r in cells:
            step, estimate = r["step_time_s"], r.get("estimated_step_s")
            full = full_depth_step(r)
            yield r, [card_name(r), str(r["gpus"]), model_name(r), length(r["seq_len"]), r["neighbours"]["cell"],
                      r.get("plan_options") or NONE, number(step, 3),
                      NONE if r.get("mfu") is None else percent(r["mfu"]),
                      number(estimate, 3), NONE if not estimate else f"{estimate / step:.2f}",
                      number(full, 2), f"{full / fastest:.3f}"]


NEIGHBOURS = Section(
    title="### Auto against its neighbours",
    intro="`python3 -m bench.neighbours` (bench/neighbours.py): for one geometry and length, the configuration the "
          "planner chose (\"auto\") and each configuration one option away from it that fits, trained side by side "
          "on one machine, each with the same full-depth ballast. \"step s\": the measured step of the layers run; "
          "\"estimate s\": the planner's step-time model for the same run (the rates of the GPU's calibration where "
          "the record says so, `estimate_rates`); \"est/meas\": the two against each other; \"full depth s\": the "
          "step as the full depth's (measured, times the planner's ratio of the depths); \"vs fastest\": that step "
          "against the grid's fastest. \"auto\" at 1.000 is the planner's choice being the fastest measured.",
    columns=("card", "GPUs", "model", "S", "setting", "options", "step s", "MFU", "estimate s", "est/meas",
             "full depth s", "vs fastest"),
    rows=_rows, empty="No neighbour grid was run.",
)
