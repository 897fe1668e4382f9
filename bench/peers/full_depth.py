"""The full-depth ballast (``--ballast full``): run ``L`` layers of a model and hold, for the layers not run, everything
the plan of the full depth keeps for them, on the GPU, in host memory and on disk, so that a record of ``L`` layers
says "this length fits the full depth on this machine" and proves it.

For ``fpdt`` and ``fpdt-hf`` the planner (``lightning_fpdt.planner.plan_memory``) plans the full depth on this
machine: the GPU the run may use, the host memory available when it starts, the free space of ``--offload-dir``;
options left "auto" (``--auto-options``, ``--keep-inputs auto``) are resolved there, for the full depth, and the run
trains its ``L`` layers with those options given explicitly (every block input kept: the run's own layers are not the
ones a residency schedule drops). The same planner plans the ``L`` layers with those options; what the full depth
needs beyond them is held while the run trains:

- GPU: one tensor of the difference of the two plans' peaks;
- host: page-locked bytes of the difference of the pinned columns (block inputs, staging buffers, host-resident
  parameter shards of the layers not run), through the package's exact host allocator, and touched pageable bytes of
  the difference of the pageable columns (host-resident gradients and AdamW moments);
- disk: a file of the full depth's disk bytes in ``--offload-dir``, its blocks allocated (``posix_fallocate``) when
  training starts and removed when the run ends. The spill files it stands for exist only during a step, so the
  strategy's setup checks (a checkpoint folder on the same file system has room for one checkpoint) see the disk as
  a full-depth run sees them.

A schedule that drops block inputs regenerates them in the backward: blocks the run does not have cannot be run, so
that work is counted in the time instead. The record's ``full_depth.step_time_s`` is the measured step scaled by the
planner's estimate of the full depth's step over the run's (``lightning_fpdt.planner.step_seconds``: every layer's
attention and dense work, the regenerating forwards, the disk's uncovered time), beside the count of regenerated
block forwards.

``alst`` keeps every checkpointed block input in host memory (DeepSpeed's CPU checkpointing): the layers not run hold
``S/W·h`` bytes each there, and their offloaded states with ``--cpu-offload-params``.

A full depth this machine cannot hold as planned (the fpdt plan fits nothing; ALST's host memory, as ``--check-host``
models it, exceeds the host less the reserve) is :class:`FullDepthRefused`, which the run records as out of memory
at the binding limit without holding anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from bench.peers.ballast import (
    GIB,
    ON_OFF_AUTO,
    count_option,
    host_check,
    layers_run,
    ring_size_option,
    run_ballast,
    sequence_parallel_option,
    state_bytes_per_parameter,
)
from lightning_fpdt.flops import ModelGeometry
from lightning_fpdt.offload.host_memory import HostAllocator
from lightning_fpdt.planner import PRECISIONS, MemoryPlan, parameter_counts, plan_memory
from lightning_fpdt.planner.arguments import arguments
from lightning_fpdt.planner.calibration import cached_rates
from lightning_fpdt.planner.machine import machine_limits
from lightning_fpdt.planner.phases import plan_sizes
from lightning_fpdt.planner.search import step_seconds

PINNED_PIECE = 2**30
"""The page-locked ballast is held in buffers of this many bytes at most."""
BALLAST_FILE = "full-depth-ballast-rank{rank}.bin"
"""The disk ballast's file in ``--offload-dir``, one per rank."""


