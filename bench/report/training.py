"""The tables of the training runs (``bench.peers`` and the example configs): peak memory at two depths, throughput
and MFU at equal length, where a profiled step spends its time, the host memory of the full depth, every run."""

from __future__ import annotations

from collections import defaultdict
from typing import Iterator, Optional

from bench.report.markdown import (
    HOST_COLUMNS,
    NONE,
    Record,
    Section,
    gib,
    host_cells,
    length,
    number,
    percent,
    percent_change,
    plan_ratio,
    ratio,
)
from bench.report.records import (
    ballast_kind,
    by_commit_age,
    card_name,
    latest,
    model_name,
    of_kind,
    stands_for_full_depth,
    timed,
)
from bench.report.speed_of_light import (
    LIGHT_COLUMNS,
    LIGHT_NOTE,
    PROFILE_COLUMNS,
    PROFILE_NOTE,
    light_cells,
    profile_cells,
)

SYSTEMS = ("fpdt", "fpdt-hf", "modelparallel", "ring", "alst")
"""The training systems of bench.peers, in the order the tables show them."""
PEERS = ("ring", "alst")
"""The systems every other one's tokens/s is set against in the throughput table."""
PROFILE_CATEGORIES = ("attention", "matmul", "other", "communication", "copy host->device", "copy device->host")
Row = tuple[Record, list[str]]


def _depth_rows(records: list[Record]) -> Iterator[Row]:
    groups: dict[tuple, list[Record]] = defaultdict(list)
    ran = [r for r in of_kind(records, "run") if r.get("status") == "ok" and r.get("peak_gpu_bytes") is not None
           and stands_for_full_depth(r)]
    for record in latest(ran, key=lambda r: (r["system"], card_name(r), r["gpus"], r["model"], r["seq_len"],
                                             r["layers"])):
        groups[(record["system"], card_name(record), record["gpus"], record["model"], record["seq_len"])].append(record)
    for (system, card, gpus, _model, seq_len), group in groups.items():
        if len({r["layers"] for r in group}) < 2:
            continue
        spread = max(r["peak_gpu_bytes"] for r in group) - min(r["peak_gpu_bytes"] for r in group)
        for r in sorted(group, key=lambda r: r["layers"]):
            yield r, [system, card, str(gpus), model_name(r), length(seq_len), gib(r["ballast_bytes"]),
                      gib(r["peak_gpu_bytes"]), gib(r["peak_gpu_bytes_minus_ballast"]), gib(spread), *host_cells(r)]


DEPTH = Section(
    title="### Peak GPU memory at two depths (ballast protocol)",
    intro="Runs of the same system, card, GPU count and length at different depths, each with the ballast of the "
          "layers it does not run: equal peaks mean the few-layer runs stand for the full model (the host's memory "
          "is that of the layers run: the ballast stands for GPU memory only).",
    columns=("system", "card", "GPUs", "model", "S", "ballast GiB", "peak GiB", "peak − ballast GiB", "spread GiB",
             *HOST_COLUMNS),
    rows=_depth_rows, empty="No length was run at two depths.",
)


def placement(record: Record) -> str:
    """Where the run kept the parameters' states: ``"GPU"``, or ``"host"`` with ``--cpu-offload-params``, where
    fpdt's record says when the host stepped: ``"host, step in backward"`` or ``"host, step after backward"`` (on the
    GPU only the latter is named: ``"GPU, step after backward"``); with
    partial residency, how many block inputs it kept (``"GPU, 7 block inputs kept"``); and the sequence layout where
    it is not the default (:func:`layout`)."""
    options = record.get("options") or {}
    kept = options.get("keep_inputs")
    inputs = f", {kept} block inputs kept" if isinstance(kept, int) or str(kept).isdigit() else ""
    inputs += layout(record)
    if not options.get("cpu_offload_params"):
        return ("GPU, step after backward" if options.get("device_step") else "GPU") + inputs
    return (f"host, step {options['host_step']}" if options.get("host_step") else "host") + inputs


