"""Preemption that loses nothing: on SIGTERM (and on SLURM's requeue signal under ``SLURMEnvironment(auto_requeue=
True)``) every rank stops at the same optimizer step, a checkpoint is saved through the strategy's own path
(distributed, checksummed) and every rank exits, naming the signal and the checkpoint (docs/design.md §5.9,
docs/multi_node.md).

- **The handler only takes note.** It records the signal and returns: nothing collective, nothing that blocks.
  Lightning's own handlers broadcast from inside the handler, which hangs when the signal reaches some ranks only;
  they are replaced for the duration of ``fit`` (from the sanity check or the start of training, whichever comes
  first; Lightning restores its own at teardown).
- **The ranks agree at step ends.** After every optimizer step one all-reduce of two counts (ranks that got SIGTERM,
  ranks that got the requeue signal) tells every rank the same thing at the same step, so a signal that reached one
  rank stops all of them together.
- **The store carries the news and bounds the exit.** The watchdog's thread (``strategy/watchdog.py``) reads the
  signals the C-level handler wrote to a wake-up pipe (so it learns of a signal even while the main thread waits in
  a collective) and posts them in the rendezvous store, where every rank's thread reads them. From then on, until the
  strategy's teardown, a guard thread watches the main thread's progress: a rank that makes none (no step, no
  validation batch, no save) for ``timeout`` seconds beyond its longest step and checkpoint save so far, because a
  peer hangs outside the collective, ends at once without a checkpoint, saying where the ranks are.
- **The checkpoint.** ``hpc_ckpt_<N>.ckpt`` in the Trainer's ``default_root_dir`` (Lightning's convention: under SLURM
  a job that restarts without a ``ckpt_path`` resumes from the highest ``N``; elsewhere ``ckpt_path="hpc"`` does). It
  is written under a temporary name and renamed once complete, so an interrupted save never looks like a checkpoint.
  It is saved where ``ModelCheckpoint`` saves (at the end of the step's ``on_train_batch_end``): the resumed run
  repeats the uninterrupted one exactly.
- **The exit.** Every rank raises Lightning's ``SIGTERMException`` with status ``128 + signal`` (143 for SIGTERM), so
  schedulers and launchers see a job that was stopped, not one that finished. Under SLURM requeue rank 0 first runs
  ``scontrol requeue``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_fpdt.strategy.watchdog import main_thread_location

log = logging.getLogger("lightning.pytorch")

DEFAULT_TIMEOUT = 120.0
"""Seconds a rank may make no progress after a stop signal (on top of the longest step so far) before it exits
without a checkpoint."""
PREEMPT_KEY = "preempt"
"""Under the run's namespace in the store: the first stop signal a rank received, and where."""
CHECKPOINT_PATTERN = re.compile(r"hpc_ckpt_(\d+)\.ckpt")
PARTIAL_NAME = ".fpdt_preemption_partial.ckpt"
"""The name a preemption checkpoint is written under until it is complete (it holds no ``hpc_ckpt_``, so Lightning
never resumes from it)."""


@dataclass(frozen=True)
class Stop:
    """What the ranks agreed on at a step end."""

    signum: int
    """The signal acted on: the requeue signal when any rank got it, else SIGTERM."""
    ranks: int
    """How many ranks received a stop signal."""
    world_size: int
    requeue: bool
    """Requeue the SLURM job after the save."""
    here: bool
    """This rank was one of those that had received a stop signal when the ranks agreed."""

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """The shell's status of a process ended by the signal."""
        return 128 + self.signum


