"""A rank that dies or freezes is named and the job ended, not left waiting in a collective (docs/design.md §5.9).

Each rank keeps entries in the job's key-value store (the rendezvous ``TCPStore``), written by a background thread
every ``interval`` seconds: a heartbeat (a counter, its host and process id) and where the rank's main thread is (its
innermost frame, and whether it waits inside a ``torch.distributed`` call). The same thread watches the heartbeats of
the next two ranks. A heartbeat that stops changing for ``stale_after`` seconds means a process that died or froze
(``SIGSTOP``, a debugger, a swapped-out host): a long step never stops it, since the thread beats on while the main
thread computes. The watcher then names that rank in the log, posts the news in the store, kills the frozen process
when it runs on its own host, and exits; every other rank reads the news within a second and exits too. A store
that stops answering means its host process died (rank 0's under Lightning's launcher): after ``stale_after`` seconds
of silence the rank names it and exits. When a collective fails first (a dead peer closes its connections), the
strategy's exception path asks :meth:`RankWatchdog.diagnose` which ranks are at fault before the error ends the rank.
A rank whose training raised posts its error in the store first: ranks that failed are not taken for ranks that hang,
and when every rank failed with the same error, rank 0 says so in one line.

The keys of one run live under a namespace of their own (``fpdt/<run>``), so a store that outlives a run (a pool of
test processes, an elastic agent restarting its workers) never shows one run's news to the next. Other per-rank work
that needs the store on a thread of its own (the preemption watch, ``strategy/preemption.py``) runs as one of the
watchdog's :attr:`~RankWatchdog.duties`.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, NamedTuple, Optional

import torch.distributed as dist

log = logging.getLogger(__name__)

DEFAULT_STALE_AFTER = 60.0
"""Seconds a heartbeat may stand still before its rank counts as dead or frozen: the job ends within about this."""
WATCHED = 2
"""How many following ranks each rank watches (rank ``r`` watches ``r + 1`` and ``r + 2``): every rank has watchers,
and the store serves a few reads per rank and interval whatever the world size."""
ABORT_KEY = "abort"
"""Under the run's namespace: the news that a rank found another dead, read by every rank's watchdog."""
FAILED_KEY = "failed"
"""Under the run's namespace, ``failed/<rank>``: the error that ended that rank's training."""


def checked_heartbeat_timeout(heartbeat_timeout: Optional[float]) -> Optional[float]:
    """``FPDTStrategy(heartbeat_timeout=...)`` as given; ``ValueError`` below 2 seconds (``None``: no watch)."""
    if heartbeat_timeout is not None and heartbeat_timeout < 2:
        raise ValueError(f"heartbeat_timeout must be at least 2 seconds, or None, got {heartbeat_timeout!r}")
    return heartbeat_timeout


class Heartbeat(NamedTuple):
    """One rank's entry in the store."""

    count: int
    """Beats so far: a watcher sees the rank alive while this changes (no clock shared across hosts needed)."""
    time: float
    """The rank's wall clock at the beat."""
    host: str
    pid: int
    in_collective: bool
    """The main thread waits inside a ``torch.distributed`` call."""
    where: str
    """The main thread's innermost frame of the user's or the package's code."""
    done: bool = False
    """The rank stopped its watchdog on purpose (training ended): not watched any more."""

    def encode(self) -> str:
        return "|".join(str(x) for x in (self.count, self.time, self.host, self.pid, int(self.in_collective),
                                         int(self.done), self.where))

    @classmethod
    def decode(cls, text: str) -> "Heartbeat":
        count, beat, host, pid, in_collective, done, where = text.split("|", 6)
        return cls(int(count), float(beat), host, int(pid), in_collective == "1", where, done == "1")