def layout(record: Record) -> str:
    """The sequence layout where it is not one sequence over every GPU with Ulysses alone: ``"; sp 2 × dp 2"`` (two
    sequences a step, each over 2 GPUs) or ``"; ring 2 × Ulysses 2"``; ``""`` otherwise."""
    sp, dp = record.get("sequence_parallel_size"), record.get("data_parallel_size")
    ring = (record.get("options") or {}).get("ring_size")
    parts = [f"sp {sp} × dp {dp}"] if isinstance(dp, int) and dp > 1 else []
    if isinstance(ring, int) and ring > 1:
        parts.append(f"ring {ring} × Ulysses {sp // ring}")
    return "".join(f"; {part}" for part in parts)


def throughput_groups(records: list[Record]) -> dict[tuple, dict[str, Record]]:
    """``{(card, gpus, model, layers, seq_len, placement): {system: latest ok run with a timed step}}``."""
    runs = latest([r for r in of_kind(records, "run") if r.get("status") == "ok" and timed(r)],
                  key=lambda r: (card_name(r), r["gpus"], r["model"], r["layers"], r["seq_len"], placement(r),
                                 r["system"]))
    groups: dict[tuple, dict[str, Record]] = defaultdict(dict)
    for record in runs:
        groups[(card_name(record), record["gpus"], record["model"], record["layers"], record["seq_len"],
                placement(record))][record["system"]] = record
    return dict(groups)


def _peer_key(record: Record) -> tuple:
    """What a peer must share with a run to be compared with it: card, GPU count, model, depth, length, and whether
    the states lived on the host (when the host stepped is fpdt's own choice, not another placement)."""
    host = bool((record.get("options") or {}).get("cpu_offload_params"))
    return card_name(record), record["gpus"], record["model"], record["layers"], record["seq_len"], host


def _throughput_rows(records: list[Record]) -> Iterator[Row]:
    groups = throughput_groups(records)
    peers: dict[tuple, dict[str, Record]] = defaultdict(dict)
    for systems in groups.values():
        for system in PEERS:
            if system in systems:
                peers[_peer_key(systems[system])][system] = systems[system]
    for (card, gpus, _model, _layers, seq_len, states), systems in sorted(
            groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][4], kv[0][5])):
        for system in [s for s in SYSTEMS if s in systems]:
            r = systems[system]
            alike = peers.get(_peer_key(r), {})
            against = [NONE if peer not in alike or system == peer else
                       ratio(r.get("tokens_per_s"), alike[peer].get("tokens_per_s")) for peer in PEERS]
            yield r, [card, str(gpus), model_name(r), length(seq_len), system, states,
                      number(r.get("step_time_s"), 3),
                      number(r.get("tokens_per_s"), 0), number(r.get("tflops_per_gpu")), percent(r.get("mfu")),
                      *light_cells(r, records), gib(r.get("peak_gpu_bytes")), *host_cells(r), *against]


THROUGHPUT = Section(
    title="### Throughput and MFU at equal length",
    intro="\"states\": where the parameters, gradients and optimizer states live (\"host\": `--cpu-offload-params`, "
          "the optimizer step on the CPU, during the backward or after it where the record says). "
          "`× ring`, `× alst`: tokens/s against ring context parallelism and DeepSpeed's ALST on the same card, GPU "
          "count, depth and length, with the states in the same place (GPU or host). "
          "modelparallel's tokens/s counts every GPU's own sequence. Runs of one step (the searches) are left out: "
          "their only step includes the warm-up.\n\n" + LIGHT_NOTE,
    columns=("card", "GPUs", "model", "S", "system", "states", "step s", "tokens/s", "TFLOP/s per GPU", "MFU",
             *LIGHT_COLUMNS, "peak GiB", *HOST_COLUMNS, *(f"× {peer}" for peer in PEERS)),
    rows=_throughput_rows, empty="No completed runs.",
)


def _change_rows(records: list[Record]) -> Iterator[Row]:
    """Per system and setting (card, GPUs, model, depth, length, states) measured at more than one commit on one day
    (side by side): each commit's latest timed run, oldest commit first, against the oldest."""
    runs = [r for r in of_kind(records, "run") if r.get("status") == "ok" and timed(r) and not r.get("profile")]
    by_setting: dict[tuple, dict[str, Record]] = defaultdict(dict)
    for r in runs:
        setting = (card_name(r), r["gpus"], r["model"], r["layers"], r["seq_len"], placement(r), r["system"],
                   (r.get("time") or "")[:10])
        by_setting[setting][r["commit"]] = r
    for (card, gpus, _model, _layers, seq_len, states, system, _day), commits in sorted(
            by_setting.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][6], kv[0][4])):
        if len(commits) < 2:
            continue
        ordered = sorted(commits.values(), key=by_commit_age)
        base = ordered[0]
        for r in ordered:
            yield r, [card, str(gpus), model_name(r), length(seq_len), system, states,
                      number(r.get("step_time_s"), 3), percent(r.get("mfu")),
                      ratio(base.get("step_time_s"), r.get("step_time_s"))]


