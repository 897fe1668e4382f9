"""docs/peers.md and its PNG plots from the JSON records of bench/peers.py (issue 8).

    python bench/report.py results/peers-1gpu.jsonl results/peers-4gpu.jsonl --doc docs/peers.md --plots docs/plots

Tables: the issue's targets against what was measured; the maximum trainable length per card and GPU count for each
system; peak GPU memory at two depths (the ballast protocol of DESIGN.md §8); throughput and MFU at equal length; the
full-depth host-memory check; every run. Each figure names its card, GPU count, geometry and length, and refers to the
numbered command that produced it (listed at the end with the environment it ran in). Plots: peak GPU memory and MFU
against the sequence length, one line per system (and depth), one pair per card, GPU count and model. Without
matplotlib the tables are still written and the plots skipped, with a message (it is not a dependency of the project).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings
from collections import defaultdict
from typing import Any, Iterable, Optional

GIB = 2**30
SYSTEMS = ("fpdt", "modelparallel", "ring")
SYSTEM_NAMES = {
    "fpdt": "fpdt (this project)",
    "modelparallel": "ModelParallelStrategy (FSDP2 + SDPA + checkpointing)",
    "ring": "ring context parallelism (torch)",
}
TARGET_1GPU = 1_048_576
TARGET_4GPU = 2_097_152
TARGET_VS_MODELPARALLEL = 16.0
TARGET_VS_RING_LENGTH = 2.0
TARGET_MFU = 0.50
TARGET_MFU_SEQ_LEN = 524_288
TARGET_VS_RING_THROUGHPUT = 1.3


# ---- reading -------------------------------------------------------------------------------------------------------
def load_records(paths: Iterable[str]) -> list[dict[str, Any]]:
    """Every record of the JSONL files in the order they were made (their ``time``; file order where equal or
    missing), so "the latest" is the latest run; a line that is not a JSON object is skipped with a warning."""
    records = []
    for path in paths:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    warnings.warn(f"{path}:{number}: not JSON ({error}); skipped")
                    continue
                if not isinstance(record, dict) or record.get("kind") not in ("run", "max_length"):
                    warnings.warn(f"{path}:{number}: not a bench/peers.py record; skipped")
                    continue
                records.append(record)
    records.sort(key=lambda record: str(record.get("time") or ""))
    return records


def fits(record: dict[str, Any]) -> bool:
    """A step ran, and where the host check was made the full depth's pinned host memory fits the host."""
    host = record.get("host_check") or {}
    return record.get("status") == "ok" and host.get("fits") is not False


def timed(record: dict[str, Any]) -> bool:
    """A step after the warm-up was timed (a run of ``--steps 1``, as in the searches, only shows memory)."""
    return record.get("timed_steps", 1) > 0


def stands_for_full_depth(record: dict[str, Any]) -> bool:
    """Run at full depth, or with the ballast of the layers not run."""
    return record.get("layers") == record.get("full_layers") or (record.get("options") or {}).get("ballast") == "auto"


def latest(records: Iterable[dict[str, Any]], key) -> list[dict[str, Any]]:
    """The last record of each ``key(record)``, in the order the keys first appear."""
    chosen: dict[Any, dict[str, Any]] = {}
    for record in records:
        chosen[key(record)] = record
    return list(chosen.values())


# ---- formatting ----------------------------------------------------------------------------------------------------
def length(value: Optional[int]) -> str:
    return "–" if value is None else f"{value:,}"


def gib(value: Optional[float]) -> str:
    return "–" if value is None else f"{value / GIB:.1f}"


