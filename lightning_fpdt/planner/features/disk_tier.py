"""The disk tier (``FPDTStrategy(offload_dir=...)``, offload/disk/): checkpointed block inputs beyond the host
budget go to files on a local disk instead of pinned host memory.

Memory: ``disk_inputs = k`` block inputs per GPU move from the pinned host column to the disk column (``k·A``), and
the writer's and the reader's staging buffers are pinned beside the rest (``offload.disk.staging_bytes(A)``: two each
of ``min(256 MiB, A)``; an input streams through them a piece at a time). At run time the inputs that spill are the
last ``k`` of the forward: the stash keeps an input in host memory while its buffers stay within the budget, the
plan's ``(L - k)·A``. A written-behind input stays on the GPU until it is on the disk, within its own block's forward:
the next ``put`` to disk waits for it, so the GPU holds no more inputs than without the disk (the wait is the time
counted below).

Cost: each spilled input is written once, behind its own block's forward, and read once, ahead, during the attention
backward of the block after it (``ActivationOffload``'s one-block prefetch); a disk slower than that compute shows as
the difference. The input of the first block of the backward is read right after the loss, which covers nothing of
it; without the prefetch every read is waited for, and an input the backward reads twice (``backward_reads``: left on
the host through its block's backward) is read a second time for its first norm's backward, waited for too. The
disk's rate is its host's, shared by the host's GPUs.

The search does not try every ``k``: a plan that overshoots only the host's memory, with the disk's room left, is
relieved by the least ``k`` that fits it (:meth:`DiskTier.relieve`), which the search plans in its turn of cost. A
plan with RAM enough never spills (``k = 0`` costs nothing), so the disk is chosen only when host memory does not
suffice for the faster configurations, and against the other ways of needing less (recomputing the attention, ...)
by cost.

The attention stash is not planned on disk: its forward reads each kv chunk once for every later q chunk and its
backward each q-side chunk once for every earlier kv chunk, ``u/2`` reads of every byte, against one for a block
input. At run time its pool spills only beyond what the plan holds for it.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from lightning_fpdt.offload.disk import STAGING_DEPTH, STAGING_PIECE_BYTES, staging_bytes
from lightning_fpdt.planner.components import Component, MemoryPlan
from lightning_fpdt.planner.cost import block_forward_seconds, layer_attention_seconds
from lightning_fpdt.planner.features.base import Flag, MemoryFeature, auto_or_int
from lightning_fpdt.planner.features.block_inputs import backward_reads
from lightning_fpdt.planner.step_sizes import StepSizes

DISK_GBPS = 1.5
"""The disk's read and write rate the command plans with by default, GB/s: a local NVMe of an H200 host, measured
with ``dd`` (direct I/O: writes 1.5, reads 1.6) and through Python (``os.write`` + ``fsync`` of 2 GiB: 1.36)."""
OFFLOAD_DIR_ARGUMENT = "<a directory on a local disk>"
"""What the arguments say for ``offload_dir`` (the planner plans a disk's size and rate, not a path)."""


class DiskTier(MemoryFeature):
    fields = ("disk_inputs",)
    neutral = {"disk_inputs": 0}
    flags = (Flag(option="disk_inputs", parse=auto_or_int, default="auto",
                  help="block inputs per GPU in files of the disk tier (with --disk-gib), or auto: as many as the "
                       "host's memory needs"),)

    def describe_cost(self, s: StepSizes) -> str:
        return f"disk tier: {s.o.disk_inputs} block inputs written and read, the time compute does not cover"

    def choices(self, field: str, s: StepSizes) -> tuple[Any, ...]:
        return (s.o.disk_inputs,)  # resolved from the plan by relieve, not enumerated

    def normalise(self, changes: dict[str, Any]) -> Optional[dict[str, Any]]:
        if not changes["activation_offload"]:
            changes["disk_inputs"] = 0  # only block inputs in host memory spill
        return changes

    def components(self, s: StepSizes) -> list[Component]:
        k = s.o.disk_inputs
        if not k:
            return []
        return [Component("block inputs on disk", 0, disk_bytes=k * s.A,
                          formula="the last k of the forward, one file each"),
                Component("disk staging buffers", 0, staging_bytes(s.A),
                          formula=f"the writer's and the reader's {STAGING_DEPTH} pieces of at most "
                                  f"{STAGING_PIECE_BYTES // 2**20} MiB, between the device and the files")]

    def extra_seconds(self, s: StepSizes) -> float:
        o, k = s.o, s.o.disk_inputs
        if not k:
            return 0.0
        if s.disk_rate <= 0:
            return math.inf  # no disk planned: never chosen
        io = s.A / s.disk_rate  # one block input written, or read
        block_forward = layer_attention_seconds(s, "forward") + block_forward_seconds(s)
        attention_backward = layer_attention_seconds(s, "backward")
        seconds = k * max(0.0, io - block_forward)  # written behind the block's forward
        seconds += io  # the first input of the backward: read after the loss, nothing covers it
        seconds += (k - 1) * (max(0.0, io - attention_backward) if o.prefetch else io)
        seconds += (backward_reads(o) - 1) * k * io  # read again for the first norm's backward, when it is needed
        return seconds

    def relieve(self, plan: MemoryPlan, s: StepSizes) -> Optional[dict[str, Any]]:
        if plan.disk_memory_bytes is None or not plan.fits_gpu:
            return None
        k = spilled_inputs(plan, s)
        if k is None or k * s.A * plan.gpus_per_node > plan.disk_memory_bytes:
            return None
        return {"disk_inputs": k}

    def arguments(self, s: StepSizes) -> dict[str, dict[str, Any]]:
        return {"FPDTStrategy": {"offload_dir": OFFLOAD_DIR_ARGUMENT}} if s.o.disk_inputs else {}


def spilled_inputs(plan: MemoryPlan, s: StepSizes) -> Optional[int]:
    """The least ``disk_inputs`` with which ``plan`` (its sizes ``s``) fits the host's memory, whatever the disk has;
    ``None`` where block inputs cannot relieve it (the host fits, the inputs are not offloaded, or all of them on
    disk are not enough)."""
    o = s.o
    if not o.activation_offload or o.checkpoint_blocks != "all" or plan.host_memory_bytes is None or plan.fits_host:
        return None
    over = math.ceil((plan.host_resident_bytes_per_node - plan.host_memory_bytes) / plan.gpus_per_node)
    staging = 0 if o.disk_inputs else staging_bytes(s.A)  # the first spill adds the staging buffers
    k = o.disk_inputs + math.ceil((over + staging) / s.A)
    return None if k > s.resident_inputs else k
