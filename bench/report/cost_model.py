"""The planner's cost model against measured steps: runs of one setting in different memory options or layouts,
side by side, each with its measured step and the step the cost model estimates for the same options.

"auto" takes the configuration the cost model (:mod:`lightning_fpdt.planner.cost`) ranks fastest among those that
fit. A setting counts when at least two ``--ballast full`` runs share card, GPU count, model, depth, length, system and
commit and differ in their options. The estimate is the full depth's: the planner is asked again for the options the
record's ``full_depth`` says the run stood for, and :func:`lightning_fpdt.planner.step_seconds` times it; the
measured step is set beside it as the full depth's (the run's step times the planner's own ratio of the two depths,
as the host table does), so that the two columns compare like with like.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterator, Optional

from bench.report.markdown import NONE, Record, Section, length, number, percent
from bench.report.records import card_name, of_kind, timed
from bench.report.training import layout


def estimated_step_s(record: Record) -> Optional[float]:
    """The cost model's step of the full depth under the options the run stood for; ``None`` where the record
    carries no full-depth options (runs without ``--ballast full``, older records)."""
    full = record.get("full_depth") or {}
    options, geometry = full.get("options"), record.get("geometry")
    if not options or not geometry or "FPDTStrategy" not in options:
        return None
    import dataclasses  # the planner is imported only where a table needs it

    from lightning_fpdt.flops import ModelGeometry
    from lightning_fpdt.planner import plan_memory, step_seconds
    from lightning_fpdt.planner.phases import plan_sizes
    from lightning_fpdt.planner.request import FEATURE_FIELDS, PlanRequest

    planned = {field.name for field in dataclasses.fields(PlanRequest)} | FEATURE_FIELDS
    chosen = {name: value for name, value in {**options["FPDTStrategy"], **options.get("ActivationOffload", {})}.items()
              if name in planned}  # the disk tier's directory, say, is no planner option
    plan = plan_memory(geometry=ModelGeometry(**geometry), seq_len=record["seq_len"], num_gpus=record["gpus"],
                       gpus_per_node=record.get("gpus_per_node") or record["gpus"], activation_offload=True,
                       tiled_mlp=True, tiled_loss=True,
                       precision=(record.get("options") or {}).get("precision", "bf16-mixed"), **chosen)
    return step_seconds(plan_sizes(plan))


def measured_full_depth_s(record: Record) -> Optional[float]:
    """The run's step as the full depth's: the measured step times the planner's ratio of the full depth's estimate
    to the layers run's (``full_depth.step_time_s``); the measured step itself at full depth."""
    full = record.get("full_depth") or {}
    return full.get("step_time_s") or (record.get("step_time_s") if record.get("layers") == record.get("full_layers")
                                       else None)


def options_cell(record: Record) -> str:
    """What tells the runs of a setting apart: ``"chunks 2, offload off, 27 of 28 blocks checkpointed"`` (the full
    depth's), then the layout where it is not the default (``"; ring 2 × Ulysses 2"``)."""
    full = record.get("full_depth") or {}
    strategy = (full.get("options") or {}).get("FPDTStrategy", {})
    blocks = f", {full['checkpoint_blocks']} of {record['full_layers']} blocks checkpointed" \
        if full.get("checkpoint_blocks") is not None and record.get("full_layers") else ""
    offload = "on" if strategy.get("offload") else "off"
    return f"chunks {strategy.get('chunks')}, offload {offload}{blocks}{layout(record)}"


def neighbour_groups(records: list[Record]) -> list[list[Record]]:
    """Runs of one setting (card, GPUs, model, depth, length, system, commit) with an estimate, two or more options
    apart; each group fastest measured first."""
    groups: dict[tuple, dict[str, Record]] = defaultdict(dict)
    for r in of_kind(records, "run"):
        if r.get("status") != "ok" or not timed(r) or not r.get("step_time_s") or not r.get("plan_options"):
            continue
        key = (card_name(r), r["gpus"], r["model"], r["layers"], r["seq_len"], r["system"], r["commit"])
        groups[key][r["plan_options"]] = r  # the last run of the same options stands
    chosen = []
    for runs in groups.values():
        with_estimate = [(r, estimated_step_s(r)) for r in runs.values()]
        with_estimate = [(r, e) for r, e in with_estimate if e is not None]
        if len(with_estimate) >= 2:
            chosen.append(sorted(with_estimate, key=lambda pair: pair[0]["step_time_s"]))
    return chosen


def _rows(records: list[Record]) -> Iterator[tuple[Record, list[str]]]:
    for group in neighbour_groups(records):
        fastest_measured = group[0][0]["step_time_s"]
        fastest_estimate = min(e for _, e in group)
        for r, estimate in group:
            full = measured_full_depth_s(r)
            auto = "yes" if (r.get("options") or {}).get("auto_options") else ""
            yield r, [card_name(r), str(r["gpus"]), r["model"], length(r["seq_len"]), r["system"],
                      options_cell(r), auto,
                      number(r["step_time_s"], 3), f"{100 * (r['step_time_s'] / fastest_measured - 1):+.1f}%",
                      number(full, 2), number(estimate, 2), f"{100 * (estimate / fastest_estimate - 1):+.1f}%",
                      NONE if not full else percent(estimate / full - 1)]


COST_MODEL = Section(
    title="### The cost model against measured neighbours",
    intro="Runs of one setting (card, GPUs, model, depth, length, system, commit) in different memory options or "
          "layouts, fastest measured first. \"auto\": the options were the planner's choice (`--auto-options`). "
          "\"vs fastest\": the step against the setting's fastest measured step; \"estimate\": the cost model's step "
          "of the full depth under the same options, and \"vs fastest estimate\" the same comparison by the "
          "estimate, which is what \"auto\" ranks by; \"full depth s\": the measured step as the full depth's (the "
          "planner's ratio of the two depths); \"estimate error\": the estimate against it. These estimates use the "
          "built-in table's rates, an H100's (`lightning_fpdt/planner/rates.py`): they rank; \"Auto against its "
          "neighbours\" below sets measured steps beside the estimates of the GPU's own calibration.",
    columns=("card", "GPUs", "model", "S", "system", "options", "auto", "step s", "vs fastest", "full depth s",
             "estimate s", "vs fastest estimate", "estimate error"),
    rows=_rows, empty="No setting was run in two configurations.",
)
