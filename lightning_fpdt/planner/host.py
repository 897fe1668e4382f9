"""The host memory a plan needs against what this host has: what the strategy checks before any pinned buffer
exists (pinned pages cannot be swapped: exhausting them takes the machine down, not just the job)."""

from __future__ import annotations

from typing import Optional

from lightning_fpdt.offload.host_memory import available_host_memory
from lightning_fpdt.planner.components import GIB, MemoryPlan

__all__ = ["available_host_memory", "check_host_memory", "gib", "host_parts"]


def gib(nbytes: Optional[int]) -> str:
    return "-" if nbytes is None else f"{nbytes / GIB:.2f}"


def host_parts(plan: MemoryPlan) -> str:
    """The host components of a plan per GPU, in GiB: ``checkpointed block inputs 84.00, ...``."""
    return ", ".join(f"{c.name} {gib(c.host_bytes + c.pageable_bytes)}" for c in plan.components
                     if c.host_bytes or c.pageable_bytes)


def check_host_memory(plan: MemoryPlan, available_bytes: Optional[int]) -> None:
    """``ValueError`` with the numbers when the host memory the plan needs per host (pinned, pageable and the
    processes' baseline) exceeds ``available_bytes``. ``None``: unknown, no check."""
    if available_bytes is None or plan.host_resident_bytes_per_node <= available_bytes:
        return
    fix = plan.recommendation if plan.recommended is not None else (
        "fewer GPUs' worth of tokens per host: more hosts, a shorter sequence, or less offload "
        "(ActivationOffload(offload=False), offload=False) if the GPUs have room"
    )
    raise ValueError(
        f"this run needs {gib(plan.host_resident_bytes_per_node)} GiB of host memory per host, "
        f"{gib(plan.host_bytes_per_node)} GiB of it pinned ({plan.gpus_per_node} GPUs x "
        f"{gib(plan.host_resident_bytes_per_gpu)} GiB: {host_parts(plan)} GiB) but the host has "
        f"{gib(available_bytes)} GiB available; pinned-memory exhaustion takes the machine down, so the run is "
        f"refused. S = {plan.seq_len:,}, {plan.options.describe()}. Fix: {fix}"
    )
