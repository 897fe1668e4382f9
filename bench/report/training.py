"""The tables of the training runs (``bench.peers`` and the example configs): peak memory at two depths, throughput
and MFU at equal length, where a profiled step spends its time, the host memory of the full depth, every run."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from bench.report.markdown import Commands, gib, length, number, percent, ratio, table
from bench.report.records import card_name, latest, model_name, of_kind, timed

SYSTEMS = ("fpdt", "modelparallel", "ring")
PROFILE_CATEGORIES = ("attention", "matmul", "other", "communication", "copy host->device", "copy device->host")


def depth_section(records: list[dict[str, Any]], commands: Commands) -> list[str]:
    lines = ["### Peak GPU memory at two depths (ballast protocol)", "",
             "Runs of the same system, card, GPU count and length at different depths, each with the ballast of the "
             "layers it does not run: equal peaks mean the few-layer runs stand for the full model.", ""]
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    ran = [r for r in of_kind(records, "run") if r.get("status") == "ok" and r.get("peak_gpu_bytes") is not None]
    for record in latest(ran, key=lambda r: (r["system"], card_name(r), r["gpus"], r["model"], r["seq_len"],
                                             r["layers"])):
        groups[(record["system"], card_name(record), record["gpus"], record["model"], record["seq_len"])].append(record)
    rows = []
    for (system, card, gpus, _model, seq_len), group in groups.items():
        if len({r["layers"] for r in group}) < 2:
            continue
        spread = max(r["peak_gpu_bytes"] for r in group) - min(r["peak_gpu_bytes"] for r in group)
        for record in sorted(group, key=lambda r: r["layers"]):
            rows.append([system, card, str(gpus), model_name(record), length(seq_len), gib(record["ballast_bytes"]),
                         gib(record["peak_gpu_bytes"]), gib(record["peak_gpu_bytes_minus_ballast"]), gib(spread),
                         *commands.cells(record)])
    header = ["system", "card", "GPUs", "model", "S", "ballast GiB", "peak GiB", "peak − ballast GiB", "spread GiB",
              "cmd", "commit"]
    return lines + table(header, rows, "No length was run at two depths.")


def throughput_groups(records: list[dict[str, Any]]) -> dict[tuple, dict[str, dict[str, Any]]]:
    """``{(card, gpus, model, layers, seq_len): {system: latest ok run with a timed step}}``."""
    runs = latest([r for r in of_kind(records, "run") if r.get("status") == "ok" and timed(r)],
                  key=lambda r: (card_name(r), r["gpus"], r["model"], r["layers"], r["seq_len"], r["system"]))
    groups: dict[tuple, dict[str, dict[str, Any]]] = defaultdict(dict)
    for record in runs:
        groups[(card_name(record), record["gpus"], record["model"], record["layers"], record["seq_len"])][
            record["system"]] = record
    return dict(groups)


def throughput_section(records: list[dict[str, Any]], commands: Commands) -> list[str]:
    lines = ["### Throughput and MFU at equal length", "",
             "`× ring`: tokens/s against ring context parallelism on the same card, GPU count, depth and length. "
             "modelparallel's tokens/s counts every GPU's own sequence. Runs of one step (the searches) are left out: "
             "their only step includes the warm-up.", ""]
    rows = []
    for (card, gpus, _model, _layers, seq_len), systems in sorted(throughput_groups(records).items(),
                                                                  key=lambda kv: (kv[0][0], kv[0][1], kv[0][4])):
        ring = systems.get("ring")
        for system in SYSTEMS:
            record = systems.get(system)
            if record is None:
                continue
            against_ring = "–" if ring is None or system == "ring" else ratio(record.get("tokens_per_s"),
                                                                             ring.get("tokens_per_s"))
            rows.append([card, str(gpus), model_name(record), length(seq_len), system,
                         number(record.get("step_time_s"), 3), number(record.get("tokens_per_s"), 0),
                         number(record.get("tflops_per_gpu")), percent(record.get("mfu")),
                         gib(record.get("peak_gpu_bytes")), against_ring, *commands.cells(record)])
    header = ["card", "GPUs", "model", "S", "system", "step s", "tokens/s", "TFLOP/s per GPU", "MFU", "peak GiB",
              "× ring", "cmd", "commit"]
    return lines + table(header, rows, "No completed runs.")


def profile_section(records: list[dict[str, Any]], commands: Commands) -> list[str]:
    lines = ["### Where a profiled step spends its time", "",
             "Runs with `--profile-step N`: device seconds of that step per GPU by kernel kind "
             "(bench/step_profile.py), on rank 0. \"busy\": the attention, matmul and other kernels together over the "
             "wall time; copies and communication run on streams of their own and may overlap them. The profiled step "
             "is slower than the others (the profiler's own cost), so its wall time is not the step time.", ""]
    rows = []
    for record in [r for r in of_kind(records, "run") if r.get("profile")]:
        profile = record["profile"]
        device = profile.get("device_s") or {}
        rows.append([record["system"], card_name(record), str(record["gpus"]), model_name(record),
                     length(record["seq_len"]), str(record.get("chunks") or "–"), number(profile.get("wall_s"), 3),
                     *(number(device.get(name), 3) for name in PROFILE_CATEGORIES),
                     percent(profile.get("busy_fraction")), *commands.cells(record)])
    header = ["system", "card", "GPUs", "model", "S", "chunks", "wall s", *(f"{name} s" for name in PROFILE_CATEGORIES),
              "busy", "cmd", "commit"]
    return lines + table(header, rows, "No profiled steps.")


def host_section(records: list[dict[str, Any]], commands: Commands) -> list[str]:
    lines = ["### Host memory of the full depth", "",
             "`lightning_fpdt.planner.plan_memory` of the full depth (pinned host memory per host: offloaded attention "
             "chunks and block inputs, CPU-offloaded states), beside the memory the host had available when the run "
             "began; for fpdt also the planner's GPU peak of the full depth beside the measured one.", ""]
    rows = [[r["system"], card_name(r), str(r["gpus"]), model_name(r), length(r["seq_len"]),
             gib(r["host_check"]["needed_bytes"]), gib(r["host_check"]["available_bytes"]),
             {True: "yes", False: "**no**", None: "unknown"}[r["host_check"]["fits"]],
             gib(r["host_check"].get("planned_peak_gpu_bytes")), gib(r.get("peak_gpu_bytes")), *commands.cells(r)]
            for r in of_kind(records, "run") if r.get("host_check")]
    header = ["system", "card", "GPUs", "model", "S", "needed GiB", "available GiB", "fits", "planned GPU peak GiB",
              "measured peak GiB", "cmd", "commit"]
    return lines + table(header, rows, "No host checks.")


def _step_time(record: dict[str, Any]) -> str:
    shown = number(record.get("step_time_s"), 3)
    return shown if timed(record) or record.get("step_time_s") is None else f"{shown} (warm-up)"


def runs_section(records: list[dict[str, Any]], commands: Commands) -> list[str]:
    lines = ["### Every run", ""]
    rows = [[str(i), r["system"], r.get("status", "?") + (f" ({r['limit']})" if r.get("limit") else ""),
             card_name(r), str(r.get("gpus")), model_name(r), length(r.get("seq_len")), str(r.get("chunks") or "–"),
             _step_time(r), number(r.get("tokens_per_s"), 0), number(r.get("tflops_per_gpu")), percent(r.get("mfu")),
             gib(r.get("peak_gpu_bytes")), gib(r.get("ballast_bytes")), number(r.get("first_loss"), 4),
             *commands.cells(r)]
            for i, r in enumerate(of_kind(records, "run"), 1)]
    header = ["#", "system", "status", "card", "GPUs", "model", "S", "chunks", "step s", "tokens/s", "TFLOP/s per GPU",
              "MFU", "peak GiB", "ballast GiB", "first loss", "cmd", "commit"]
    return lines + table(header, rows, "No runs.")
