"""One training step under ``torch.profiler``, summarised as "which kernel, which copy, which wait".

Used by ``python3 -m bench.peers --profile-step N`` (any system): step ``N`` (0-based; after the warm-up step 0) runs
under the profiler on every rank; rank 0 writes the summary (JSON) and, with ``--profile-trace``, a Chrome trace, and
prints the table. Device time is grouped by kernel kind:

| category | kernels (lower-cased name contains) |
|---|---|
| attention | flash, fmha, cudnn, attention, sdpa |
| matmul | gemm, cutlass, xmma, nvjet, wgmma, matmul |
| communication | nccl |
| copy host->device / device->host / device->device | the profiler's ``Memcpy HtoD`` / ``DtoH`` / ``DtoD`` |
| other | everything else (elementwise, norms, softmax of the loss, reductions) |

Only device-side events count: the profiler also gives every CPU operator (``aten::mm``, ``aten::copy_``, the
``Optimizer.step`` annotation) the device time of the kernels it launched, which would count each kernel twice, and a
user annotation (``record_function``, Lightning's ``Optimizer.step#AdamW.step``) also appears as a device-side range
over the kernels it spans.
CUPTI's "Command Buffer Full" (the host blocked on a full launch queue: the device was busy, not idle) is listed
apart as ``launch queue full`` and not counted as device work.

"busy" is the sum of the attention, matmul and other kernels' time, i.e. the compute stream's work if nothing of it
overlaps; ``wall − busy`` is then what the step waited (copies and communication not hidden, host stalls, launch
gaps). Copies and communication run on their own streams, so their time may overlap compute: it is listed, not
subtracted.
"""

from __future__ import annotations

import bisect
import cProfile
import json
import os
import pstats
import time
from typing import Any, Optional

import torch
from torch.profiler import ProfilerActivity, profile

CATEGORIES = {
    "attention": ("flash", "fmha", "cudnn", "attention", "sdpa"),
    "matmul": ("gemm", "cutlass", "xmma", "nvjet", "wgmma", "matmul"),
    "communication": ("nccl",),
}
COPIES = {"memcpy htod": "copy host->device", "memcpy dtoh": "copy device->host", "memcpy dtod": "copy device->device"}
COMPUTE = ("attention", "matmul", "other")
HOST_STALLS = {"command buffer full": "launch queue full"}


def category(name: str) -> str:
    """The category of a device kernel or copy, by its name."""
    lowered = name.lower()
    for prefix, label in COPIES.items():
        if lowered.startswith(prefix):
            return label
    for label, needles in CATEGORIES.items():
        if any(needle in lowered for needle in needles):
            return label
    return "other"


def _on_device(event: Any) -> bool:
    if getattr(event, "is_user_annotation", False):
        return False
    device_type = getattr(event, "device_type", None)
    return device_type is None or device_type != torch.autograd.DeviceType.CPU


def _device_time_us(event: Any) -> float:
    # torch >= 2.4 names it device time; older releases cuda time
    return float(getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0) or 0)


def summarize(events: Any, wall_s: float, *, top: int = 30) -> dict[str, Any]:
    """Device seconds per category, the busy fraction and the top kernels of ``prof.key_averages()``."""
    seconds: dict[str, float] = {}
    kernels = []
    stalls: dict[str, float] = {}
    for event in events:
        device_us = _device_time_us(event)
        if device_us <= 0 or not _on_device(event):
            continue
        if event.key.lower() in HOST_STALLS:
            label = HOST_STALLS[event.key.lower()]
            stalls[label] = stalls.get(label, 0.0) + device_us / 1e6
            continue
        label = category(event.key)
        seconds[label] = seconds.get(label, 0.0) + device_us / 1e6
        kernels.append((device_us / 1e6, event.count, label, event.key))
    busy = sum(seconds.get(name, 0.0) for name in COMPUTE)
    kernels.sort(reverse=True)
    return {
        "wall_s": wall_s,
        "device_s": dict(sorted(seconds.items(), key=lambda item: -item[1])),
        "busy_s": busy,
        "busy_fraction": busy / wall_s if wall_s > 0 else None,
        "wait_s": max(wall_s - busy, 0.0),
        "host_stalls_s": stalls,
        "top_kernels": [
            {"seconds": s, "calls": count, "category": label, "name": name[:120]}
            for s, count, label, name in kernels[:top]
        ],
    }


