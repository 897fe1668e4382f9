"""The machine a run is on, read once: the GPU memory a plan may fill, the host memory this host's processes may
hold, what one process holds already, the reserve left to the rest of the host, the disk tier's free space. The
strategy and the benchmarks plan against :func:`machine_limits`; nothing else reads these."""

from __future__ import annotations

import shutil
from typing import Optional

import torch

from lightning_fpdt.offload.host_memory import available_host_memory, resident_bytes
from lightning_fpdt.planner.components import GIB, expandable_segments, plannable_gpu_bytes
from lightning_fpdt.planner.features.disk_tier import DISK_GBPS
from lightning_fpdt.planner.request import Machine

HOST_RESERVE_FRACTION = 0.03
"""Share of the host's memory no plan may take (at least :data:`HOST_RESERVE_MIN_BYTES`): the kernel, page cache, other
processes' growth."""
HOST_RESERVE_MIN_BYTES = 2 * 2**30
RUNTIME_GROWTH_BYTES = 7 * 2**28
"""Host memory a process takes in its first step beyond what it holds at setup: the kernels cuDNN, cuBLAS and NCCL
load when first called, autograd's and the optimizer's own (0.9 to 1.5 GiB traced on an H100 for a Hugging Face
Llama, states on the GPU or the host)."""
DEFAULT_GPU_BYTES = 80 * GIB
"""The card planned for where no GPU is read and none is given (an 80 GB card)."""


def usable_total_bytes(device: torch.device) -> int:
    """The GPU memory this process may use: the card's, times ``torch.cuda.set_per_process_memory_fraction``."""
    total = torch.cuda.get_device_properties(device).total_memory
    return int(total * torch.cuda.get_per_process_memory_fraction(device))


def usable_free_bytes(device: torch.device) -> int:
    """Free GPU memory for sizing ``"auto"`` where nothing plans: what the card has free, and no more than the
    process's cap leaves."""
    free = torch.cuda.mem_get_info(device)[0]
    return max(0, min(free, usable_total_bytes(device) - torch.cuda.memory_reserved(device)))


def host_reserve_bytes() -> int:
    """What a plan leaves free on the host: :data:`HOST_RESERVE_FRACTION` of its memory, at least 2 GiB."""
    total = None
    try:
        with open("/proc/meminfo") as f:
            total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        pass
    return max(HOST_RESERVE_MIN_BYTES, int(HOST_RESERVE_FRACTION * total) if total else 0)


def disk_free_bytes(directory: str, own_bytes: int = 0) -> int:
    """Space the disk tier may fill in ``directory``: its file system's free space and the ``own_bytes`` this
    process's files there hold already."""
    return shutil.disk_usage(directory).free + own_bytes


def machine_limits(
    *, num_gpus: int, gpus_per_node: int, device: Optional[torch.device] = None,
    usable_gpu_bytes: Optional[int] = None, available_host_bytes: Optional[int] = None, held_host_bytes: int = 0,
    local_processes: Optional[int] = None, disk_free: Optional[int] = None, disk_gbps: float = DISK_GBPS,
) -> Machine:
    """The limits a plan of a run on this machine is made against.

    - GPU: what a plan may fill of ``usable_gpu_bytes`` (a cap), else of ``device``'s usable memory, else of an
      80 GB card: the memory less the CUDA context and the allocator's fragmentation.
    - Host: the memory the host has available (``available_host_bytes``: read before, say, a benchmark pinned
      anything; else read now), plus the resident memory the host's ``local_processes`` hold already (the plan
      counts it as their baseline), less :func:`host_reserve_bytes`; not checked where it cannot be read.
    - Baseline: with ``local_processes`` (a running job of that many processes per host), this process's resident
      memory less ``held_host_bytes`` (what of it the plan counts in its own terms: page-locked pools, host states)
      plus :data:`RUNTIME_GROWTH_BYTES`; else the planner's estimate.
    - Disk: ``disk_free`` (:func:`disk_free_bytes` of the disk tier's directory); ``None``: no disk tier.
    """
    if usable_gpu_bytes is None and device is not None and device.type == "cuda":
        usable_gpu_bytes = usable_total_bytes(device)
    gpu = plannable_gpu_bytes(usable_gpu_bytes or DEFAULT_GPU_BYTES, expandable_segments=expandable_segments())
    available = available_host_memory() if available_host_bytes is None else available_host_bytes
    rss = (resident_bytes() or 0) if local_processes else 0
    host = None if available is None else max(available + (local_processes or 0) * rss - host_reserve_bytes(), 1)
    baseline = None if not local_processes else max(0, rss - held_host_bytes) + RUNTIME_GROWTH_BYTES
    return Machine(num_gpus=num_gpus, gpus_per_node=gpus_per_node, gpu_memory_gib=gpu / GIB,
                   host_memory_gib=None if host is None else host / GIB,
                   host_baseline_gib=None if baseline is None else baseline / GIB,
                   disk_memory_gib=None if disk_free is None else disk_free / GIB, disk_gbps=disk_gbps)