class RankWatchdog:
    """Heartbeat and progress of one rank in the job's store, and the watch over the next ranks (see the module
    docstring). ``stale_after=None`` keeps the heartbeats for :meth:`diagnose` and watches nothing."""

    def __init__(self, rank: int, world_size: int, interval: float = 1.0,
                 stale_after: Optional[float] = DEFAULT_STALE_AFTER,
                 exit_process: Callable[[int], None] = os._exit, namespace: str = "fpdt") -> None:
        if stale_after is not None and stale_after < 2 * interval:
            raise ValueError(f"heartbeat_timeout ({stale_after} s) must be at least twice the heartbeat interval "
                             f"({interval} s), or None to watch no heartbeat")
        self.rank = rank
        self.world_size = world_size
        self.interval = interval
        self.stale_after = stale_after
        self._exit = exit_process  # os._exit: the main thread may be blocked in a collective that never returns
        self._store: Optional[dist.Store] = None
        self._store_address = ""
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._count = 0
        self._seen: dict[int, tuple[int, float]] = {}  # watched rank -> (last count seen, monotonic time it changed)
        self._store_silent_since: Optional[float] = None
        self._posted: Optional[str] = None  # the abort this rank posted itself
        self.namespace = namespace
        """Prefix of this run's keys in the store (the same on every rank of the run)."""
        self.duties: list[Callable[[dist.Store], None]] = []
        """Called with the store on the watchdog's thread after every beat (they must not block)."""

    def key(self, name: str) -> str:
        """The store key ``name`` of this run."""
        return f"{self.namespace}/{name}"

    @property
    def store(self) -> Optional[dist.Store]:
        """The watchdog's own client of the rendezvous store (``None`` when it has none)."""
        return self._store

    # ---- life cycle --------------------------------------------------------------------------------------------------
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
        self._store_address = f"{addr}:{port}"
        self._beat()
        self._thread = threading.Thread(target=self._run, name="fpdt-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and watching; the last beat says so, so no watcher takes this rank for dead."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval)
            try:
                self._beat(done=True)
            except (RuntimeError, ValueError):
                pass  # the store's host has already gone: nobody is left to watch

    # ---- after a failed collective -----------------------------------------------------------------------------------
    def report(self, exception: BaseException) -> None:
        """Log which ranks are at fault after ``exception`` ended this rank's training (nothing for the errors that
        are no rank's fault: a user's ValueError, a non-finite loss, an interrupt, an exit such as a preemption's).
        When every rank failed with the same error, rank 0 logs one line saying so and the others nothing."""
        no_fault = (ValueError, FloatingPointError, KeyboardInterrupt, SystemExit)
        if isinstance(exception, no_fault) or self._store is None:
            return
        error = f"{type(exception).__name__}: {str(exception)[:200]}"
        self._post_failure(error)
        faults = self.diagnose(wait=6 * self.interval)
        try:
            failed = self._failures()
        except (RuntimeError, ValueError):
            failed = {}  # the store has gone: diagnose named it
        if len(failed) == self.world_size and len({_alike(text) for text in failed.values()}) == 1:
            if self.rank == 0:
                logging.getLogger("lightning.pytorch").error(
                    f"fpdt: every rank ({self.world_size} of {self.world_size}) failed alike ({error}): the error "
                    f"itself is the cause, no rank died or hangs"
                )
            return
        if faults:
            logging.getLogger("lightning.pytorch").error(
                f"fpdt: rank {self.rank} failed ({error}); " + "; ".join(faults)
            )

    def post_abort(self, message: str) -> None:
        """Tell every rank to end now with ``message`` (this rank failed in a way the others must not wait out);
        their watchdog threads read it within a second."""
        if self._store is not None:
            self._posted = message  # this rank ends by its own error, not by its watch
            try:
                self._store.set(self.key(ABORT_KEY), message)
            except (RuntimeError, ValueError):
                pass  # the store's host has gone: the others end on their own watch

    def diagnose(self, wait: float = 0.0) -> list[str]:
        """One line per rank at fault: stopped beating (waits up to ``wait`` s for a dead rank's beat to go stale),
        gone with the store it hosted, failed with an error of its own, or busy outside any collective while other
        ranks wait in one. Empty when nothing is known; the wait ends early once every rank has failed."""
        if self._store is None:
            return []
        deadline = time.time() + wait
        while True:
            now = time.time()
            try:
                reports = {r: self._read(r) for r in range(self.world_size) if r != self.rank}
                failed = self._failures()
            except (RuntimeError, ValueError):
                return [self._store_gone_message()]
            dead = [self._dead_message(r, beat, now - beat.time) for r, beat in reports.items()
                    if beat is not None and not beat.done and now - beat.time > 5 * self.interval and r not in failed]
            if dead:
                return dead
            if now >= deadline or len(failed) == self.world_size:
                break
            time.sleep(self.interval)  # a rank that just died still has a fresh beat; one that just failed may post
        others_failed = [f"rank {r} failed too ({text})" for r, text in sorted(failed.items()) if r != self.rank]
        # alive everywhere: a rank whose main thread is outside torch.distributed holds up the ones waiting inside
        return others_failed + [
            f"rank {r} is not in the collective the others wait in; it is at {beat.where}"
            for r, beat in reports.items()
            if beat is not None and beat.where and not beat.in_collective and r not in failed
        ]

    # ---- the thread --------------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                for duty in self.duties:
                    duty(self._store)
                fault = self._abort_posted() or self._watch()
                self._store_silent_since = None
            except (RuntimeError, ValueError):
                fault = self._store_silent()
            if fault is not None and not self._stop.is_set():
                self._end_job(fault)
                return

    def _watch(self) -> Optional[str]:
        """The message naming a watched rank whose heartbeat stood still for ``stale_after`` seconds, or ``None``."""
        if self.stale_after is None:
            return None
        now = time.monotonic()
        for step in range(1, min(WATCHED, self.world_size - 1) + 1):
            rank = (self.rank + step) % self.world_size
            beat = self._read(rank)
            if beat is None or beat.done:
                continue  # not started yet, or ended on purpose
            count, since = self._seen.get(rank, (None, now))
            if beat.count != count:
                self._seen[rank] = (beat.count, now)
            elif now - since > self.stale_after:
                self._kill_if_local(beat)
                message = self._dead_message(rank, beat, now - since)
                self._store.set(self.key(ABORT_KEY), f"{message} (seen by rank {self.rank})")
                return message
        return None

    def _abort_posted(self) -> Optional[str]:
        if not self._store.check([self.key(ABORT_KEY)]):
            return None
        message = self._store.get(self.key(ABORT_KEY)).decode()
        return None if message == self._posted else message

    def _store_silent(self) -> Optional[str]:
        """After ``stale_after`` seconds without an answer from the store, the message saying its host is gone."""
        now = time.monotonic()
        if self._store_silent_since is None:
            self._store_silent_since = now
        if self.stale_after is None or now - self._store_silent_since <= self.stale_after:
            return None
        return self._store_gone_message()

    def _end_job(self, fault: str) -> None:
        logging.getLogger("lightning.pytorch").error(
            f"fpdt: {fault}; ending rank {self.rank} now rather than after the collective timeout (every rank ends); "
            f"restart from the last checkpoint once that host is healthy"
        )
        self._exit(1)

    # ---- the store ---------------------------------------------------------------------------------------------------
    def _read(self, rank: int) -> Optional[Heartbeat]:
        key = self.key(f"heartbeat/{rank}")
        if not self._store.check([key]):
            return None
        return Heartbeat.decode(self._store.get(key).decode())

    def _beat(self, done: bool = False) -> None:
        where, in_collective = main_thread_location()
        self._count += 1
        beat = Heartbeat(self._count, time.time(), socket.gethostname(), os.getpid(), in_collective, where, done)
        self._store.set(self.key(f"heartbeat/{self.rank}"), beat.encode())

    def _post_failure(self, error: str) -> None:
        if self._store is None:
            return
        try:
            self._store.set(self.key(f"{FAILED_KEY}/{self.rank}"), error)
        except (RuntimeError, ValueError):
            pass  # the store has gone: diagnose says so

    def _failures(self) -> dict[int, str]:
        """The errors ranks posted when their training failed, by rank."""
        keys = {r: self.key(f"{FAILED_KEY}/{r}") for r in range(self.world_size)}
        return {r: self._store.get(key).decode() for r, key in keys.items() if self._store.check([key])}

    # ---- messages ----------------------------------------------------------------------------------------------------
    @staticmethod
    def _dead_message(rank: int, beat: Heartbeat, silent_s: float) -> str:
        return (f"rank {rank} stopped responding {silent_s:.0f} s ago (its process died or froze; host {beat.host}, "
                f"pid {beat.pid})")

    def _store_gone_message(self) -> str:
        return (f"rank 0 stopped responding: the rendezvous store at {self._store_address} it hosts no longer "
                f"answers (its process died; under torchrun the store is the launcher's, so the launcher died)")

    @staticmethod
    def _kill_if_local(beat: Heartbeat) -> None:
        """A frozen process on this host is killed, so the job ends with it instead of leaving it stopped."""
        if beat.host != socket.gethostname() or beat.pid == os.getpid():
            return
        try:
            os.kill(beat.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # already gone, or not ours to end


def main_thread_location() -> tuple[str, bool]:
    """Where the main thread is (its innermost frame of the user's or the package's code) and whether it waits inside
    a ``torch.distributed`` call; read from another thread."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    where, in_collective = "", False
    while frame is not None:
        filename = frame.f_code.co_filename
        if not where and not filename.endswith(("threading.py", "watchdog.py", "preemption.py")):
            where = f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        in_collective = in_collective or "torch/distributed" in filename.replace(os.sep, "/")
        frame = frame.f_back
    return where, in_collective


def _alike(error: str) -> str:
    """An error with its numbers blanked: the same failure on every rank often differs only in a rank, an index or a
    size."""
    return re.sub(r"\d+", "#", error)