def device_events(events: Any) -> list[tuple[float, float, str]]:
    """``(start_us, end_us, name)`` of the device-side kernels, copies and collectives among ``prof.events()``."""
    return [(float(e.time_range.start), float(e.time_range.end), e.name) for e in events
            if _on_device(e) and getattr(e, "device_type", None) is not None
            and e.device_type != torch.autograd.DeviceType.CPU and e.name.lower() not in HOST_STALLS]


def host_events(events: Any) -> list[tuple[float, float, str]]:
    """``(start_us, end_us, name)`` of the CPU operators and annotations among ``prof.events()``."""
    return [(float(e.time_range.start), float(e.time_range.end), e.name) for e in events
            if getattr(e, "device_type", None) == torch.autograd.DeviceType.CPU]


def _python_site(event: Any) -> str:
    """The innermost Python frame of this package (or the bench) among ``event``'s callers, else the innermost
    Python frame; the profiler names a Python function ``path(line): name``."""
    first = None
    parent = getattr(event, "cpu_parent", None)
    while parent is not None:
        name = parent.name
        if ".py(" in name:
            first = first or name
            if "lightning_fpdt/" in name or "bench/" in name:
                return name[name.rfind("lightning_fpdt/") if "lightning_fpdt/" in name else name.rfind("bench/"):]
        parent = parent.cpu_parent
    return first or "(no Python caller)"


def launch_sites(events: Any, *, kinds: tuple[str, ...] = ("other",), top: int = 12) -> list[dict[str, Any]]:
    """The device time of the ``kinds`` kernels by the code that launched them: kernel, the CPU operator with its
    input shapes, and the Python caller where the profile has stacks (:func:`_python_site`), largest first."""
    sites: dict[tuple[str, str, str], list[float]] = {}
    for event in events:
        for kernel in getattr(event, "kernels", None) or ():
            if category(kernel.name) not in kinds:
                continue
            shapes = str(getattr(event, "input_shapes", "") or "")[:80]
            key = (kernel.name[:70], f"{event.name} {shapes}", _python_site(event))
            entry = sites.setdefault(key, [0.0, 0])
            entry[0] += kernel.duration / 1e6
            entry[1] += 1
    ranked = sorted(sites.items(), key=lambda item: -item[1][0])[:top]
    return [{"kernel": k, "op": op, "site": site, "seconds": sec, "calls": n} for (k, op, site), (sec, n) in ranked]


def python_hotspots(python: cProfile.Profile, *, top: int = 15) -> dict[str, list[dict[str, Any]]]:
    """The step's Python time on rank 0 (``cProfile``, which slows the host: the step's device view is read apart):
    the functions of the package, the bench and Lightning by cumulative time (which hook or call holds the host),
    and every function by its own time (where it is spent)."""
    stats = pstats.Stats(python).stats  # {(file, line, name): (calls, primitive, own s, cumulative s, callers)}
    rows = [{"function": f"{file.split('site-packages/')[-1]}:{line}({name})", "calls": calls, "own_s": own,
             "cumulative_s": cumulative} for (file, line, name), (_, calls, own, cumulative, _) in stats.items()]
    ours = [r for r in rows if any(part in r["function"] for part in ("lightning_fpdt/", "bench/", "lightning/"))]
    return {"cumulative": sorted(ours, key=lambda r: -r["cumulative_s"])[:top],
            "own": sorted(rows, key=lambda r: -r["own_s"])[:top]}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(gap: tuple[float, float], spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(gap[1], end) - max(gap[0], start)) for start, end in spans)


