"""The maximum trainable sequence length per card, GPU count and model, for each system, and the ratios between them.

A length counts when a training step ran at it, at full depth or with the ballast of the layers not run, and, where
the host was checked, the pinned host memory the full depth needs fits the host. From a ``--max-length`` search where
there is one, else from the single runs that stand for the full depth.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

from bench.report.markdown import Commands, commits, length, table
from bench.report.records import ballast_kind, card_name, fits, latest, of_kind, stands_for_full_depth

SYSTEMS = ("fpdt", "modelparallel", "ring", "alst")
HOST_BOUND = "host (planned, full depth)"
PLANNED = "planned:"
"""How the error of a length the full depth's plan refused begins (``bench.peers --ballast full``)."""
Entry = dict[str, Any]


def length_ratio(ours: Optional[Entry], theirs: Optional[Entry]) -> tuple[str, Optional[float], bool]:
    """``(shown, value, conclusive)`` of fpdt's maximum length over a peer's. A maximum without a failing length above
    it is only a lower bound: over a peer's lower bound the ratio says nothing. Each maximum lies between the longest
    length that fit and the first that failed, so the ratio does too: at least fpdt's length over the peer's first
    failure, below fpdt's first failure over the peer's length. The ratio of the two lengths that fit is shown with
    that range where the two differ, and where fpdt's is a lower bound only the range's lower end is (shown "≥")."""
    if not ours or not theirs or not ours["max"]:
        return "–", None, False
    if not theirs["max"]:
        return f"∞ ({theirs.get('system', 'peer')} fits no length tried)", None, theirs["exact"]
    value = ours["max"] / theirs["max"]
    if not theirs["exact"]:
        return f"? (no failing length for {theirs.get('system', 'the peer')})", value, False
    low = ours["max"] / (theirs.get("fail") or theirs["max"])
    if not ours["exact"]:
        if low < 1:
            return f"? (nothing longer run for {ours.get('system', 'fpdt')})", value, False
        return f"≥ {low:.2f}×", low, True
    high = ours["fail"] / theirs["max"] if ours.get("fail") else None
    if high is None:
        bounds = "" if low == value else f" (≥ {low:.2f}×)"
    else:
        bounds = "" if low == value == high else f" ({low:.2f}–{high:.2f}×)"
    return f"{value:.2f}×{bounds}", value, True


def gpu_limit(entry: Optional[Entry]) -> Optional[Entry]:
    """The GPU's own limit of a :func:`max_lengths` entry whose host binds below its GPU (the full depth's pinned
    memory does not fit the host at the length the GPU holds), as an entry of its own (``max``: the longest length a
    step ran at, ``exact``: a longer one failed); ``None`` where the host does not bind. It holds on a host with more
    memory, so the table shows it beside the host-bound figure."""
    if not entry or entry.get("host_max") is None or not entry.get("gpu_max"):
        return None
    if entry["host_max"] >= entry["gpu_max"]:
        return None
    failed = entry.get("gpu_fail") if "gpu_fail" in entry else entry.get("fail")
    return {"max": entry["gpu_max"], "fail": failed, "exact": failed is not None, "system": entry["system"]}


def both_ratios(ours: Optional[Entry], theirs: Optional[Entry]) -> str:
    """:func:`length_ratio` shown, and where fpdt's host binds, the ratio of the GPU limits beside it."""
    shown = length_ratio(ours, theirs)[0]
    gpu = gpu_limit(ours)
    if gpu is None or not theirs:
        return shown
    return f"{shown} (GPU memory: {length_ratio(gpu, theirs)[0]})"


def _from_search(summary: dict[str, Any]) -> Entry:
    host_bound = summary.get("host_max_seq_len") is not None and summary.get("max_seq_len_gpu") is not None and (
        summary["host_max_seq_len"] < summary["max_seq_len_gpu"])
    return {
        "max": summary.get("max_seq_len"), "fail": summary.get("first_failed_seq_len"),
        "exact": summary.get("first_failed_seq_len") is not None or host_bound,
        "limit": summary.get("limited_by"), "record": summary, "system": summary["system"],
        "gpu_max": summary.get("max_seq_len_gpu", summary.get("max_seq_len")),
        "host_max": summary.get("host_max_seq_len"),
    }