CHANGES = Section(
    title="### The same run at several commits",
    intro="Each setting measured at more than one commit on the same day, on the same card, GPU count, model, depth, "
          "length and placement of the states (runs side by side): the step time at each commit, oldest first (a "
          "profiled step left out), and the speed-up over the oldest (its step time over this one's).",
    columns=("card", "GPUs", "model", "S", "system", "states", "step s", "MFU", "speed-up"),
    rows=_change_rows, empty="No setting was measured at two commits on one day.",
)


def _profile_rows(records: list[Record]) -> Iterator[Row]:
    for r in [r for r in of_kind(records, "run") if r.get("profile")]:
        profile = r["profile"]
        device = profile.get("device_s") or {}
        yield r, [r["system"], card_name(r), str(r["gpus"]), model_name(r), length(r["seq_len"]),
                  str(r.get("chunks") or NONE), number(profile.get("wall_s"), 3),
                  *(number(device.get(name), 3) for name in PROFILE_CATEGORIES), percent(profile.get("busy_fraction")),
                  *profile_cells(r, records)]


PROFILES = Section(
    title="### Where a profiled step spends its time",
    intro="Runs with `--profile-step N`: device seconds of that step per GPU by kernel kind (bench/step_profile.py), "
          "on rank 0. \"busy\": the attention, matmul and other kernels together over the wall time; copies and "
          "communication run on streams of their own and may overlap them. The profiled step is slower than the "
          "others (the profiler's own cost), so its wall time is not the step time. " + PROFILE_NOTE,
    columns=("system", "card", "GPUs", "model", "S", "chunks", "wall s", *(f"{name} s" for name in PROFILE_CATEGORIES),
             "busy", *PROFILE_COLUMNS),
    rows=_profile_rows, empty="No profiled steps.",
)


def _host_rows(records: list[Record]) -> Iterator[Row]:
    for r in [r for r in of_kind(records, "run") if r.get("host_check")]:
        check = r["host_check"]
        yield r, [r["system"], card_name(r), str(r["gpus"]), model_name(r), length(r["seq_len"]),
                  gib(check["needed_bytes"]), gib(check["available_bytes"]),
                  {True: "yes", False: "**no**", None: "unknown"}[check["fits"]],
                  gib(check.get("planned_peak_gpu_bytes")), gib(r.get("peak_gpu_bytes")), *host_cells(r)]


HOST = Section(
    title="### Host memory of the full depth",
    intro="`lightning_fpdt.planner.plan_memory` of the full depth (pinned host memory per host: offloaded attention "
          "chunks and block inputs, CPU-offloaded states), beside the memory the host had available when the run "
          "began; for fpdt also the planner's GPU peak of the full depth beside the measured one, and the host "
          "memory measured in the layers run.",
    columns=("system", "card", "GPUs", "model", "S", "needed GiB", "available GiB", "fits", "planned GPU peak GiB",
             "measured peak GiB", *HOST_COLUMNS),
    rows=_host_rows, empty="No host checks.",
)


def _step_time(record: Record) -> str:
    shown = number(record.get("step_time_s"), 3)
    return shown if timed(record) or record.get("step_time_s") is None else f"{shown} (warm-up)"


def _run_rows(records: list[Record]) -> Iterator[Row]:
    for i, r in enumerate(of_kind(records, "run"), 1):
        status = r.get("status", "?") + (f" ({r['limit']})" if r.get("limit") else "")
        yield r, [str(i), r["system"], status, card_name(r), str(r.get("gpus")), model_name(r),
                  length(r.get("seq_len")), str(r.get("chunks") or NONE), _step_time(r),
                  number(r.get("tokens_per_s"), 0), number(r.get("tflops_per_gpu")), percent(r.get("mfu")),
                  gib(r.get("peak_gpu_bytes")), *host_cells(r), gib(r.get("ballast_bytes")),
                  number(r.get("first_loss"), 4)]