def idle_gaps(kernels: list[tuple[float, float, str]], *, host_ops: Optional[list[tuple[float, float, str]]] = None,
              min_us: float = 20.0, top: int = 12) -> dict[str, Any]:
    """Where the compute kernels left the device idle, and what ran meanwhile.

    ``kernels``: ``(start_us, end_us, name)`` of every device event of the step (kernels, copies, collectives). The
    gaps between the compute kernels (attention, matmul, other), from the first device event to the last, are split
    by what overlapped them: communication (a collective not hidden), a copy, or nothing (the device waited for the
    host: launch gaps, synchronisations). The largest gaps are listed with the compute kernels around them and, from
    ``host_ops`` (``(start_us, end_us, name)`` of the CPU operators and annotations), what the host ran meanwhile:
    the operators that overlap the gap most, leaving out those longer than four times the gap (their callers)."""
    compute, communication, copies = [], [], []
    for start, end, name in kernels:
        label = category(name)
        target = compute if label in COMPUTE else communication if label == "communication" else copies
        target.append((start, end, name))
    if not compute:
        return {"idle_s": 0.0, "communication_s": 0.0, "copy_s": 0.0, "host_s": 0.0, "gaps": []}
    first = min(start for start, _, _ in kernels)
    last = max(end for _, end, _ in kernels)
    busy = _union([(start, end) for start, end, _ in compute])
    comm_spans = _union([(start, end) for start, end, _ in communication])
    either_spans = _union([(start, end) for start, end, _ in communication + copies])
    ends = sorted((end, name) for _, end, name in compute)
    starts = sorted((start, name) for start, _, name in compute)
    edges = [first] + [x for span in busy for x in span] + [last]
    totals = {"idle_s": 0.0, "communication_s": 0.0, "copy_s": 0.0, "host_s": 0.0}
    gaps = []
    for gap in zip(edges[0::2], edges[1::2]):
        length = gap[1] - gap[0]
        if length < min_us:
            continue
        comm = _overlap(gap, comm_spans)
        anything = _overlap(gap, either_spans)
        totals["idle_s"] += length / 1e6
        totals["communication_s"] += comm / 1e6
        totals["copy_s"] += (anything - comm) / 1e6
        totals["host_s"] += (length - anything) / 1e6
        i = bisect.bisect_right(ends, (gap[0] + 1e-3, "\uffff")) - 1
        j = bisect.bisect_left(starts, (gap[1] - 1e-3, ""))
        before = ends[i][1] if i >= 0 else "(step start)"
        after = starts[j][1] if j < len(starts) else "(step end)"
        during = sorted({name[:60] for start, end, name in communication + copies if end > gap[0] and start < gap[1]})
        host = sorted(((min(gap[1], end) - max(gap[0], start), name) for start, end, name in host_ops or ()
                       if end > gap[0] and start < gap[1] and end - start <= 4 * length), reverse=True)
        gaps.append({"at_ms": (gap[0] - first) / 1e3, "ms": length / 1e3, "communication_ms": comm / 1e3,
                     "before": before[:80], "after": after[:80], "during": during[:4],
                     "host": list(dict.fromkeys(name[:60] for _, name in host))[:4]})
    gaps.sort(key=lambda g: -g["ms"])
    return {**totals, "gaps": gaps[:top]}


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"profiled step: wall {summary['wall_s']:.3f} s, compute kernels {summary['busy_s']:.3f} s "
             f"({100 * (summary['busy_fraction'] or 0):.1f}%), waiting {summary['wait_s']:.3f} s"]
    lines += [f"  {name:<22} {value:8.3f} s" for name, value in summary["device_s"].items()]
    lines += [f"  {name:<22} {value:8.3f} s (host)" for name, value in summary.get("host_stalls_s", {}).items()]
    python = summary.get("python")
    if python:
        lines.append("  host Python (rank 0, cProfile), by cumulative time:")
        lines += [f"  {r['cumulative_s']:8.3f} s {r['calls']:6d}x {r['function']}" for r in python["cumulative"]]
        lines.append("  by own time:")
        lines += [f"  {r['own_s']:8.3f} s {r['calls']:6d}x {r['function']}" for r in python["own"]]
    sites = summary.get("launch_sites")
    if sites:
        lines.append("  elementwise kernels by launch site:")
        lines += [f"  {x['seconds']:8.4f} s {x['calls']:5d}x {x['kernel'][:50]} | {x['op']} | {x['site']}"
                  for x in sites]
    idle = summary.get("idle")
    if idle:
        lines.append(f"  compute idle (gaps >= 20 us) {idle['idle_s']:.3f} s: during communication "
                     f"{idle['communication_s']:.3f} s, during copies {idle['copy_s']:.3f} s, nothing on the device "
                     f"{idle['host_s']:.3f} s; largest gaps:")
        lines += [f"  {g['ms']:8.2f} ms at {g['at_ms']:8.2f} ms (communication {g['communication_ms']:.2f}) "
                  f"{g['before'][:40]} -> {g['after'][:40]} | {', '.join(g['during'])} | host: "
                  f"{', '.join(g.get('host', []))}" for g in idle["gaps"]]
    lines.append("  top kernels:")
    lines += [f"  {k['seconds']:8.3f} s {k['calls']:6d}x {k['category']:<14} {k['name']}"
              for k in summary["top_kernels"]]
    return "\n".join(lines)


