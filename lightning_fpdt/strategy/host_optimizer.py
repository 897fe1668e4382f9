"""The optimizer step on host-resident states (``cpu_offload_params=True``).

FSDP2's ``CPUOffloadPolicy`` keeps the sharded fp32 parameters, their gradients and the optimizer states in host
memory, so the optimizer step runs on the CPU. Two defaults make that step slow:

- torch's Adam and AdamW run their per-tensor loop on CPU tensors (``foreach`` is the default on CUDA only): about ten
  passes over memory per parameter tensor, one for each elementwise op;
- ``torchrun`` starts every process with ``OMP_NUM_THREADS=1``, so those passes run on one core.

:func:`fuse_host_optimizers` switches Adam and AdamW to torch's fused CPU kernel (one vectorised pass per tensor, the
same update), where the user left both ``fused`` and ``foreach`` unset. :func:`host_step` runs the optimizer's own
arithmetic on every core of this rank's share of the host (:func:`host_threads`), and the closure it calls (forward
and backward, which only launch GPU work) with the thread count it had.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

FUSABLE = (torch.optim.Adam, torch.optim.AdamW)
"""Optimizers with a fused CPU kernel in torch whose update is the per-tensor loop's."""


def host_threads(local_world_size: int) -> int:
    """Cores this rank may use: the process's CPU affinity shared by the ranks of its host (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_world_size))


def fuse_host_optimizers(optimizers: Iterable[torch.optim.Optimizer]) -> list[str]:
    """Turn on ``fused`` in the groups of Adam and AdamW whose parameters are all in host memory and that left
    ``fused`` and ``foreach`` unset; return a description of each optimizer left as it was (for a warning)."""
    left: list[str] = []
    for optimizer in optimizers:
        name = type(optimizer).__name__
        if type(optimizer) not in FUSABLE:
            left.append(f"{name} (torch has no fused CPU step for it)")
            continue
        for index, group in enumerate(optimizer.param_groups):
            if group.get("fused") is not None or group.get("foreach") is not None:
                left.append(f"{name} group {index} (fused={group.get('fused')}, foreach={group.get('foreach')} set)")
                continue
            if group.get("differentiable") or group.get("capturable"):
                left.append(f"{name} group {index} (differentiable or capturable)")
                continue
            if any(p.device.type != "cpu" or not p.is_floating_point() for p in group["params"]):
                left.append(f"{name} group {index} (parameters not all floating point in host memory)")
                continue
            group["fused"] = True
    return left


def prepare_host_optimizers(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """:func:`fuse_host_optimizers`, with a warning (rank 0) naming what keeps torch's per-tensor loop."""
    left = fuse_host_optimizers(optimizers)
    if left:
        rank_zero_warn(f"fpdt: cpu_offload_params: the optimizer step on the host runs torch's per-tensor loop for "
                       f"{', '.join(left)}; Adam or AdamW with `fused` and `foreach` unset step with the fused CPU "
                       "kernel, several times faster")


@contextmanager
def num_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``count`` inside, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def host_step(step: Callable[[Optional[Callable[[], Any]]], Any], closure: Optional[Callable[[], Any]],
              threads: int) -> Any:
    """``step(closure)`` with ``threads`` intra-op threads for the optimizer's arithmetic; the closure, which the
    optimizer calls first (forward and backward), runs with the count the process had."""
    before = torch.get_num_threads()
    if threads == before:
        return step(closure)
    if closure is None:
        with num_threads(threads):
            return step(closure)

    def closure_as_before() -> Any:
        with num_threads(before):
            return closure()

    with num_threads(threads):
        return step(closure_as_before)
