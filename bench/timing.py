"""Timing of one GPU step, shared by the op benchmarks."""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist


def time_step(step: Callable[[], object], *, repeat: int, world: int) -> tuple[list[float], int, int]:
    """Run ``step`` once to warm up (kernels chosen, pinned buffers allocated), then ``repeat`` times, each between
    device synchronisations (and a barrier when ``world > 1``). Returns the seconds of each timed run, the GPU bytes
    allocated after the warm-up (``base``) and the peak the timed runs allocated beyond ``base``."""
    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeat):
        if world > 1:
            dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times, base, torch.cuda.max_memory_allocated() - base