class FullDepthRefused(ValueError):
    """The full depth does not fit this machine as planned; ``limit`` names the memory that binds (``"gpu"``,
    ``"host"`` or ``"disk"``). The run records it as out of memory there (planned), without holding or training
    anything: a length the machine cannot hold is a failed length, and holding it would end with the kernel's
    out-of-memory killer, which leaves no record."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


LIMITS = {"gpu memory": "gpu", "host memory": "host", "disk space": "disk"}
"""A plan's ``binding_limit`` as a record's ``limit``."""


@dataclass(frozen=True)
class FullDepth:
    """What the run holds for the layers it does not run, and the plans it was measured against."""

    gpu_bytes: int
    pinned_bytes: int
    pageable_bytes: int
    disk_bytes: int
    plan: Optional[MemoryPlan] = None
    """fpdt: the full depth's plan on this machine, its options resolved."""
    run_plan: Optional[MemoryPlan] = None
    """fpdt: the plan of the layers run with the same options, every input kept, nothing on disk."""

    def strategy_arguments(self) -> dict[str, dict[str, Any]]:
        """``{"FPDTStrategy": {...}, "ActivationOffload": {...}}`` the run trains with: the full plan's options,
        every block input of the layers run kept, no disk tier (the disk ballast stands for the full depth's), the
        blocks checkpointed as the layers run's plan has them (:func:`checkpointed_run_blocks`)."""
        chosen = arguments(self.plan)
        chosen["FPDTStrategy"].pop("offload_dir", None)
        offload = chosen.setdefault("ActivationOffload", {})
        offload["keep_inputs"] = "all"
        if "checkpoint_blocks" in offload:
            offload["checkpoint_blocks"] = self.run_plan.options.checkpoint_blocks
        return chosen

    def record(self, step_time_s: Optional[float]) -> dict[str, Any]:
        """The record's ``full_depth`` field."""
        held = {"gpu_bytes": self.gpu_bytes, "pinned_bytes": self.pinned_bytes, "pageable_bytes": self.pageable_bytes,
                "disk_bytes": self.disk_bytes}
        if self.plan is None:
            return {"held": held}
        full, run = self.plan, self.run_plan
        ratio = step_seconds(plan_sizes(full)) / step_seconds(plan_sizes(run))
        o = full.options
        return {
            "held": held,
            "options": arguments(full),
            "kept_inputs": full.geometry.num_layers if o.keep_inputs == "all" else o.keep_inputs,
            "disk_inputs": o.disk_inputs,
            "checkpoint_blocks": full.geometry.num_layers if o.checkpoint_blocks == "all" else o.checkpoint_blocks,
            "run_checkpoint_blocks": run.options.checkpoint_blocks,
            "regenerated_block_forwards": 0 if o.keep_inputs == "all" else full.geometry.num_layers - o.keep_inputs,
            "planned_peak_gpu_bytes": full.peak_gpu_bytes, "planned_pinned_bytes": full.host_bytes_per_gpu,
            "planned_resident_bytes": full.host_resident_bytes_per_gpu,
            "planned_disk_bytes": full.disk_bytes_per_gpu,
            "estimated_step_ratio": ratio,
            "estimated_step_s": step_seconds(plan_sizes(full)),
            "step_time_s": None if step_time_s is None else step_time_s * ratio,
        }