class Preemption:
    """One process's side of the stop: the handlers, the agreement, the save, the requeue and the exit deadline (see
    the module docstring). Created by the strategy; its :class:`PreemptionCheckpoint` callback drives it."""

    def __init__(self, *, timeout: float = DEFAULT_TIMEOUT, exit_process: Callable[[int], None] = os._exit) -> None:
        if timeout <= 0:
            raise ValueError(f"preemption_timeout must be positive seconds, got {timeout!r}: the time a rank may make "
                             f"no progress after a stop signal; FPDTStrategy(preemption=False) turns preemption off")
        self.timeout = timeout
        self._exit = exit_process  # os._exit: the main thread may wait in a collective that never returns
        self.signum: Optional[int] = None
        """The first stop signal this process received."""
        self.rank, self.world_size = 0, 1
        self._signals: dict[int, Any] = {}  # handled signal -> the handler it replaced
        self._requeue_signal: Optional[int] = None
        self._wakeup: Optional[tuple[int, int]] = None  # (read, write) ends of the wake-up pipe
        self._key: Optional[str] = None
        self._posted = False
        self._news: Optional[str] = None  # "SIGTERM on rank 1": the first stop any rank posted
        self._known_since: Optional[float] = None  # monotonic time this process learnt of a stop
        self._last_progress = time.monotonic()
        self._longest_step = 0.0
        self._longest_save = 0.0
        self._describe: Callable[[], list[str]] = list
        self._lock = threading.Lock()
        self._guard: Optional[threading.Thread] = None
        self._done = threading.Event()  # set at teardown: the guard of this fit stops watching
        self.stop: Optional[Stop] = None
        """The stop the ranks agreed on, once they did."""
        self.saved: Optional[Path] = None
        """The checkpoint saved on the way out."""

    def __getstate__(self) -> dict[str, Any]:
        # a strategy is copied or pickled before its fit (Lightning's launchers, the CLI): locks and threads are not
        state = dict(self.__dict__)
        for name in ("_lock", "_guard", "_done", "_wakeup", "_signals"):
            state.pop(name)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock, self._guard, self._done = threading.Lock(), None, threading.Event()
        self._wakeup, self._signals = None, {}

    # ---- wiring ---------------------------------------------------------------------------------------------------
    def attach(self, *, rank: int, world_size: int, key: Optional[str] = None,
               describe: Optional[Callable[[], list[str]]] = None) -> None:
        """This process's rank; ``key``: the store key of the run's stop news (``None``: no store, no deadline
        thread reading it); ``describe``: lines saying where the ranks are, for the deadline's message."""
        self.rank, self.world_size, self._key = rank, world_size, key
        if describe is not None:
            self._describe = describe

    def install(self, trainer: Any) -> None:
        """Take over SIGTERM, and SLURM's requeue signal when Lightning's ``SLURMEnvironment`` asks for it, from
        Lightning's handlers (the main thread only; a second call does nothing)."""
        if self._signals or threading.current_thread() is not threading.main_thread():
            return
        self._reset()
        wanted = [signal.SIGTERM]
        environment = getattr(trainer.strategy, "cluster_environment", None)
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and environment.requeue_signal:
            current = signal.getsignal(environment.requeue_signal)
            # Lightning leaves a handler the user installed in place; so does this
            if current in (signal.SIG_DFL, None) or type(current).__module__.startswith("lightning."):
                self._requeue_signal = int(environment.requeue_signal)
                wanted.append(environment.requeue_signal)
        for signum in wanted:
            self._signals[int(signum)] = signal.signal(signum, self._handle)
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        if previous != -1:  # another user of the wake-up fd (an event loop): leave it theirs
            signal.set_wakeup_fd(previous)
            os.close(read)
            os.close(write)
        else:
            self._wakeup = (read, write)

    def uninstall(self) -> None:
        """Give the signals back to the handlers they had (Lightning's, which restores its own originals after), and
        stop the deadline guard: the strategy's teardown is the end of the fit it watched."""
        self._done.set()
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self._signals.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._signals.clear()
        if self._wakeup is not None:
            signal.set_wakeup_fd(-1)
            for fd in self._wakeup:
                os.close(fd)
            self._wakeup = None

    def _reset(self) -> None:
        """A new fit: nothing received, nothing agreed, no guard."""
        self.signum, self.stop, self.saved = None, None, None
        self._posted, self._news, self._known_since = False, None, None
        self._last_progress, self._longest_step, self._longest_save = time.monotonic(), 0.0, 0.0
        self._done = threading.Event()
        self._guard = None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:  # nothing else here: a handler must not block or enter a collective
            self.signum = signum

    # ---- the watchdog's thread ------------------------------------------------------------------------------------
    def poll(self, store: Any) -> None:
        """Called every second on the watchdog's thread: signals seen by the wake-up pipe, this rank's stop posted in
        the store, and any rank's stop read from it."""
        for signum in self._drain_wakeup():
            if signum in self._signals and self.signum is None:
                self.signum = signum
        if self._key is None:
            return
        if self.signum is not None and not self._posted:
            self._posted = True
            store.set(self._key, f"{signal.Signals(self.signum).name} on rank {self.rank}")
        if self._news is None and store.check([self._key]):
            self._learn(store.get(self._key).decode())

    def _drain_wakeup(self) -> bytes:
        if self._wakeup is None:
            return b""
        try:
            return os.read(self._wakeup[0], 64)
        except (BlockingIOError, OSError):
            return b""

    def _learn(self, news: str) -> None:
        """Note a stop (from this process or another) and start the deadline guard."""
        with self._lock:
            if self._news is None:
                self._news, self._known_since = news, time.monotonic()
            if self._guard is None:
                self._guard = threading.Thread(target=self._watch_progress, name="fpdt-preemption", daemon=True)
                self._guard.start()

    def _watch_progress(self) -> None:
        done = self._done
        while not done.wait(0.5):
            allowed = self.timeout + self._longest_step + self._longest_save
            idle = time.monotonic() - max(self._last_progress, self._known_since or 0.0)
            if idle > allowed:
                here, in_collective = main_thread_location()
                where = [f"rank {self.rank} is at {here or 'an unknown place'}"
                         f"{', waiting in a collective' if in_collective else ', outside any collective'}",
                         *self._describe()]
                log.error(
                    f"fpdt: {self._news}, and rank {self.rank} made no progress for {idle:.0f} s since (allowed: "
                    f"preemption_timeout {self.timeout:g} s + the longest step {self._longest_step:.1f} s + the "
                    f"longest checkpoint save {self._longest_save:.1f} s so far): it ends now, without a checkpoint; "
                    f"{'; '.join(where)}. Resume from the last checkpoint saved before the signal"
                )
                self._exit(1)
                return

    # ---- the main thread ------------------------------------------------------------------------------------------
    def progress(self, *, step_seconds: Optional[float] = None, save_seconds: Optional[float] = None) -> None:
        """The main thread moved on (a step, a validation batch, a save), which took ``step_seconds`` or
        ``save_seconds``: the deadline allows for the longest of each."""
        self._last_progress = time.monotonic()
        if step_seconds is not None:
            self._longest_step = max(self._longest_step, step_seconds)
        if save_seconds is not None:
            self._longest_save = max(self._longest_save, save_seconds)

    def agree(self, device: torch.device) -> Optional[Stop]:
        """Whether any rank received a stop signal, the same answer on every rank. Collective: one all-reduce."""
        local = self.signum
        counts = torch.tensor([float(local is not None and local != self._requeue_signal),
                               float(local is not None and local == self._requeue_signal)], device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
        terminated, requeued = (int(c) for c in counts.tolist())
        if terminated + requeued == 0:
            return None
        requeue = requeued > 0
        signum = self._requeue_signal if requeue else int(signal.SIGTERM)
        if self.signum is not None:
            self._learn(f"{signal.Signals(self.signum).name} on rank {self.rank}")
        else:
            self._learn(f"{signal.Signals(signum).name} on another rank")
        return Stop(signum=signum, ranks=terminated + requeued, world_size=self.world_size, requeue=requeue,
                    here=local is not None)

    def save(self, trainer: Any, stop: Stop) -> Path:
        """Save the checkpoint of the agreed ``stop`` (collective), requeue the SLURM job when asked to, and log one
        line on every rank."""
        self.stop = stop
        self.progress()
        started = time.monotonic()
        strategy = trainer.strategy
        folder = Path(trainer.default_root_dir)
        final = strategy.broadcast(str(next_checkpoint_path(folder)) if strategy.is_global_zero else None)
        partial = Path(final).with_name(PARTIAL_NAME)
        if strategy.is_global_zero:
            folder.mkdir(parents=True, exist_ok=True)
            _remove(partial)  # a save an earlier stop could not finish
        strategy.barrier("fpdt-preemption-save")
        trainer.save_checkpoint(partial, weights_only=False)
        if strategy.is_global_zero:
            os.replace(partial, final)
        strategy.barrier("fpdt-preemption-saved")
        self.saved = Path(final)
        self.progress()
        requeued = requeue_slurm_job() if stop.requeue and strategy.is_global_zero else ""
        received = "this one among them" if stop.here else "not this one"
        resume = ("a restarted SLURM job resumes from it by itself" if SLURMEnvironment.detect()
                  else "resume with ckpt_path='hpc' (--ckpt_path hpc) or that path")
        log.warning(
            f"fpdt: rank {self.rank}: {stop.name} reached {stop.ranks} of {stop.world_size} ranks ({received}); every "
            f"rank stopped after global step {trainer.global_step} and saved the checkpoint {final} in "
            f"{time.monotonic() - started:.1f} s{requeued}; {resume}; exiting with status {stop.exit_code}"
        )
        return self.saved


def next_checkpoint_path(folder: Path) -> Path:
    """``hpc_ckpt_<N+1>.ckpt`` for the highest ``N`` in ``folder`` (Lightning's numbering of SLURM checkpoints)."""
    names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
    numbers = [int(m.group(1)) for name in names if (m := CHECKPOINT_PATTERN.fullmatch(name))]
    return folder / f"hpc_ckpt_{max(numbers, default=0) + 1}.ckpt"


def watch_with(preemption: Preemption, watchdog: Any) -> None:
    """Let the rank's watchdog thread carry ``preemption``'s news through the store (``strategy/watchdog.py``)."""
    has_store = watchdog.store is not None
    preemption.attach(rank=watchdog.rank, world_size=watchdog.world_size,
                      key=watchdog.key(PREEMPT_KEY) if has_store else None,
                      describe=watchdog.diagnose if has_store else None)
    if has_store:
        watchdog.duties.append(preemption.poll)


def requeue_slurm_job() -> str:
    """``scontrol requeue`` this SLURM job (an array task by its array id); the words the log line adds."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job):
        return f"; not requeued: SLURM_JOB_ID ({job!r}) is not a job id"
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"; requeuing SLURM job {job} failed ({error}): resubmit it"
    if result.returncode != 0:
        return f"; requeuing SLURM job {job} failed ({(result.stderr or result.stdout).strip()[:200]}): resubmit it"
    return f"; requeued SLURM job {job} (scontrol requeue)"


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


class PreemptionCheckpoint(Callback):
    """What the strategy adds to the Trainer's callbacks to act on a :class:`Preemption` at Lightning's hooks: take
    the signals over once Lightning has registered its own, agree after each optimizer step, save, and have the loop
    stop there."""

    def __init__(self, preemption: Preemption) -> None:
        self.preemption = preemption
        self._step_started = time.monotonic()
        self._global_step = -1

    def on_sanity_check_start(self, trainer: Any, pl_module: Any) -> None:
        self.preemption.install(trainer)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.preemption.install(trainer)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        stop = self.preemption.stop
        if stop is not None and self.preemption.saved is not None:
            raise SIGTERMException(stop.exit_code)  # the loop went on after the stop (see on_train_batch_end)
        self._step_started, self._global_step = time.monotonic(), trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.preemption.progress(step_seconds=time.monotonic() - self._step_started)
        if trainer.global_step == self._global_step:
            return  # a gradient-accumulation micro-step: stop only where an optimizer step ended
        stop = self.preemption.agree(trainer.strategy.root_device)
        if stop is None:
            return
        self.preemption.save(trainer, stop)
        # Lightning's loop ends the step (the module's on_train_batch_end, the loggers) and then raises its
        # SIGTERMException on every rank; on_train_batch_start raises it where that flag no longer exists
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None:
            connector.received_sigterm = True

    def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self.preemption.progress()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        stop = self.preemption.stop
        if stop is not None and self.preemption.saved is not None and isinstance(exception, SystemExit):
            exception.code = stop.exit_code  # Lightning raises it without a status: a stopped job is not a success


def add_preemption_checkpoint(trainer: Any, preemption: Optional[Preemption]) -> None:
    """Give ``trainer`` the :class:`PreemptionCheckpoint` that acts on ``preemption`` unless it has one (``None``:
    Lightning's own handling, nothing added)."""
    if preemption is not None and not any(isinstance(c, PreemptionCheckpoint) for c in trainer.callbacks):
        trainer.callbacks.append(PreemptionCheckpoint(preemption))