RUNS = Section(
    title="### Every run",
    intro="Every training run of the records; a run that ran out of memory says where (gpu or host).",
    columns=("#", "system", "status", "card", "GPUs", "model", "S", "chunks", "step s", "tokens/s", "TFLOP/s per GPU",
             "MFU", "peak GiB", *HOST_COLUMNS, "ballast GiB", "first loss"),
    rows=_run_rows, empty="No runs.",
)


def _plan_rows(records: list[Record]) -> Iterator[Row]:
    # a full-depth ballast's host memory is not in the plan of the layers run: those runs are FULL_DEPTH's
    for r in [r for r in of_kind(records, "run")
              if r.get("planned_peak_gpu_bytes") is not None and ballast_kind(r) != "full"]:
        measured_gpu = r.get("peak_gpu_bytes_minus_ballast")
        yield r, [r["system"], card_name(r), str(r["gpus"]), model_name(r), length(r["seq_len"]),
                  r.get("plan_options") or NONE,
                  gib(measured_gpu), gib(r["planned_peak_gpu_bytes"]),
                  plan_ratio(r["planned_peak_gpu_bytes"], measured_gpu),
                  gib(r.get("peak_host_rss_bytes")), gib(r.get("planned_resident_host_bytes")),
                  plan_ratio(r.get("planned_resident_host_bytes"), r.get("peak_host_rss_bytes")),
                  gib(r.get("pinned_host_bytes")), gib(r.get("planned_pinned_host_bytes")),
                  plan_ratio(r.get("planned_pinned_host_bytes"), r.get("pinned_host_bytes"))]


PLAN = Section(
    title="### The run's memory plan against its measurements",
    intro="fpdt runs whose record carries the plan the strategy accepted the run on (`FPDTStrategy.memory_plan`, "
          "for the layers run and the options it resolved), per GPU and its process, beside what the run measured. "
          "GPU: the peak of the step less the ballast (the plan does not know the ballast), the largest over the "
          "ranks; host: the largest process's peak resident memory within the timed steps against the plan's "
          "resident bytes (pinned, pageable and the process baseline); pinned: the page-locked bytes at the end of "
          "the last step against the plan's. \"plan / measured\" above 1: the plan is the larger.",
    columns=("system", "card", "GPUs", "model", "S", "plan options", "GPU GiB", "planned GPU GiB",
             "GPU plan / measured", "host peak GiB", "planned host GiB", "host plan / measured", "pinned GiB",
             "planned pinned GiB", "pinned plan / measured"),
    rows=_plan_rows, empty="No run carries its memory plan yet.",
)


def plan_inputs(record: Record) -> tuple[Optional[int], int]:
    """``(kept, on disk)``: the block inputs the run's plan keeps (``None``: every one) and puts in ``offload_dir``,
    read from the plan's options (``keep_inputs=K``, ``disk_inputs=D``); ``(None, 0)`` without them."""
    words = dict(w.split("=", 1) for w in (record.get("plan_options") or "").split() if "=" in w)
    kept = words.get("keep_inputs")
    return (int(kept) if kept and kept.isdigit() else None), int(words.get("disk_inputs", 0))


def inputs_placement(kept: Optional[int], disk: int, layers: int) -> str:
    """Where a plan's block inputs wait, in words: ``"28 in host memory"``, ``"20 in host memory, 8 on disk"``,
    ``"14 kept (14 regenerated): 14 in host memory"``."""
    held = layers if kept is None else kept
    where = f"{held - disk} in host memory" + (f", {disk} on disk" if disk else "")
    return where if kept is None else f"{kept} kept ({layers - kept} regenerated): {where}"


