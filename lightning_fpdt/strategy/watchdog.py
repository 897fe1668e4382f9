"""Failures of a distributed run: a non-finite loss stops every rank together, and the rank that died or hung is
named when a collective fails (docs/design.md §5).

When one rank dies, the others fail in their next collective (the connection closes) or, if it hangs, after the
collective timeout; either way the error says nothing about which rank is at fault. Each rank therefore keeps two
entries in the job's key-value store (the rendezvous ``TCPStore``), written by a background thread every ``interval``
seconds: a heartbeat, and where the rank's main thread is (its innermost frame, and whether it waits inside a
``torch.distributed`` call). When training fails, every surviving rank reads them and logs which ranks stopped
beating (dead) and which are busy elsewhere while the others wait in a collective (stuck), before the error ends the
process with a non-zero exit code.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def stop_on_nonfinite_loss(loss: Optional[torch.Tensor], trainer: Any, *, rank: int) -> None:
    """Stop every rank together on a non-finite loss (one rank stopping alone would hang the others): a
    ``FloatingPointError`` naming the step on every rank. Collective."""
    if loss is None:
        return
    flag = (~torch.isfinite(loss.detach())).float().reshape(1)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        raise FloatingPointError(
            f"non-finite loss ({loss.item()} on rank {rank}) at global step {trainer.global_step} "
            f"(epoch {trainer.current_epoch}): training stopped; lower the learning rate, check the data, or "
            f"pass FPDTStrategy(nonfinite_loss='ignore') to train on"
        )


class RankWatchdog:
    """Heartbeat and progress of one rank in the job's store; :meth:`diagnose` names the ranks at fault."""

    def __init__(self, rank: int, world_size: int, interval: float = 1.0) -> None:
        self.rank = rank
        self.world_size = world_size
        self.interval = interval
        self._store: Optional[dist.Store] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """Connect a client of its own to the rendezvous store and start beating (no-op without one)."""
        if self._thread is not None or self.world_size == 1:
            return
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            return
        try:
            self._store = dist.TCPStore(addr, int(port), self.world_size, is_master=False,
                                        timeout=timedelta(seconds=30))
        except (RuntimeError, ValueError) as err:  # no reachable store: run without diagnosis
            log.warning("fpdt watchdog: no rendezvous store (%s); a failing rank will not be named", err)
            return
        self._beat()
        self._thread = threading.Thread(target=self._run, name="fpdt-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def report(self, exception: BaseException) -> None:
        """Log which ranks are at fault after ``exception`` ended this rank's training (nothing for the errors that
        are no rank's fault: a user's ValueError, a non-finite loss, an interrupt)."""
        if isinstance(exception, (ValueError, FloatingPointError, KeyboardInterrupt)):
            return
        faults = self.diagnose(wait=6 * self.interval)
        if faults:
            logging.getLogger("lightning.pytorch").error(
                f"fpdt: rank {self.rank} failed ({type(exception).__name__}: {str(exception)[:200]}); "
                + "; ".join(faults)
            )

    def diagnose(self, wait: float = 0.0) -> list[str]:
        """One line per rank at fault: stopped beating (waits up to ``wait`` s for a dead rank's beat to go stale),
        or busy outside any collective while other ranks wait in one. Empty when nothing is known."""
        if self._store is None:
            return []
        deadline = time.time() + wait
        while True:
            now = time.time()
            reports = {r: self._read(r) for r in range(self.world_size) if r != self.rank}
            dead = [f"rank {r} stopped responding {now - beat:.0f} s ago (its process died or froze)"
                    for r, (beat, _, _) in reports.items() if beat is not None and now - beat > 5 * self.interval]
            if dead:
                return dead
            if now >= deadline:
                break
            time.sleep(self.interval)  # a rank that just died still has a fresh beat
        # alive everywhere: a rank whose main thread is outside torch.distributed holds up the ones waiting inside
        return [f"rank {r} is not in the collective the others wait in; it is at {where}"
                for r, (_, where, in_collective) in reports.items() if where and not in_collective]

    def _read(self, rank: int) -> tuple[Optional[float], str, bool]:
        try:
            if not self._store.check([f"fpdt/heartbeat/{rank}"]):
                return None, "", True
            beat, in_collective, where = self._store.get(f"fpdt/heartbeat/{rank}").decode().split("|", 2)
            return float(beat), where, in_collective == "1"
        except (RuntimeError, ValueError):
            return None, "", True

    def _beat(self) -> None:
        frame = sys._current_frames().get(threading.main_thread().ident)
        where, in_collective = "", False
        while frame is not None:
            filename = frame.f_code.co_filename
            if not where and not filename.endswith(("threading.py", "watchdog.py")):
                where = f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
            in_collective = in_collective or "torch/distributed" in filename.replace(os.sep, "/")
            frame = frame.f_back
        self._store.set(f"fpdt/heartbeat/{self.rank}", f"{time.time()}|{int(in_collective)}|{where}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except RuntimeError:  # the store's host went away: nothing left to report to
                return
