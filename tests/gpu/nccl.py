"""What the several-GPU attention tests share: NCCL worker processes, one free port, and the bf16 error bound."""

from __future__ import annotations

import os
import socket
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REL_ERROR = 1e-2
"""bf16 inputs, fp32 accumulation: the kernels' own rounding gives ~3e-3 relative error in norm against fp32 attention
(docs/design.md §4 measured 2.4e-3 for merged blocks); 1e-2 leaves margin and still catches a wrong block, mask, or
kv head (those give O(1) errors)."""


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def _worker(rank: int, world: int, port: int, check: Callable[..., None], cases: list[dict]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        for case in cases:
            check(rank, world, **case)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_gpus(check: Callable[..., None], world: int, cases: list[dict]) -> None:
    """``check(rank, world, **case)`` for every case on ``world`` GPUs, one NCCL process each (``check`` a
    module-level function: the processes import it by name)."""
    mp.spawn(_worker, args=(world, _free_port(), check, cases), nprocs=world, join=True)