def number(value: Optional[float], digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def percent(value: Optional[float]) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def ratio(a: Optional[float], b: Optional[float]) -> str:
    return "–" if not a or not b else f"{a / b:.2f}×"


def length_ratio(ours: Optional[dict[str, Any]], theirs: Optional[dict[str, Any]]) -> tuple[str, Optional[float], bool]:
    """``(shown, value, conclusive)`` of fpdt's maximum length over a peer's. A maximum without a failing length above
    it is only a lower bound: over a peer's lower bound the ratio says nothing; over an exact one it is a lower bound
    itself when fpdt's is (shown "≥")."""
    if not ours or not theirs or not ours["max"]:
        return "–", None, False
    if not theirs["max"]:
        return f"∞ ({theirs.get('system', 'peer')} fits no length tried)", None, theirs["exact"]
    value = ours["max"] / theirs["max"]
    if not theirs["exact"]:
        return f"? (no failing length for {theirs.get('system', 'the peer')})", value, False
    return f"{'' if ours['exact'] else '≥ '}{value:.2f}×", value, True


def gpu_limit(entry: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The GPU's own limit of a :func:`max_lengths` entry whose host binds below its GPU (the full depth's pinned
    memory does not fit the host at the length the GPU holds), as an entry of its own (``max``: the longest length a
    step ran at, ``exact``: a longer one failed); ``None`` where the host does not bind. Targets show it beside the
    host-bound figure: the GPU verdict holds on a host with more memory."""
    if not entry or entry.get("host_max") is None or not entry.get("gpu_max"):
        return None
    if entry["host_max"] >= entry["gpu_max"]:
        return None
    failed = entry.get("gpu_fail") if "gpu_fail" in entry else entry.get("fail")
    return {"max": entry["gpu_max"], "exact": failed is not None, "system": entry["system"]}


def both_ratios(ours: Optional[dict[str, Any]], theirs: Optional[dict[str, Any]]) -> str:
    """:func:`length_ratio` shown, and where fpdt's host binds, the ratio of the GPU limits beside it."""
    shown = length_ratio(ours, theirs)[0]
    gpu = gpu_limit(ours)
    if gpu is None or not theirs:
        return shown
    return f"{shown} (GPU memory: {length_ratio(gpu, theirs)[0]})"


def card_name(record: dict[str, Any]) -> str:
    """The card, and the memory cap a run had (``--gpu-memory-gib``): capped and uncapped runs of one card are grouped
    apart, since what fits differs."""
    card = record.get("card") or "?"
    cap = record.get("gpu_memory_cap_bytes")
    return f"{card}, capped to {cap / GIB:.0f} GiB" if cap else card


def model_name(record: dict[str, Any]) -> str:
    layers, full = record.get("layers"), record.get("full_layers")
    if layers == full:
        return f"{record.get('model')} ({full} layers)"
    ballast = (record.get("options") or {}).get("ballast") == "auto" or record.get("ballast") == "auto"
    return f"{record.get('model')} ({layers} of {full} layers{' + ballast' if ballast else ''})"


class Commands:
    """Numbers the commands; a figure cites ``[n]``, and the list at the end gives each with its environment."""

    def __init__(self) -> None:
        self._numbers: dict[str, int] = {}

    def ref(self, record: dict[str, Any]) -> str:
        command = record.get("command") or "(command not recorded)"
        env = " ".join(f"{name}={value}" for name, value in sorted((record.get("env") or {}).items()))
        line = f"{env} {command}".strip()
        if line not in self._numbers:
            self._numbers[line] = len(self._numbers) + 1
        return f"[{self._numbers[line]}]"

    def markdown(self) -> list[str]:
        return [f"{n}. `{line}`" for line, n in self._numbers.items()]


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


# ---- the figures -----------------------------------------------------------------------------------------------------
def max_lengths(records: list[dict[str, Any]]) -> dict[tuple[str, int, str], dict[str, dict[str, Any]]]:
    """``{(card, gpus, model): {system: {"max", "fail", "exact", "limit", "record", "system"}}}``: from the
    max-length searches where there are any, else from the runs that stand for the full depth. ``exact``: a longer
    length was tried and failed, so ``max`` is the limit (within the step of the search), not a lower bound."""
    out: dict[tuple[str, int, str], dict[str, dict[str, Any]]] = defaultdict(dict)
    searches = latest([r for r in records if r.get("kind") == "max_length"],
                      key=lambda r: (card_name(r), r.get("gpus"), r.get("model"), r.get("system")))
    for summary in searches:
        host_bound = summary.get("host_max_seq_len") is not None and summary.get("max_seq_len_gpu") is not None and (
            summary["host_max_seq_len"] < summary["max_seq_len_gpu"])
        out[(card_name(summary), summary["gpus"], summary["model"])][summary["system"]] = {
            "max": summary.get("max_seq_len"), "fail": summary.get("first_failed_seq_len"),
            "exact": summary.get("first_failed_seq_len") is not None or host_bound,
            "limit": summary.get("limited_by"), "record": summary, "system": summary["system"],
            "gpu_max": summary.get("max_seq_len_gpu", summary.get("max_seq_len")),
            "host_max": summary.get("host_max_seq_len"),
        }
    # an attempt that never started has no card; its search's summary accounts for it
    runs = [r for r in records if r.get("kind") == "run" and r.get("card") and stands_for_full_depth(r)]
    groups: dict[tuple[str, int, str, str], list[dict[str, Any]]] = defaultdict(list)
    for record in runs:
        groups[(card_name(record), record.get("gpus"), record.get("model"), record.get("system"))].append(record)
    for (card, gpus, model, system), group in groups.items():
        if system in out[(card, gpus, model)]:
            continue  # a search says more
        ok = [r for r in group if fits(r)]
        best = max(ok, key=lambda r: r["seq_len"]) if ok else None
        longest = best["seq_len"] if best else 0
        failed = sorted((r for r in group if not fits(r) and r["seq_len"] > longest), key=lambda r: r["seq_len"])
        if best is None and not failed:
            continue
        first_fail = failed[0] if failed else None
        limit = None
        if first_fail is not None:
            limit = first_fail.get("limit") or first_fail.get("status")
            if first_fail.get("status") == "ok":
                limit = "host (planned, full depth)"
        entry = {
            "max": best and best["seq_len"], "fail": first_fail and first_fail["seq_len"],
            "exact": first_fail is not None, "limit": limit, "record": best or first_fail, "system": system,
        }
        # where the host binds, the GPU's own limit is shown beside it: the longest step that ran, the first that did not
        ran = [r for r in group if r.get("status") == "ok"]
        gpu_best = max(ran, key=lambda r: r["seq_len"]) if ran else None
        if gpu_best is not None and gpu_best["seq_len"] > longest:
            gpu_failed = sorted((r["seq_len"] for r in group if r.get("status") != "ok"
                                 and r["seq_len"] > gpu_best["seq_len"]))
            entry.update(host_max=longest, gpu_max=gpu_best["seq_len"], gpu_record=gpu_best,
                         gpu_fail=gpu_failed[0] if gpu_failed else None)
        out[(card, gpus, model)][system] = entry
    return dict(out)


def throughput_groups(records: list[dict[str, Any]]) -> dict[tuple, dict[str, dict[str, Any]]]:
    """``{(card, gpus, model, layers, seq_len): {system: latest ok run with a timed step}}``."""
    runs = latest([r for r in records if r.get("kind") == "run" and r.get("status") == "ok" and timed(r)],
                  key=lambda r: (card_name(r), r["gpus"], r["model"], r["layers"], r["seq_len"], r["system"]))
    groups: dict[tuple, dict[str, dict[str, Any]]] = defaultdict(dict)
    for record in runs:
        groups[(card_name(record), record["gpus"], record["model"], record["layers"], record["seq_len"])][
            record["system"]] = record
    return dict(groups)


def targets(records: list[dict[str, Any]]) -> list[list[str]]:
    """The issue's goals, each with the measured figure (per card) and whether it is met."""
    rows: list[list[str]] = []
    lengths = max_lengths(records)

    def verdict(met: Optional[bool]) -> str:
        return "not measured" if met is None else ("met" if met else "**missed**")

    for gpus, goal in ((1, TARGET_1GPU), (4, TARGET_4GPU)):
        found = [(card, systems["fpdt"]) for (card, g, model), systems in lengths.items()
                 if g == gpus and model == "llama3-8b" and "fpdt" in systems]
        for card, entry in found or [("–", None)]:
            value = entry and entry["max"]
            if entry is None:
                status = "not measured"
            elif (value or 0) >= goal:
                status = "met"
            else:  # below the goal: a miss only if a longer length was tried and failed
                status = "**missed**" if entry["exact"] else "not conclusive"
            shown = length(value) if entry is None or entry["exact"] else f"≥ {length(value)}"
            gpu = gpu_limit(entry)
            if gpu is not None:  # the host binds: the GPU's own verdict beside the host's
                shown = (f"{length(value) if value else 'none'} with the full depth's pinned host memory; "
                         f"GPU memory: {'' if gpu['exact'] else '≥ '}{length(gpu['max'])} ran")
                if gpu["max"] >= goal and status != "met":
                    status = f"met on GPU memory, {status} on this host"
            rows.append([f"maximum length, {gpus} GPU{'s' if gpus > 1 else ''}, fpdt", f"≥ {goal:,}", card, shown,
                         status])
    for other, goal in (("modelparallel", TARGET_VS_MODELPARALLEL), ("ring", TARGET_VS_RING_LENGTH)):
        found = [(card, g, systems) for (card, g, model), systems in lengths.items()
                 if model == "llama3-8b" and "fpdt" in systems and other in systems]
        for card, g, systems in found or [("–", None, None)]:
            if systems is None:
                rows.append([f"maximum length, fpdt / {other}", f"≥ {goal:g}×", "–", "–", verdict(None)])
                continue
            ours, theirs = systems["fpdt"], systems[other]
            shown, value, conclusive = length_ratio(ours, theirs)
            if value is not None:
                shown += f" ({length(ours['max'])} / {length(theirs['max'])})"
            if not ours["max"] and ours["exact"] and theirs["max"]:  # fpdt fits no length tried, the peer does
                shown, status = f"0 (fpdt fits no length run; {other}: {length(theirs['max'])})", "**missed**"
            elif not conclusive:
                status = "not conclusive"
            elif value is None or value >= goal:  # the peer fits nothing; or a ratio that can only grow, reached
                status = "met"
            else:
                status = "**missed**" if ours["exact"] else "not conclusive"
            gpu = gpu_limit(ours)
            if gpu is not None and status != "met":  # fpdt's host binds: the ratio of the GPU limits beside it
                gpu_shown, gpu_value, gpu_conclusive = length_ratio(gpu, theirs)
                if gpu_value is not None:
                    gpu_shown += f" ({length(gpu['max'])} / {length(theirs['max'])})"
                shown = f"{shown}; on GPU memory: {gpu_shown}"
                if gpu_conclusive and (gpu_value is None or gpu_value >= goal):
                    status = f"met on GPU memory, {status} on this host"
            rows.append([f"maximum length, fpdt / {other}, {g} GPU{'s' if g > 1 else ''}", f"≥ {goal:g}×", card,
                         shown, status])
    full = [r for r in records if r.get("kind") == "run" and r.get("status") == "ok" and r.get("system") == "fpdt"
            and r.get("model") == "llama3-8b" and r.get("layers") == r.get("full_layers") and r.get("gpus") == 4
            and r.get("seq_len") == TARGET_MFU_SEQ_LEN and r.get("mfu") is not None and timed(r)]
    for record in latest(full, key=card_name) or [None]:
        rows.append(["MFU (causal), full depth, 524,288 tokens, 4 GPUs", f"≥ {100 * TARGET_MFU:.0f}%",
                     "–" if record is None else card_name(record), percent(record and record["mfu"]),
                     verdict(None if record is None else record["mfu"] >= TARGET_MFU)])
    pairs = [(key, systems) for key, systems in throughput_groups(records).items()
             if "fpdt" in systems and "ring" in systems and key[2] == "llama3-8b"]
    for (card, g, _model, layers, seq_len), systems in pairs or [(("–",) * 5, None)]:
        if systems is None:
            rows.append(["tokens/s at equal length, fpdt / ring", f"≥ {TARGET_VS_RING_THROUGHPUT:g}×", "–", "–",
                         verdict(None)])
            continue
        ours, theirs = systems["fpdt"]["tokens_per_s"], systems["ring"]["tokens_per_s"]
        rows.append([f"tokens/s, fpdt / ring, {g} GPUs, {layers} layers, S = {seq_len:,}",
                     f"≥ {TARGET_VS_RING_THROUGHPUT:g}×", card, ratio(ours, theirs),
                     verdict(None if not ours or not theirs else ours / theirs >= TARGET_VS_RING_THROUGHPUT)])
    return rows


# ---- the document --------------------------------------------------------------------------------------------------
def render_markdown(records: list[dict[str, Any]], *, plots: Optional[list[str]] = None, doc_dir: str = ".",
                    plot_note: str = "") -> str:
    """The whole of docs/peers.md."""
    commands = Commands()
    runs = [r for r in records if r.get("kind") == "run"]
    lines = [
        "# Benchmarks against the peers",
        "",
        f"Generated by `python bench/report.py` from {len(runs)} runs of `bench/peers.py` "
        f"({sum(r.get('kind') == 'max_length' for r in records)} maximum-length searches); do not edit by hand. "
        "Protocol: DESIGN.md §8; how to reproduce every figure: bench/README.md. The systems: "
        + "; ".join(f"**{s}**: {name}" for s, name in SYSTEM_NAMES.items()) + ". "
        "Same model (the reference Llama), same initialisation and data, bf16 compute with fp32 master weights "
        "(FSDP2 MixedPrecisionPolicy), AdamW. FLOPs in the causal convention (6·N + 6·L·S·d_attn per token) of the "
        "layers run; MFU against the card's dense bf16 peak. Step time: median of the steps after the first. Peak GPU "
        "memory: `torch.cuda.max_memory_allocated` within a step, the largest over steps and ranks, ballast included. "
        "Figures of different cards are never compared in one row. [n] refers to the commands at the end.",
        "",
        "## Targets of issue 8",
        "",
    ]
    lines += table(["target", "goal", "card", "measured", "status"], targets(records))

    lines += ["", "## Maximum trainable sequence length", "",
              "A length counts when a training step ran at it, at full depth or with the ballast of the layers not "
              "run (the command [n] says which), and, where checked, the pinned host memory the full depth needs "
              "fits the host. \"x; y failed\": x fits and the next length tried, y, did not (why in brackets); a "
              "length with nothing longer run is only a lower bound, and a ratio over a peer's lower bound says "
              "nothing. Searches (`--max-length`) find the GPU's limit by running steps and the host's by the "
              "planner (`lightning_fpdt.planner.plan_memory` of the full depth against the host's available memory); "
              "the maximum is the smaller. `modelparallel` trains one whole sequence per GPU (data parallel), so its longest sequence "
              "does not grow with the GPU count.",
              ""]
    rows = []
    for (card, gpus, model), systems in sorted(max_lengths(records).items(), key=lambda kv: (kv[0][0], kv[0][1])):
        cells = []
        for system in SYSTEMS:
            entry = systems.get(system)
            if entry is None:
                cells.append("not run")
                continue
            fits = length(entry["max"]) if entry["max"] else "none"
            gpu_fail_len = entry["gpu_fail"] if "gpu_fail" in entry else entry["fail"]
            gpu_fail = f"{length(gpu_fail_len)} failed" if gpu_fail_len else "nothing longer failed"
            if entry.get("host_max") is not None and entry["host_max"] < (entry.get("gpu_max") or 0):
                host = (f"full depth planned to fit up to {length(entry['host_max'])}" if entry["host_max"] else
                        "the full depth's pinned memory fits no length run")
                gpu_ref = f" {commands.ref(entry['gpu_record'])}" if "gpu_record" in entry else ""
                outcome = f"{fits} (host: {host}; GPU: {length(entry['gpu_max'])} ran{gpu_ref}, {gpu_fail})"
            elif entry["exact"]:
                outcome = f"{fits}; {gpu_fail} ({entry['limit']})"
            else:
                outcome = f"≥ {fits} (nothing longer run)"
            cells.append(f"{outcome} {commands.ref(entry['record'])}")
        ours = systems.get("fpdt")
        rows.append([card, str(gpus), model, *cells, *(both_ratios(ours, systems.get(other))
                                                       for other in ("modelparallel", "ring"))])
    lines += table(["card", "GPUs", "model", *SYSTEMS, "fpdt / modelparallel", "fpdt / ring"], rows) if rows else [
        "No maximum-length figures yet."]

    lines += ["", "## Peak GPU memory does not depend on the depth run (ballast protocol)", "",
              "Runs of the same system, card, GPU count and length at different depths, each with the ballast of the "
              "layers it does not run: equal peaks mean the few-layer runs stand for the full model.", ""]
    depth_groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for record in latest([r for r in runs if r.get("status") == "ok" and r.get("peak_gpu_bytes") is not None],
                         key=lambda r: (r["system"], card_name(r), r["gpus"], r["model"], r["seq_len"], r["layers"])):
        depth_groups[(record["system"], card_name(record), record["gpus"], record["model"], record["seq_len"])].append(
            record)
    rows = []
    for (system, card, gpus, model, seq_len), group in depth_groups.items():
        if len({r["layers"] for r in group}) < 2:
            continue
        spread = max(r["peak_gpu_bytes"] for r in group) - min(r["peak_gpu_bytes"] for r in group)
        for record in sorted(group, key=lambda r: r["layers"]):
            rows.append([system, card, str(gpus), model_name(record), length(seq_len), gib(record["ballast_bytes"]),
                         gib(record["peak_gpu_bytes"]), gib(record["peak_gpu_bytes_minus_ballast"]), gib(spread),
                         commands.ref(record)])
    lines += table(["system", "card", "GPUs", "model", "S", "ballast GiB", "peak GiB", "peak − ballast GiB",
                    "spread GiB", "cmd"], rows) if rows else ["No length was run at two depths yet."]

    lines += ["", "## Throughput and MFU at equal length", "",
              "`× ring`: tokens/s against ring context parallelism at the same card, GPUs, depth and length. "
              "modelparallel's tokens/s counts every GPU's own sequence. Runs of one step (the searches) are left "
              "out: their only step includes the warm-up.", ""]
    rows = []
    for (card, gpus, model, layers, seq_len), systems in sorted(throughput_groups(records).items(),
                                                                key=lambda kv: (kv[0][0], kv[0][1], kv[0][4])):
        ring = systems.get("ring")
        for system in SYSTEMS:
            record = systems.get(system)
            if record is None:
                continue
            rows.append([card, str(gpus), model_name(record), length(seq_len), system,
                         number(record.get("step_time_s"), 3), number(record.get("tokens_per_s"), 0),
                         number(record.get("tflops_per_gpu")), percent(record.get("mfu")),
                         gib(record.get("peak_gpu_bytes")),
                         "–" if ring is None or system == "ring" else ratio(record.get("tokens_per_s"),
                                                                              ring.get("tokens_per_s")),
                         commands.ref(record)])
    lines += table(["card", "GPUs", "model", "S", "system", "step s", "tokens/s", "TFLOP/s per GPU", "MFU",
                    "peak GiB", "× ring", "cmd"], rows) if rows else ["No completed runs yet."]

    checked = [r for r in runs if r.get("host_check")]
    lines += ["", "## Host memory of the full depth", "",
              "`lightning_fpdt.planner.plan_memory` of the full depth (pinned host memory per host: offloaded "
              "attention chunks and block inputs, CPU-offloaded states), beside the memory the host had available "
              "when the run began; for fpdt also the planner's GPU peak of the full depth beside the measured one.", ""]
    rows = [[r["system"], card_name(r), str(r["gpus"]), model_name(r), length(r["seq_len"]),
             gib(r["host_check"]["needed_bytes"]), gib(r["host_check"]["available_bytes"]),
             {True: "yes", False: "**no**", None: "unknown"}[r["host_check"]["fits"]],
             gib(r["host_check"].get("planned_peak_gpu_bytes")), gib(r.get("peak_gpu_bytes")), commands.ref(r)]
            for r in checked]
    lines += table(["system", "card", "GPUs", "model", "S", "needed GiB", "available GiB", "fits",
                    "planned GPU peak GiB", "measured peak GiB", "cmd"], rows) if rows else ["No host checks yet."]

    lines += ["", "## Plots", ""]
    if plots:
        for path in plots:
            lines.append(f"![{os.path.basename(path)}]({os.path.relpath(path, doc_dir)})")
    else:
        lines.append(plot_note or "No plots.")

    lines += ["", "## Every run", ""]
    rows = [[str(i), r["system"], r.get("status", "?") + (f" ({r['limit']})" if r.get("limit") else ""),
             card_name(r), str(r.get("gpus")), model_name(r), length(r.get("seq_len")), str(r.get("chunks") or "–"),
             number(r.get("step_time_s"), 3) + ("" if timed(r) or r.get("step_time_s") is None else " (warm-up)"),
             number(r.get("tokens_per_s"), 0), number(r.get("tflops_per_gpu")),
             percent(r.get("mfu")), gib(r.get("peak_gpu_bytes")), gib(r.get("ballast_bytes")),
             number(r.get("first_loss"), 4), commands.ref(r)]
            for i, r in enumerate(runs, 1)]
    lines += table(["#", "system", "status", "card", "GPUs", "model", "S", "chunks", "step s", "tokens/s",
                    "TFLOP/s per GPU", "MFU", "peak GiB", "ballast GiB", "first loss", "cmd"], rows) if rows else [
        "No runs yet."]

    lines += ["", "## Commands", "", "Run from the repository root (bench/README.md has the device-tool call shape).", ""]
    lines += commands.markdown()
    return "\n".join(lines) + "\n"


# ---- plots -----------------------------------------------------------------------------------------------------------
def tokens_label(value: float) -> str:
    """256K, 1M, 1.5M: the axis labels of sequence lengths."""
    if value >= 2**20:
        return f"{value / 2**20:g}M"
    return f"{value / 2**10:g}K" if value >= 2**10 else f"{value:g}"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def variant(record: dict[str, Any]) -> str:
    """The fpdt options a run set that change its memory (attention recompute, head groups, offload off): runs that
    differ in them are different lines of a plot."""
    options = record.get("options") or {}
    parts = ["attention recomputed"] if options.get("recompute_attention") else []
    if (options.get("head_chunks") or 1) > 1:
        parts.append(f"{options['head_chunks']} head groups")
    if record.get("system") == "fpdt" and options.get("offload") is False:
        parts.append("offload off")
    return ", ".join(parts)


def write_plots(records: list[dict[str, Any]], folder: str) -> Optional[list[str]]:
    """Peak GPU memory and MFU against the sequence length, one line per system and depth, one PNG pair per card,
    GPU count and model; ``None`` (and a message) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("bench/report.py: matplotlib is not installed, plots skipped (pip install matplotlib to draw them; "
              "the tables are written all the same)", file=sys.stderr)
        return None
    runs = latest([r for r in records if r.get("kind") == "run" and r.get("status") == "ok"],
                  key=lambda r: (card_name(r), r["gpus"], r["model"], r["system"], variant(r), r["layers"],
                                 r["seq_len"]))
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = defaultdict(list)
    for record in runs:
        groups[(card_name(record), record["gpus"], record["model"])].append(record)
    os.makedirs(folder, exist_ok=True)
    written = []
    for (card, gpus, model), group in sorted(groups.items()):
        for metric, ylabel, value in (
            ("memory", "peak GPU memory (GiB)", lambda r: r.get("peak_gpu_bytes") and r["peak_gpu_bytes"] / GIB),
            ("mfu", "MFU, causal (%)", lambda r: r.get("mfu") and timed(r) and 100 * r["mfu"] or None),
        ):
            lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
            for record in group:
                y = value(record)
                if y is not None:
                    depth = model_name(record).split('(', 1)[1].rstrip(')')
                    name = ", ".join(filter(None, (record["system"], variant(record))))
                    lines[f"{name} ({depth})"].append((record["seq_len"], y))
            if not lines:
                continue
            figure, axes = plt.subplots(figsize=(7, 4.5))
            for label, points in sorted(lines.items()):
                points.sort()
                axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
            limit = group[0].get("gpu_memory_cap_bytes") or group[0].get("card_memory_bytes")
            if metric == "memory" and limit:
                axes.axhline(limit / GIB, color="grey", linestyle="--", linewidth=1,
                             label="memory cap" if group[0].get("gpu_memory_cap_bytes") else "card memory")
            axes.set_xscale("log", base=2)
            axes.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: tokens_label(x)))
            axes.set_ylim(bottom=0)
            axes.set_xlabel("sequence length (tokens)")
            axes.set_ylabel(ylabel)
            axes.set_title(f"{card}, {gpus} GPU{'s' if gpus > 1 else ''}, {model}", fontsize=10)
            axes.grid(True, alpha=0.3)
            axes.legend(fontsize=8)
            path = os.path.join(folder, f"peers_{metric}_{slug(card)}_{gpus}gpu_{slug(model)}.png")
            figure.tight_layout()
            figure.savefig(path, dpi=120)
            plt.close(figure)
            written.append(path)
    return written


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/report.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("records", nargs="+", help="JSONL files written by bench/peers.py")
    parser.add_argument("--doc", default="docs/peers.md")
    parser.add_argument("--plots", default="docs/plots", help="folder of the PNG plots")
    args = parser.parse_args(argv)
    records = load_records(args.records)
    plots = write_plots(records, args.plots)
    note = "" if plots is not None else ("Plots not drawn: matplotlib was not installed where bench/report.py ran.")
    doc_dir = os.path.dirname(os.path.abspath(args.doc))
    os.makedirs(doc_dir, exist_ok=True)
    with open(args.doc, "w") as f:
        f.write(render_markdown(records, plots=[os.path.abspath(p) for p in plots or []], doc_dir=doc_dir,
                                plot_note=note))
    print(f"bench/report.py: {len(records)} records -> {args.doc}"
          + (f", {len(plots)} plots in {args.plots}" if plots else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