def _from_runs(system: str, group: list[dict[str, Any]]) -> Optional[Entry]:
    """The longest run that fits and the first failure above it; where the host binds, the GPU's own limit too (the
    longest step that ran, the first that did not)."""
    ok = [r for r in group if fits(r)]
    best = max(ok, key=lambda r: r["seq_len"]) if ok else None
    longest = best["seq_len"] if best else 0
    # of two failures at one length, the run that held the full depth's host memory (or its plan's refusal) first
    failed = sorted((r for r in group if not fits(r) and r["seq_len"] > longest),
                    key=lambda r: (r["seq_len"], ballast_kind(r) != "full"))
    if best is None and not failed:
        return None
    first_fail = failed[0] if failed else None
    limit = None
    if first_fail is not None:
        limit = HOST_BOUND if first_fail.get("status") == "ok" else first_fail.get("limit") or first_fail.get("status")
        if str(first_fail.get("error") or "").startswith(PLANNED):
            limit = f"{limit}, planned"  # refused by the plan of the full depth before anything ran
    entry = {"max": best and best["seq_len"], "fail": first_fail and first_fail["seq_len"],
             "exact": first_fail is not None, "limit": limit, "record": best or first_fail, "system": system,
             "fail_record": first_fail if best is not None else None}
    ran = [r for r in group if r.get("status") == "ok"]
    gpu_best = max(ran, key=lambda r: r["seq_len"]) if ran else None
    if gpu_best is not None and gpu_best["seq_len"] > longest:
        gpu_failed = sorted(r["seq_len"] for r in group
                            if r.get("status") != "ok" and r["seq_len"] > gpu_best["seq_len"])
        entry.update(host_max=longest, gpu_max=gpu_best["seq_len"], gpu_record=gpu_best,
                     gpu_fail=gpu_failed[0] if gpu_failed else None)
    return entry


def max_lengths(records: list[dict[str, Any]]) -> dict[tuple[str, int, str], dict[str, Entry]]:
    """``{(card, gpus, model): {system: {"max", "fail", "exact", "limit", "record", "system"}}}``: from the
    max-length searches where there are any, else from the runs that stand for the full depth. ``exact``: a longer
    length was tried and failed, so ``max`` is the limit (within the step of the search), not a lower bound."""
    out: dict[tuple[str, int, str], dict[str, Entry]] = defaultdict(dict)
    searches = latest(of_kind(records, "max_length"),
                      key=lambda r: (card_name(r), r.get("gpus"), r.get("model"), r.get("system")))
    for summary in searches:
        out[(card_name(summary), summary["gpus"], summary["model"])][summary["system"]] = _from_search(summary)
    groups: dict[tuple[str, int, str, str], list[dict[str, Any]]] = defaultdict(list)
    for record in of_kind(records, "run"):
        if stands_for_full_depth(record):
            groups[(card_name(record), record.get("gpus"), record.get("model"), record.get("system"))].append(record)
    for (card, gpus, model, system), group in groups.items():
        if system in out[(card, gpus, model)]:
            continue  # a search says more
        entry = _from_runs(system, group)
        if entry is not None:
            out[(card, gpus, model)][system] = entry
    return {key: systems for key, systems in out.items() if systems}


