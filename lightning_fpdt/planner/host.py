"""The pinned host memory a plan needs against what this host has: what the strategy checks before any pinned
buffer exists (pinned-memory exhaustion takes the machine down, not just the job)."""

from __future__ import annotations

from typing import Optional

from lightning_fpdt.planner.components import GIB, MemoryPlan


def gib(nbytes: Optional[int]) -> str:
    return "-" if nbytes is None else f"{nbytes / GIB:.2f}"


def available_host_memory() -> Optional[int]:
    """Bytes of memory this host can still give (``MemAvailable`` of /proc/meminfo; psutil elsewhere), or ``None``."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file says kB and means KiB
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def check_host_memory(plan: MemoryPlan, available_bytes: Optional[int]) -> None:
    """``ValueError`` with the numbers when the pinned host memory the plan needs per host exceeds ``available_bytes``
    (pinned memory cannot be swapped: exhausting it takes the machine down, not just the job). ``None``: unknown, no
    check."""
    if available_bytes is None or plan.host_bytes_per_node <= available_bytes:
        return
    parts = ", ".join(f"{c.name} {gib(c.host_bytes)}" for c in plan.components if c.host_bytes)
    fix = plan.recommendation if plan.recommended is not None else (
        "fewer GPUs' worth of tokens per host: more hosts, a shorter sequence, or less offload "
        "(ActivationOffload(offload=False), offload=False) if the GPUs have room"
    )
    raise ValueError(
        f"this run needs {gib(plan.host_bytes_per_node)} GiB of pinned host memory per host "
        f"({plan.gpus_per_node} GPUs x {gib(plan.host_bytes_per_gpu)} GiB: {parts} GiB) but the host has "
        f"{gib(available_bytes)} GiB available; pinned-memory exhaustion takes the machine down, so the run is "
        f"refused. S = {plan.seq_len:,}, {plan.options.describe()}. Fix: {fix}"
    )
