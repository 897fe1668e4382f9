"""Host memory of a training step, read beside the GPU's: the process's peak resident memory within a span of the step,
the pinned bytes it holds, and the memory plan the run was accepted on.

- :class:`ResidentPeaks` gives the peak resident memory (RSS: pinned and pageable pages alike) of this process within
  each span between two calls: ``lightning_fpdt.offload.host_memory.reset_peak_resident`` starts a new peak at a
  boundary and ``peak_resident_bytes`` reads it at the next (``"peak"``). Where the kernel refuses the reset, the span's
  figure is the larger of the resident memory read at its two boundaries (``"sampled"``), a lower bound of its peak.
- :func:`pinned_bytes` is what the process holds page-locked: the fpdt strategy's exact count of its own buffers
  (``FPDTStrategy.pinned_host_bytes``) plus the blocks of PyTorch's caching host allocator
  (``torch.cuda.memory.host_memory_stats()["allocated_bytes.current"]``: FSDP2's CPU offload, DeepSpeed's buffers,
  ``Tensor.pin_memory()``).
- :func:`plan_fields` reads the strategy's ``memory_plan`` (a ``lightning_fpdt.planner.MemoryPlan``) into record
  fields, per GPU: the planned peak GPU bytes, pinned host bytes and resident host bytes.

The fpdt strategy's ``pinned_host_bytes`` and ``memory_plan`` are read with ``getattr``: a strategy without them gives
``None`` for what only it can say.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lightning_fpdt.offload import host_memory
from lightning_fpdt.planner.search import estimated_step_seconds

PHASES = ("forward", "backward", "optimizer")
"""The spans of a Lightning training step: start of batch to ``on_before_backward``, to ``on_after_backward``, to
``on_train_batch_end``."""


class ResidentPeaks:
    """The peak resident memory of this process within spans of its run, in bytes.

    ``start()`` opens a span, ``split()`` closes it and opens the next, ``stop()`` closes it; both return the span's
    peak (``None`` off Linux). :attr:`reading` says how the spans were read: ``"peak"`` (the kernel's high-water mark
    from the span's start) or ``"sampled"`` (some span fell back to its boundaries' readings). :attr:`lifetime_peak` is
    the process's peak since it started, as the high-water mark read before any reset would give it."""

    def __init__(self) -> None:
        self.reading: Optional[str] = None
        # the peak before the first reset: the resets below would otherwise hide it from later readers
        self.lifetime_peak: Optional[int] = host_memory.peak_resident_bytes()
        self._start: Optional[int] = None
        self._reset = False
        self._open = False

    def start(self) -> None:
        """Open a span here."""
        self._start = host_memory.resident_bytes()
        self._reset = host_memory.reset_peak_resident()
        method = "peak" if self._reset else "sampled"
        self.reading = method if self.reading in (None, method) else "sampled"
        self._open = True

    def stop(self) -> Optional[int]:
        """Close the span: its peak in bytes (``None`` where nothing could be read, or no span was open)."""
        if not self._open:
            return None
        self._open = False
        now = host_memory.resident_bytes()
        candidates = [self._start, now]
        if self._reset:
            candidates.append(host_memory.peak_resident_bytes())
        readings = [value for value in candidates if value is not None]
        peak = max(readings) if readings else None
        if peak is not None:
            self.lifetime_peak = peak if self.lifetime_peak is None else max(self.lifetime_peak, peak)
        return peak

    def split(self) -> Optional[int]:
        """Close the span (its peak in bytes) and open the next one here."""
        peak = self.stop()
        self.start()
        return peak


def caching_allocator_pinned_bytes() -> int:
    """Bytes of the page-locked blocks PyTorch's caching host allocator owns (in use and cached, as rounded when they
    were pinned); 0 without CUDA, where nothing can be pinned."""
    if not torch.cuda.is_available():
        return 0
    stats = getattr(torch.cuda.memory, "host_memory_stats", None)
    if stats is None:
        return 0  # a torch without the reading; its caching host allocator is then not counted
    return int(stats().get("allocated_bytes.current", 0))


def pinned_bytes(strategy: Any, *, fpdt: bool) -> dict[str, Optional[int]]:
    """The page-locked host bytes this process holds now:

    ``pinned_host_bytes``: the two below together (``None`` when the strategy's share is unknown);
    ``pinned_host_bytes_strategy``: the fpdt strategy's own buffers (``strategy.pinned_host_bytes``; 0 for other
    systems, which do not use this library's host buffers; ``None`` for an fpdt strategy without the count);
    ``pinned_host_bytes_caching_allocator``: :func:`caching_allocator_pinned_bytes`."""
    own = getattr(strategy, "pinned_host_bytes", None) if fpdt else 0
    torch_blocks = caching_allocator_pinned_bytes()
    return {
        "pinned_host_bytes": None if own is None else int(own) + torch_blocks,
        "pinned_host_bytes_strategy": None if own is None else int(own),
        "pinned_host_bytes_caching_allocator": torch_blocks,
    }


PLAN_FIELDS = ("planned_peak_gpu_bytes", "planned_pinned_host_bytes", "planned_resident_host_bytes",
               "planned_disk_bytes", "peak_disk_bytes", "plan_options", "estimated_step_s", "estimate_rates")


def plan_fields(strategy: Any) -> dict[str, Any]:
    """The plan the run was accepted on (``strategy.memory_plan``), per GPU, as record fields (all ``None`` without
    one): ``planned_peak_gpu_bytes`` (``MemoryPlan.peak_gpu_bytes``), ``planned_pinned_host_bytes``
    (``host_bytes_per_gpu``: the pinned host bytes of one GPU's process), ``planned_resident_host_bytes``
    (``host_resident_bytes_per_gpu``: pinned, pageable and the process baseline of one GPU's process),
    ``planned_disk_bytes`` (``disk_bytes_per_gpu``: the block inputs the plan puts in ``offload_dir``) and
    ``plan_options`` (``options.describe()``: the options the plan resolved), ``estimated_step_s`` (the planner's
    step-time model's step of the plan, ``lightning_fpdt.planner.search.estimated_step_seconds``) and
    ``estimate_rates`` (the rates it was timed at: this GPU's calibration, or the built-in table); and, measured,
    ``peak_disk_bytes``: the most bytes this process's spill files held at once (``None`` without a disk tier)."""
    plan = getattr(strategy, "memory_plan", None)
    if plan is None:
        return dict.fromkeys(PLAN_FIELDS)
    resident = getattr(plan, "host_resident_bytes_per_gpu", None)
    disk = getattr(getattr(strategy, "memory", None), "disk", None)
    return {
        "planned_peak_gpu_bytes": int(plan.peak_gpu_bytes),
        "planned_pinned_host_bytes": int(plan.host_bytes_per_gpu),
        "planned_resident_host_bytes": None if resident is None else int(resident),
        "planned_disk_bytes": int(plan.disk_bytes_per_gpu),
        "peak_disk_bytes": None if disk is None else int(disk.peak_bytes_on_disk),
        "plan_options": plan.options.describe(),
        "estimated_step_s": estimated_step_seconds(plan),
        "estimate_rates": plan.rates.source,
    }


def largest(values: Any) -> Optional[int]:
    """The largest of ``values`` that is known, or ``None``."""
    known = [v for v in values if v is not None]
    return max(known) if known else None