class StepProfiler:
    """Profiles step ``step`` of a run: ``start(i)`` / ``stop(i)`` around every step, acting only at ``step``.

    ``stop`` without a matching ``start`` raises ``RuntimeError``. Rank 0 writes ``{out_prefix}.json`` (the summary)
    and, when ``trace``, ``{out_prefix}.trace.json``; every rank puts its summary in ``sink["profile"]`` if given.
    ``python``: rank 0's host Python under cProfile too (:func:`python_hotspots`). It slows every Python call of the
    step, so where the host launches only a little ahead of the device (a short sequence) the device then waits for
    it: those gaps are the profiler's, not the run's. Off by default."""

    def __init__(self, step: Optional[int], out_prefix: str, *, device: torch.device, rank: int,
                 trace: bool = False, sink: Optional[dict] = None, python: bool = False) -> None:
        self.step, self.out_prefix, self.device, self.rank, self.trace = step, out_prefix, device, rank, trace
        self.sink, self.python = sink, python
        self._profile: Optional[profile] = None
        self._python: Optional[cProfile.Profile] = None
        self._start = 0.0
        self.summary: Optional[dict[str, Any]] = None

    def start(self, step: int) -> None:
        if step != self.step:
            return
        self._sync()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        # shapes: which tensors each kernel's operator had (launch_sites); no stacks: from Python 3.12 the profiler's
        # stack tracing and cProfile (the host's Python time, below) exclude each other. The step is timed apart.
        self._profile = profile(activities=activities, record_shapes=True)
        self._profile.__enter__()
        if self.rank == 0 and self.python:
            self._python = cProfile.Profile()
            try:
                self._python.enable()
            except ValueError:  # another profiling tool holds the interpreter's hook
                self._python = None
        self._start = time.perf_counter()

    def stop(self, step: int) -> None:
        if step != self.step:
            return
        if self._profile is None:
            raise RuntimeError(f"StepProfiler.stop({step}) called before start({step})")
        self._sync()
        wall = time.perf_counter() - self._start
        python = None
        if self._python is not None:
            self._python.disable()
            python, self._python = python_hotspots(self._python), None
        self._profile.__exit__(None, None, None)
        self.summary = summarize(self._profile.key_averages(), wall)
        events = self._profile.events()
        self.summary["idle"] = idle_gaps(device_events(events), host_ops=host_events(events))
        self.summary["launch_sites"] = launch_sites(events)
        if python is not None:
            self.summary["python"] = python
        if self.sink is not None:
            self.sink["profile"] = self.summary
        if self.rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(self.out_prefix)), exist_ok=True)
            with open(f"{self.out_prefix}.json", "w") as f:
                json.dump(self.summary, f, indent=1)
            if self.trace:
                self._profile.export_chrome_trace(f"{self.out_prefix}.trace.json")
            print(format_summary(self.summary), flush=True)
        self._profile = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

