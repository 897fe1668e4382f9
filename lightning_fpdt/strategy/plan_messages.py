"""What a run's memory plan says to its user: the refusal of a run that fits neither memory (naming what binds and
the change that fits), the choice made for a length, and the advice of a host that ran short of memory."""

from __future__ import annotations

from typing import Optional

from lightning_fpdt.planner.arguments import python_arguments
from lightning_fpdt.planner.components import MemoryPlan
from lightning_fpdt.planner.host import gib
from lightning_fpdt.planner.search import estimated_step_seconds


def refusal(plan: Optional[MemoryPlan], offload_dir: Optional[str] = None) -> Optional[ValueError]:
    """The error refusing a run whose plan fits the GPU, the host or the disk not, naming what binds and the change
    that fits; ``None`` when it fits or nothing was planned. ``offload_dir``: the disk tier's directory, named."""
    if plan is None or plan.fits:
        return None
    limit = {"gpu memory": "GPU", "disk space": "disk"}.get(plan.binding_limit, "host")
    fix = plan.recommendation
    if plan.recommended is not None:
        fix += "; that is\n" + python_arguments(plan.recommended)
    return ValueError(
        f"fpdt: this run does not fit the {limit} memory: S = {plan.seq_len:,} tokens needs "
        f"{gib(plan.peak_gpu_bytes)} GiB per GPU (of {gib(plan.gpu_memory_bytes)}) and "
        f"{gib(plan.host_resident_bytes_per_node)} GiB of host memory per host, {gib(plan.host_bytes_per_node)} of "
        f"it pinned (of {gib(plan.host_memory_bytes)} GiB the host can give)"
        + (f", {gib(plan.disk_bytes_per_node)} GiB per host on disk in {offload_dir!r} (of "
           f"{gib(plan.disk_memory_bytes)} GiB free)" if plan.disk_bytes_per_node or offload_dir else "")
        + f", with {plan.options.describe()}. Fix: {fix}. The plan: `lightning-fpdt plan` prints it; "
          f"FPDTStrategy(check_memory=False) runs it anyway."
    )


def choice_message(plan: MemoryPlan) -> str:
    """What the run was planned to, in a few lines: the options, the peaks against the limits, what binds."""
    binding = "nothing binds" if plan.binding_limit == "fits" else plan.binding_limit
    host = "unchecked" if plan.host_memory_bytes is None else f"of {gib(plan.host_memory_bytes)}"
    disk = ("" if plan.disk_memory_bytes is None else
            f"disk {gib(plan.disk_bytes_per_node)} GiB per host of {gib(plan.disk_memory_bytes)} free; ")
    return (
        f"fpdt: S = {plan.seq_len:,} planned with {plan.options.describe()}\n"
        f"  predicted peak {gib(plan.peak_gpu_bytes)} GiB per GPU of {gib(plan.gpu_memory_bytes)}; host "
        f"{gib(plan.host_resident_bytes_per_node)} GiB per host ({gib(plan.host_bytes_per_node)} pinned) {host}; "
        f"{disk}{binding}\n  estimated step {estimated_step_seconds(plan):,.2f} s ({plan.rates.source})\n"
        f"  as arguments:\n" + "\n".join("    " + line for line in python_arguments(plan).splitlines())
    )


def host_shortfall_advice(plan: Optional[MemoryPlan]) -> str:
    """What the error of a host that ran short says: the plan the run was accepted on (``None``: none was made) and
    how to need less."""
    if plan is None:
        return "No plan was made for this run (no GPU or no model config): plan it with `lightning-fpdt plan`."
    return (f"The run was accepted on this plan: {gib(plan.host_resident_bytes_per_node)} GiB per host "
            f"({gib(plan.host_bytes_per_node)} pinned), {plan.options.describe()}. The host had less than "
            f"planned (another process took memory, or the plan is short for this model): free memory on the "
            f"host, or need less: ActivationOffload(recompute_attention=True), fewer GPUs per host, a shorter "
            f"sequence. `lightning-fpdt plan --host-memory-gib auto` shows what fits.")
