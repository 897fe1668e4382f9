"""Reading the JSONL records of bench/results/ and the questions the tables ask of them.

A record is shown only with its provenance: the card, the GPU count, the command and the commit. A record without
one of them is skipped with a warning that names the fix. Records written before records carried a commit have none;
give each the commit that added it to the repository (``git log --diff-filter=A --format=%h -- FILE``) to show it.
"""

from __future__ import annotations

import functools
import json
import subprocess
import warnings
from typing import Any, Callable, Hashable, Iterable

GIB = 2**30
KINDS = ("run", "max_length", "attention", "gemm", "elementwise", "memory_tiles", "head_chunks", "packed",
         "smoke_train", "memory_trace")
PROVENANCE = ("card", "gpus", "command", "commit")


def missing_provenance(record: dict[str, Any]) -> list[str]:
    """The provenance fields ``record`` lacks (absent or null)."""
    return [field for field in PROVENANCE if record.get(field) in (None, "")]


def _skip_reason(record: Any) -> str:
    """Why a parsed line is not shown; empty when it is."""
    if not isinstance(record, dict) or record.get("kind") not in KINDS:
        return f"not a benchmark record (kind must be one of {', '.join(KINDS)})"
    missing = missing_provenance(record)
    if "commit" in missing:
        return ("no commit (written before records carried one, or where neither git nor $FPDT_COMMIT named it): "
                "add the commit of the code that ran, for a stored record the one that added it to the repository")
    if missing:
        return f"no {', '.join(missing)}: a figure is shown only with the card, GPU count and command that made it"
    return ""


def _read(path: str) -> Iterable[dict[str, Any]]:
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                warnings.warn(f"{path}:{number}: not JSON ({error}); skipped")
                continue
            reason = _skip_reason(record)
            if reason:
                warnings.warn(f"{path}:{number}: {reason}; skipped")
                continue
            yield record


def load_records(paths: Iterable[str]) -> list[dict[str, Any]]:
    """Every shown record of the JSONL files in the order they were made (their ``time``; file order where equal or
    missing), so "the latest" is the latest run."""
    records = [record for path in paths for record in _read(path)]
    records.sort(key=lambda record: str(record.get("time") or ""))
    return records


def of_kind(records: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [record for record in records if record.get("kind") == kind]


def latest(records: Iterable[dict[str, Any]], key: Callable[[dict[str, Any]], Hashable]) -> list[dict[str, Any]]:
    """The record of each ``key(record)`` from the newest code: the last run of the latest commit
    (:func:`by_commit_age`: runs side by side may run an older commit after the newer), in the order the keys first
    appear."""
    records = list(records)
    order = list(dict.fromkeys(key(record) for record in records))
    chosen: dict[Any, dict[str, Any]] = {}
    for record in sorted(records, key=by_commit_age):
        chosen[key(record)] = record
    return [chosen[k] for k in order]


def fits(record: dict[str, Any]) -> bool:
    """A step ran, and where the host check was made the full depth's pinned host memory fits the host."""
    host = record.get("host_check") or {}
    return record.get("status") == "ok" and host.get("fits") is not False


def timed(record: dict[str, Any]) -> bool:
    """A step after the warm-up was timed (a run of ``--steps 1``, as in the searches, only shows memory)."""
    return record.get("timed_steps", 1) > 0


def ballast_kind(record: dict[str, Any]) -> str:
    """``"full"``: the layers not run held on the GPU, in host memory and on disk (``--ballast full``); ``"auto"``:
    on the GPU only; ``"none"``."""
    return (record.get("options") or {}).get("ballast") or record.get("ballast") or "none"


def stands_for_full_depth(record: dict[str, Any]) -> bool:
    """Run at full depth, or with the ballast of the layers not run."""
    return record.get("layers") == record.get("full_layers") or ballast_kind(record) in ("auto", "full")


def card_name(record: dict[str, Any]) -> str:
    """The card, and the memory cap a run had (``--gpu-memory-gib``): capped and uncapped runs of one card are grouped
    apart, since what fits differs."""
    card = record.get("card") or "?"
    cap = record.get("gpu_memory_cap_bytes")
    return f"{card}, capped to {cap / GIB:.0f} GiB" if cap else card


def model_name(record: dict[str, Any]) -> str:
    """The geometry and the depth run: ``llama3-8b (2 of 32 layers + ballast)``."""
    layers, full = record.get("layers"), record.get("full_layers")
    if layers == full:
        return f"{record.get('model')} ({full} layers)"
    label = {"auto": " + ballast", "full": " + full-depth ballast"}.get(ballast_kind(record), "")
    return f"{record.get('model')} ({layers} of {full} layers{label})"


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


@functools.lru_cache(maxsize=None)
def commit_time(commit: str) -> str:
    """When ``commit`` was made (ISO 8601, from the repository's history), or ``""`` where git does not know it."""
    try:
        done = subprocess.run(["git", "log", "-1", "--format=%cI", commit], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def by_commit_age(record: dict[str, Any]) -> tuple[str, str]:
    """A sort key: the record's commit's own time, then the run's (runs side by side may run the newer code first)."""
    return commit_time(str(record.get("commit"))), record.get("time") or ""