def plan_fpdt(args: argparse.Namespace, geometry: ModelGeometry, *, num_gpus: int, gpus_per_node: int,
              gpu_memory_bytes: Optional[int], available_host: Optional[int],
              disk_free: Optional[int]) -> tuple[MemoryPlan, MemoryPlan]:
    """``(full depth's plan, the layers run's plan)``; ``ValueError`` naming the planner's answer when the full depth
    fits nothing on this machine."""
    auto = getattr(args, "auto_options", False)
    # the machine as the strategy plans against it: the GPU less the context and fragmentation, the host's available
    # memory less the reserve it keeps, the disk's free space
    machine = machine_limits(num_gpus=num_gpus, gpus_per_node=gpus_per_node, usable_gpu_bytes=gpu_memory_bytes,
                             available_host_bytes=available_host, disk_free=disk_free, disk_gbps=args.disk_gbps)
    # the step times of this GPU where it was calibrated (the strategy's run plans with them too)
    sp = sequence_parallel_option(args)
    rates = cached_rates(None, group_size=gpus_per_node if sp == "auto" else sp)
    common = dict(seq_len=args.seq_len, num_gpus=num_gpus, gpus_per_node=gpus_per_node,
                  sequence_parallel_size=sequence_parallel_option(args), ring_size=ring_size_option(args),
                  activation_offload=True,
                  tiled_mlp=True, tiled_loss=True, precision=args.precision, cpu_offload_params=args.cpu_offload_params)
    full = plan_memory(
        geometry=geometry, **common, gpu_memory_gib=machine.gpu_memory_gib, host_memory_gib=machine.host_memory_gib,
        disk_memory_gib=machine.disk_memory_gib, disk_gbps=machine.disk_gbps, rates=rates,
        chunks=args.chunks, offload="auto" if auto else ON_OFF_AUTO[args.offload],
        offload_dq="auto" if auto else ON_OFF_AUTO[args.offload_dq],
        head_chunks="auto" if auto else args.head_chunks,
        recompute_attention="auto" if auto else args.recompute_attention,
        reload_input="auto" if auto else args.reload_input,
        prefetch="auto" if auto else args.prefetch,
        keep_inputs=count_option(args, "keep_inputs"), checkpoint_blocks=count_option(args, "checkpoint_blocks"),
    )
    if not full.fits:
        raise FullDepthRefused(f"{args.model} at full depth ({geometry.num_layers} layers), {args.seq_len:,} tokens: "
                               f"{full.recommendation}", LIMITS.get(full.binding_limit, "gpu"))
    o = full.options
    run = plan_memory(
        geometry=dataclasses.replace(geometry, num_layers=layers_run(args)), **common,
        gpu_memory_gib=machine.gpu_memory_gib, rates=rates,
        chunks=o.chunks, offload=o.offload, offload_dq=o.offload_dq, head_chunks=o.head_chunks,
        recompute_attention=o.recompute_attention, reload_input=o.reload_input, prefetch=o.prefetch,
        keep_inputs="all", checkpoint_blocks=checkpointed_run_blocks(o.checkpoint_blocks, geometry.num_layers,
                                                                     layers_run(args)),
    )
    return full, run


def checkpointed_run_blocks(full: Any, full_layers: int, run_layers: int) -> Any:
    """The blocks the layers run checkpoint, of a full depth that checkpoints ``full`` (``"all"`` or a count) of its
    ``full_layers``: as many left plain as the full depth's share of plain blocks allows, rounded down, so the run
    never saves more recompute than the full depth does (its step is then scaled by the two plans' estimates)."""
    if full == "all":
        return "all"
    plain = (full_layers - full) * run_layers // full_layers
    return "all" if plain == 0 else run_layers - plain


def _pageable(plan: MemoryPlan) -> int:
    return sum(c.pageable_bytes for c in plan.components)


