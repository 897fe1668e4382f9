"""A pool of gloo worker processes on CPU that run test functions on every rank (docs/design.md §7).

Spawning and importing torch costs seconds per process, so each world size keeps one pool alive for the whole test
session; a test sends a module-level function and keyword arguments, every rank runs it, and the first rank's
exception comes back as the test failure with that rank's traceback. A failing rank can leave the others blocked in
a collective: the pool is then torn down (killed) and the next test gets a fresh one, so nothing hangs.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp

TASK_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks: Any, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), NODE_RANK="0", GROUP_RANK="0",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # world_size processes share 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, kwargs = task
        try:
            results.put((rank, True, fn(**kwargs)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the test
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class DistPool:
    """``world_size`` gloo processes; ``run(fn, **kwargs)`` returns every rank's result in rank order."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self._tasks[r], self._results), daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], **kwargs: Any) -> list[Any]:
        for q in self._tasks:
            q.put((fn, kwargs))
        out: dict[int, Any] = {}
        while len(out) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=TASK_TIMEOUT_S)
            except queue.Empty:
                self.close(kill=True)
                raise TimeoutError(f"{fn.__name__}: ranks {sorted(set(range(self.world_size)) - set(out))} did not "
                                   f"answer within {TASK_TIMEOUT_S} s") from None
            if not ok:
                self.close(kill=True)
                raise AssertionError(f"{fn.__name__} failed on rank {rank}:\n{value}")
            out[rank] = value
        return [out[r] for r in range(self.world_size)]

    @property
    def pids(self) -> list[int]:
        """The process id of each rank."""
        return [p.pid for p in self._procs]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def close(self, kill: bool = False) -> None:
        for p, q in zip(self._procs, self._tasks):
            if kill:
                p.kill()
            elif p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


_POOLS: dict[int, DistPool] = {}


def get_pool(world_size: int) -> DistPool:
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive:
        pool = _POOLS[world_size] = DistPool(world_size)
    return pool


def close_pools() -> None:
    for pool in _POOLS.values():
        pool.close(kill=not pool.alive)
    _POOLS.clear()