def _cell(entry: Optional[Entry], commands: Commands) -> str:
    """One system's maximum: ``x; y failed (why)``, a lower bound, or the host's and the GPU's limits side by side."""
    if entry is None:
        return "not run"
    fits_text = length(entry["max"]) if entry["max"] else "none"
    gpu_fail_len = entry["gpu_fail"] if "gpu_fail" in entry else entry["fail"]
    gpu_fail = f"{length(gpu_fail_len)} failed" if gpu_fail_len else "nothing longer failed"
    if entry.get("host_max") is not None and entry["host_max"] < (entry.get("gpu_max") or 0):
        gpu_ref = f" {commands.ref(entry['gpu_record'])}" if "gpu_record" in entry else ""
        gpu = f"{length(entry['gpu_max'])} ran{gpu_ref}, {gpu_fail}"
        if entry["max"] and entry.get("fail_record") and ballast_kind(entry["record"]) == "full":
            # the host's limit shown by runs: one holding the full depth's host memory, the next failing or refused
            return (f"{fits_text} {commands.ref(entry['record'])}; {length(entry['fail'])} failed ({entry['limit']}) "
                    f"{commands.ref(entry['fail_record'])} (GPU alone: {gpu})")
        host = (f"full depth planned to fit up to {length(entry['host_max'])}" if entry["host_max"] else
                "the full depth's pinned memory fits no length run")
        outcome = f"{fits_text} (host: {host}; GPU: {gpu})"
    elif entry["exact"] and entry.get("fail_record"):
        # each length beside its own run: the one that fit, then the one that did not
        return (f"{fits_text} {commands.ref(entry['record'])}; {gpu_fail} ({entry['limit']}) "
                f"{commands.ref(entry['fail_record'])}")
    elif entry["exact"]:
        outcome = f"{fits_text}; {gpu_fail} ({entry['limit']})"
    else:
        outcome = f"≥ {fits_text} (nothing longer run)"
    return f"{outcome} {commands.ref(entry['record'])}"


def ours_of(systems: dict[str, Entry]) -> Optional[Entry]:
    """fpdt's entry: the reference Llama's, or where only the Hugging Face model ran (``fpdt-hf``), that one's."""
    return systems.get("fpdt") or systems.get("fpdt-hf")


def _cited(systems: dict[str, Entry]) -> list[dict[str, Any]]:
    return [record for entry in systems.values()
            for record in (entry["record"], entry.get("gpu_record"), entry.get("fail_record")) if record]


def section(records: list[dict[str, Any]], commands: Commands) -> list[str]:
    lines = [
        "### Maximum trainable sequence length", "",
        "A length counts when a training step ran at it, at full depth or with the ballast of the layers not run (the "
        "command says which), and, where the host was checked, the pinned host memory the full depth needs fits the "
        "host. \"x; y failed\": x fits and the next length tried, y, did not (why in brackets). A length with nothing "
        "longer run is only a lower bound, and a ratio over a peer's lower bound says nothing. A ratio is that of the "
        "two lengths that fit, with its range in brackets: each maximum lies between the length that fit and the one "
        "that failed, so the ratio lies between fpdt's length over the peer's failing one and fpdt's failing length "
        "over the peer's (\"≥\": the lower end, where nothing longer was run for fpdt). \"planned\": the plan of "
        "the full depth on that machine (`--ballast full`) refused the length before anything ran. Searches "
        "(`--max-length`) find the GPU's limit by running steps and the host's with the planner "
        "(`lightning_fpdt.planner.plan_memory` of the full depth against the host's available memory); the maximum "
        "is the smaller. `modelparallel` trains one whole sequence per GPU (data parallel), so its longest sequence "
        "does not grow with the GPU count. The fpdt column is the reference Llama's, or the Hugging Face model's "
        "(`fpdt-hf`, the model ALST trains) where only that ran.", "",
    ]
    rows = []
    for (card, gpus, model), systems in sorted(max_lengths(records).items(), key=lambda kv: (kv[0][0], kv[0][1])):
        ours = ours_of(systems)
        if ours is None and not set(systems) & set(SYSTEMS):
            continue
        cells = [_cell(systems.get(system), commands) for system in SYSTEMS]
        if "fpdt" not in systems and ours is not None:
            cells[0] = _cell(ours, commands) + " (fpdt-hf: the Hugging Face model)"
        rows.append([card, str(gpus), model, *cells,
                     *(both_ratios(ours, systems.get(other)) for other in SYSTEMS[1:]), commits(_cited(systems))])
    header = ["card", "GPUs", "model", *SYSTEMS, *(f"fpdt / {other}" for other in SYSTEMS[1:]), "commit"]
    return lines + table(header, rows, "No maximum-length figures.")