def _full_depth_rows(records: list[Record]) -> Iterator[Row]:
    for r in of_kind(records, "run"):
        full = r.get("full_depth")
        at_depth = r.get("layers") == r.get("full_layers") and r.get("planned_peak_gpu_bytes") is not None
        if r.get("status") != "ok" or not (full and full.get("planned_peak_gpu_bytes") or at_depth):
            continue
        if full:
            held = full["held"]
            pinned = None if r.get("pinned_host_bytes") is None else r["pinned_host_bytes"] + held["pinned_bytes"]
            planned = (full["planned_peak_gpu_bytes"], full["planned_resident_bytes"], full["planned_pinned_bytes"],
                       full.get("planned_disk_bytes"))
            inputs = f"{full['kept_inputs']} kept, {full['disk_inputs']} on disk"
            disk, step = held["disk_bytes"], f"{number(full.get('step_time_s'), 0)} (estimate)"
        else:
            pinned = r.get("pinned_host_bytes")
            planned = (r["planned_peak_gpu_bytes"], r.get("planned_resident_host_bytes"),
                       r.get("planned_pinned_host_bytes"), r.get("planned_disk_bytes"))
            inputs = inputs_placement(*plan_inputs(r), r["layers"])
            disk, step = r.get("peak_disk_bytes"), _step_time(r)
        yield r, [r["system"], card_name(r), str(r["gpus"]), model_name(r), length(r["seq_len"]), inputs,
                  gib(r.get("peak_gpu_bytes")), gib(planned[0]), plan_ratio(planned[0], r.get("peak_gpu_bytes")),
                  gib(r.get("peak_host_rss_bytes")), gib(planned[1]),
                  plan_ratio(planned[1], r.get("peak_host_rss_bytes")),
                  gib(pinned), gib(planned[2]), gib(disk), gib(planned[3]), step]


FULL_DEPTH = Section(
    title="### Full depth: GPU, host and disk against the plan",
    intro="fpdt runs that stand for the whole model on the machine they ran on, host memory and disk included: "
          "steps at full depth, and runs of a few layers with the full-depth ballast (`--ballast full`: the full "
          "depth planned there, its options trained, and what it keeps for the layers not run held on the GPU, in "
          "host memory and on disk). Measured peaks (ballast included) against the full depth's plan; pinned: the "
          "strategy's page-locked bytes and the ballast's. Full-depth step: measured at full depth; with the ballast "
          "the measured step times the planner's ratio of the two depths' step times (every layer's work and the "
          "regenerating forwards of the inputs the plan drops).",
    columns=("system", "card", "GPUs", "model", "S", "block inputs", "GPU GiB", "planned GPU GiB",
             "GPU plan / measured",
             "host peak GiB", "planned host GiB", "host plan / measured", "pinned GiB", "planned pinned GiB",
             "disk GiB", "planned disk GiB", "full-depth step s"),
    rows=_full_depth_rows, empty="No full-depth runs.",
)


def _placement_rows(records: list[Record]) -> Iterator[Row]:
    groups: dict[tuple, list[Record]] = defaultdict(list)
    for r in of_kind(records, "run"):
        if r.get("status") == "ok" and r.get("layers") == r.get("full_layers") and r.get("plan_options") \
                and r.get("step_time_s") is not None and not r.get("full_depth"):
            options = r.get("options") or {}
            groups[(r["system"], card_name(r), r["gpus"], r.get("gpu_memory_cap_bytes"), r["model"], r["seq_len"],
                    bool(options.get("cpu_offload_params")))].append(r)
    for (system, card, gpus, _cap, _model, seq_len, _states), group in groups.items():
        in_memory = [r for r in group if plan_inputs(r) == (None, 0) and not r.get("held_host_bytes")]
        if not in_memory or len(group) < 2:
            continue
        base = in_memory[-1]
        for r in [base, *(r for r in group if r is not base and r not in in_memory)]:
            yield r, [system, card, str(gpus), model_name(r), length(seq_len),
                      gib(r.get("held_host_bytes") or 0, 0), inputs_placement(*plan_inputs(r), r["layers"]),
                      gib(r.get("peak_disk_bytes")), number(r["step_time_s"], 1), number(base["step_time_s"], 1),
                      percent_change(r["step_time_s"], base["step_time_s"], 1)]


PLACEMENT = Section(
    title="### Where the block inputs wait: the step against all in host memory",
    intro="Full-depth fpdt steps of one length on one card, every option \"auto\": the run with every block input in "
          "host memory, and runs on a host made smaller by a held allocation (`--hold-host-gib`) where the plan "
          "puts some inputs on disk (`offload_dir`) or keeps only some and regenerates the others in the backward "
          "(partial residency). The step times are single steps (the first of the run) of the same code.",
    columns=("system", "card", "GPUs", "model", "S", "host held GiB", "block inputs", "disk GiB", "step s",
             "all in host memory s", "against all in host memory"),
    rows=_placement_rows, empty="No length was run with its block inputs in more than one place.",
)