def full_depth_ballast(args: argparse.Namespace, geometry: ModelGeometry, *, world_size: int, gpus_per_node: int,
                       gpu_memory_bytes: Optional[int], available_host: Optional[int],
                       disk_free: Optional[int]) -> FullDepth:
    """What ``--ballast full`` holds for the layers not run (see the module docstring)."""
    if args.system in ("fpdt", "fpdt-hf"):
        full, run = plan_fpdt(args, geometry, num_gpus=world_size, gpus_per_node=gpus_per_node,
                              gpu_memory_bytes=gpu_memory_bytes, available_host=available_host, disk_free=disk_free)
        return FullDepth(
            gpu_bytes=max(0, full.peak_gpu_bytes - run.peak_gpu_bytes),
            pinned_bytes=max(0, full.host_bytes_per_gpu - run.host_bytes_per_gpu),
            pageable_bytes=max(0, _pageable(full) - _pageable(run)),
            disk_bytes=full.disk_bytes_per_gpu, plan=full, run_plan=run)
    if args.system != "alst":
        raise ValueError(f"--ballast full plans the host and disk of fpdt, fpdt-hf and alst; {args.system} keeps its "
                         f"block inputs on the GPU: use --ballast auto")
    missing = geometry.num_layers - layers_run(args)
    act = PRECISIONS[args.precision]["act"]
    block, _rest = parameter_counts(geometry)
    host_states = missing * block * state_bytes_per_parameter(args.precision) // world_size \
        if args.cpu_offload_params else 0
    if available_host is not None:
        check = host_check(args, num_gpus=world_size, gpus_per_node=gpus_per_node, resolved={},
                           gpu_memory_bytes=gpu_memory_bytes,
                           available_bytes=machine_limits(num_gpus=world_size, gpus_per_node=gpus_per_node,
                                                          available_host_bytes=available_host).host_memory_bytes)
        if not check["fits"]:
            raise FullDepthRefused(
                f"alst at full depth ({geometry.num_layers} layers), {args.seq_len:,} tokens: its host memory is "
                f"{check['resident_bytes'] / GIB:.2f} GiB per host (pinned {check['needed_bytes'] / GIB:.2f}: every "
                f"block input and the offloaded states), {check['available_bytes'] / GIB:.2f} GiB available less the "
                f"reserve", "host")
    return FullDepth(gpu_bytes=run_ballast(args, geometry, world_size)[0],
                     pinned_bytes=missing * (args.seq_len // world_size) * geometry.hidden_size * act,
                     pageable_bytes=host_states, disk_bytes=0)


class HeldBallast:
    """The ballast held: a GPU tensor and page-locked and touched pageable host buffers from the start, a file of
    allocated blocks from :meth:`hold_disk`. ``release`` (idempotent) gives all of it back and removes the file."""

    def __init__(self, ballast: FullDepth, *, device: torch.device, offload_dir: Optional[str], rank: int) -> None:
        self.gpu = torch.empty(ballast.gpu_bytes, dtype=torch.uint8, device=device) if ballast.gpu_bytes else None
        self.allocator = HostAllocator(pin=device.type == "cuda")
        # in buffers of PINNED_PIECE bytes, as the pools it stands for hold many buffers, not one
        pieces = [min(PINNED_PIECE, ballast.pinned_bytes - start) for start in range(0, ballast.pinned_bytes,
                                                                                     PINNED_PIECE)]
        self.pinned = [self.allocator.empty(n, torch.uint8, "the full-depth ballast") for n in pieces]
        if not self.allocator.pin:
            for piece in self.pinned:
                piece.fill_(1)  # resident, as the buffers it stands for are once written (registering pins pages)
        self.pageable = torch.ones(ballast.pageable_bytes, dtype=torch.uint8) if ballast.pageable_bytes else None
        self.path: Optional[str] = None
        self.disk_bytes = ballast.disk_bytes
        self.disk_held = False
        if self.disk_bytes:
            if offload_dir is None:
                raise ValueError(f"the full depth puts {ballast.disk_bytes / GIB:.2f} GiB per GPU on disk: give "
                                 f"--offload-dir")
            self.path = os.path.join(offload_dir, BALLAST_FILE.format(rank=rank))

    def hold_disk(self) -> None:
        """Take the disk ballast's blocks (``posix_fallocate``: not a sparse file); at the start of training, after
        the strategy's setup, as a full-depth run's spill files appear only in its first step. Idempotent."""
        if self.path is None or self.disk_held:
            return
        self.disk_held = True  # from here release removes the file, whole or not
        fd = os.open(self.path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.disk_bytes)
        finally:
            os.close(fd)

    def release(self) -> None:
        for piece in self.pinned or []:
            self.allocator.release(piece)
        self.gpu = self.pinned = self.pageable = None
        self.allocator.close()
        if self.disk_held and os.path.exists(self.path):
            os.remove(self.path)
        self.path, self.disk_held = None, False


DISK_SHARE = 0.95
"""Of ``--offload-dir``'s free space, what the full depth is planned with: the file system keeps some room."""


def disk_free_bytes(offload_dir: Optional[str]) -> Optional[int]:
    """:data:`DISK_SHARE` of the free space of ``--offload-dir`` (created if missing); ``None`` without one."""
    if offload_dir is None:
        return None
    os.makedirs(offload_dir, exist_ok=True)
    stat = os.statvfs(offload_dir)
    return int(stat.f_bavail * stat.f_frsize * DISK_SHARE)
