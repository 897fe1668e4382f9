"""A disk tier under the host stash: entries spill to files once the host memory given to the stash is spoken for.

The life cycle is :class:`~lightning_fpdt.sequence.host_stash.ChunkStash`'s (``put``, ``prefetch``, ``get``,
``release``, ``free``; misuse raises ``RuntimeError``). A :class:`DiskStash` keeps an entry in the host buffer pool
while the pool's bytes stay within :attr:`DiskTier.host_budget_bytes` (an idle buffer of the entry's size is reused
at no cost); past that, the entry goes to a file:

- ``put`` copies the tensor into a staging buffer (device to host on the copy stream, after a CUDA event of the
  compute stream, as :class:`HostStash` does) and hands the buffer to a writer thread, which waits for the copy's
  event and writes the bytes behind (``os.pwrite``, then ``fdatasync`` and ``POSIX_FADV_DONTNEED``: the spilled bytes
  must not stay in the page cache, the host memory the tier exists to spare). The buffer goes back to the ring when
  written.
- ``prefetch`` allocates the device copy (on the host-to-device stream, as :class:`HostStash`) and hands a staging
  buffer to a reader thread, which reads the file into it (``os.preadv``) and issues the host-to-device copy on the
  same stream, recording an event; ``get`` waits for the read and makes the compute stream wait for that event.
- ``free`` removes the file: its space is free again at once.

Staging buffers (:class:`StagingRing`) are exactly the size of an entry (anonymous mappings registered with CUDA,
``host_memory.HostAllocator``), at most :data:`STAGING_DEPTH` of each size: a ``put`` that finds all of them in
flight waits for the writer, which bounds what the tier holds in host memory. On CPU the same threads, files and
buffers run with plain tensors and no streams, so the tests cover the logic.

Files. One file per entry (``<serial>.bin``) in one directory per process, ``<offload_dir>/fpdt-<host>-<pid>-rank<r>/``
(:class:`SpillDirectory`): freeing an entry unlinks its file, so the space comes back at once without bookkeeping of
holes, and a file's size says whether it is whole. Every entry is freed by the end of a step (and a stash's ``clear``
frees what is left); the directory is removed at exit (``atexit``) and by the strategy's teardown. A crash leaves it:
:func:`stale_directories` finds the directories of processes of this host that are no longer alive, for the
strategy to name; nothing removes them but the user (a pid test cannot prove that a directory on a shared file system
is unused, and removing a live process's files would corrupt its step).

Errors. A failed write, a file shorter or longer than what was written, or a short read raise :class:`DiskTierError`
naming the file and the bytes, never garbage. A background failure is kept and raised again by the next ``put``,
``prefetch``, ``get`` or ``clear`` of any stash on the directory: once a write failed, nothing the tier holds is
trusted.
"""

from __future__ import annotations

import atexit
import errno
import itertools
import os
import re
import shutil
import socket
import threading
import weakref
from collections.abc import Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_fpdt.sequence.host_memory import HostAllocator, HostMemoryGuard
from lightning_fpdt.sequence.host_stash import CopyStreams, HostBufferPool, HostStash, _HostChunk

STAGING_DEPTH = 2
"""Staging buffers of one size at most: one being written to the disk while the next ``put`` copies into the other
(and, in the backward, one being read while the other feeds the device)."""
DIRECTORY_PATTERN = re.compile(r"^fpdt-(?P<host>.+)-(?P<pid>\d+)-rank(?P<rank>\d+)$")


class DiskTierError(RuntimeError):
    """A write or a read of the disk tier failed (the message names the file and the bytes)."""


def directory_name(rank: int) -> str:
    """This process's directory under ``offload_dir``: ``fpdt-<host>-<pid>-rank<r>``."""
    return f"fpdt-{socket.gethostname()}-{os.getpid()}-rank{rank}"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's process counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tree_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


@dataclass(frozen=True)
class StaleDirectory:
    """The spill directory of a process of this host that is no longer alive."""

    path: str
    pid: int
    nbytes: int


def stale_directories(offload_dir: str) -> list[StaleDirectory]:
    """Spill directories under ``offload_dir`` left by processes of this host that are no longer alive (a crash).
    Directories of other hosts are not judged (their processes cannot be seen from here), nor those of live
    processes."""
    host, found = socket.gethostname(), []
    try:
        names = sorted(os.listdir(offload_dir))
    except OSError:
        return []
    for name in names:
        match = DIRECTORY_PATTERN.match(name)
        path = os.path.join(offload_dir, name)
        if match is None or match["host"] != host or not os.path.isdir(path):
            continue
        pid = int(match["pid"])
        if pid != os.getpid() and not _alive(pid):
            found.append(StaleDirectory(path, pid, _tree_bytes(path)))
    return found


def prepare_offload_dir(offload_dir: str) -> str:
    """The absolute ``offload_dir``, created if missing; ``ValueError`` naming it when it cannot be created or
    written (the check the strategy runs at setup, before any step)."""
    path = os.path.abspath(os.fspath(offload_dir))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise ValueError(
            f"offload_dir {path!r} does not exist and cannot be created ({error.strerror or error}): give a directory "
            f"on a local disk that this process can create and write, or offload_dir=None"
        ) from error
    if not os.path.isdir(path):
        raise ValueError(f"offload_dir {path!r} is not a directory: give a directory on a local disk")
    probe = os.path.join(path, f".fpdt-probe-{socket.gethostname()}-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0")
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise ValueError(
            f"offload_dir {path!r} is not writable ({error.strerror or error}): the disk tier writes block inputs "
            f"there; give a writable directory on a local disk, or offload_dir=None"
        ) from error
    return path


def check_free_space(offload_dir: str, needed_bytes: int, what: str = "") -> None:
    """``ValueError`` naming the directory, the bytes needed and the bytes free when ``offload_dir``'s file system
    has less than ``needed_bytes`` free (``what``: what needs them, for the message)."""
    free = shutil.disk_usage(offload_dir).free
    if needed_bytes <= free:
        return
    stale = stale_directories(offload_dir)
    hint = ""
    if stale:
        hint = (f" {len(stale)} directories of processes of this host that are no longer alive hold "
                f"{sum(s.nbytes for s in stale):,} bytes there: " + ", ".join(s.path for s in stale)
                + " (remove them if no run uses them).")
    raise ValueError(
        f"offload_dir {offload_dir!r} is too small: {what or 'the disk tier'} needs {needed_bytes:,} bytes "
        f"({needed_bytes / 2**30:.2f} GiB) on its file system, which has {free:,} bytes ({free / 2**30:.2f} GiB) "
        f"free.{hint} Free space there, give a larger directory, or plan the run with `lightning-fpdt plan "
        f"--disk-gib {free / 2**30:.0f}` to see what fits."
    )


class StagingRing:
    """Host buffers between the device and the files, exactly the size of an entry, at most ``depth`` of each size.

    A buffer handed back carries the CUDA event of its last device read (a host-to-device copy); its next user waits
    on it before writing. :meth:`acquire` waits while all ``depth`` buffers of a size are in flight: the writer and
    reader threads always hand theirs back, failed or not.
    """

    def __init__(self, allocator: HostAllocator, depth: int = STAGING_DEPTH, what: str = "a disk staging buffer"):
        self.allocator = allocator
        self.depth = depth
        self.what = what
        self._cond = threading.Condition()
        self._idle: dict[tuple[torch.dtype, int], list[tuple[Tensor, Optional[torch.cuda.Event]]]] = {}
        self._made: dict[tuple[torch.dtype, int], int] = {}

    @property
    def allocated_bytes(self) -> int:
        return self.allocator.allocated_bytes

    def acquire(self, dtype: torch.dtype, numel: int) -> tuple[Tensor, Optional[torch.cuda.Event]]:
        key = (dtype, numel)
        with self._cond:
            while not self._idle.get(key) and self._made.get(key, 0) >= self.depth:
                self._cond.wait()
            if self._idle.get(key):
                return self._idle[key].pop()
            self._made[key] = self._made.get(key, 0) + 1
        try:
            return self.allocator.empty(numel, dtype, what=self.what), None
        except BaseException:
            with self._cond:
                self._made[key] -= 1
                self._cond.notify_all()
            raise

    def give_back(self, buffer: Tensor, last_read: Optional[torch.cuda.Event]) -> None:
        with self._cond:
            self._idle.setdefault((buffer.dtype, buffer.numel()), []).append((buffer, last_read))
            self._cond.notify_all()

    def close(self) -> None:
        """Free the idle buffers (all of them once the threads are done) and end their registration."""
        with self._cond:
            for buffers in self._idle.values():
                for buffer, last_read in buffers:
                    if last_read is not None:
                        last_read.synchronize()
                    self.allocator.release(buffer)
            self._idle.clear()
            self._made.clear()
        self.allocator.close()


_OPEN: "weakref.WeakSet[SpillDirectory]" = weakref.WeakSet()
"""The spill directories of this process not yet closed: removed at exit (the only module state; see close)."""


def _close_open() -> None:
    for directory in list(_OPEN):
        directory.close()


atexit.register(_close_open)


class SpillDirectory:
    """The spill files of one process: its directory, one writer and one reader thread, the staging buffers.

    Args:
        offload_dir: the directory given by the user (created if missing, :func:`prepare_offload_dir`).
        rank: this process's global rank, in the directory's name.
        pin_memory: page-lock the staging buffers (CUDA runs).
        guard: asked before each new staging buffer (the strategy's host memory guard).
    """

    def __init__(self, offload_dir: str, *, rank: int, pin_memory: bool, guard: Optional[HostMemoryGuard] = None,
                 staging_depth: int = STAGING_DEPTH) -> None:
        self.root = prepare_offload_dir(offload_dir)
        self.path = os.path.join(self.root, directory_name(rank))
        # a directory of this name is ours or a dead process's that had our pid: no live process can own it
        shutil.rmtree(self.path, ignore_errors=True)
        os.makedirs(self.path)
        self.staging = StagingRing(HostAllocator(pin=pin_memory, guard=guard), staging_depth)
        self.failure: Optional[BaseException] = None
        """The first background failure; raised again by every later stash call (module docstring)."""
        self.bytes_on_disk = 0
        """Bytes of the files now (counted from ``put``, so including writes still in flight)."""
        self.peak_bytes_on_disk = 0
        self._serial = itertools.count()
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="fpdt-disk-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="fpdt-disk-read")
        self._pid = os.getpid()  # a forked child (a data loader worker) must not remove its parent's files
        self.closed = False
        _OPEN.add(self)

    # ---- called on the stash's thread ----------------------------------------------------------------------------
    def check(self) -> None:
        """Raise the background failure, if one happened."""
        if self.failure is not None:
            raise DiskTierError(f"the disk tier in {self.path} failed earlier: {self.failure}") from self.failure
        if self.closed:
            raise RuntimeError(f"the disk tier in {self.path} is closed (the run was torn down)")

    def new_file(self, nbytes: int) -> str:
        with self._lock:
            self.bytes_on_disk += nbytes
            self.peak_bytes_on_disk = max(self.peak_bytes_on_disk, self.bytes_on_disk)
            return os.path.join(self.path, f"{next(self._serial)}.bin")

    def remove_file(self, path: str, nbytes: int) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass  # its write failed before creating it (the failure is kept)
        with self._lock:
            self.bytes_on_disk -= nbytes

    def submit_write(self, path: str, staging: Tensor, nbytes: int, written: Optional[torch.cuda.Event]) -> Future:
        return self._writer.submit(self._write_job, path, staging, nbytes, written)

    def submit_read(self, entry: "_DiskChunk", staging: Tensor, last_read: Optional[torch.cuda.Event],
                    device_copy: Tensor, streams: Optional[CopyStreams]) -> Future:
        return self._reader.submit(self._read_job, entry, staging, last_read, device_copy, streams)

    # ---- the threads -------------------------------------------------------------------------------------------
    def _write_job(self, path: str, staging: Tensor, nbytes: int, written: Optional[torch.cuda.Event]) -> None:
        try:
            if written is not None:
                written.synchronize()  # the device-to-host copy into the staging buffer has finished
            write_file(path, staging, nbytes)
        except BaseException as error:
            self._failed(error)
            raise
        finally:
            self.staging.give_back(staging, None)  # the disk has read it; no device copy reads it

    def _read_job(self, entry: "_DiskChunk", staging: Tensor, last_read: Optional[torch.cuda.Event],
                  device_copy: Tensor, streams: Optional[CopyStreams]) -> Optional[torch.cuda.Event]:
        loaded = None
        try:
            entry.written.result()  # the file is whole (raises the write's failure)
            if last_read is not None:
                last_read.synchronize()  # the buffer's previous host-to-device copy has read it
            read_file(entry.path, staging, entry.nbytes)
            source = staging.view(entry.shape)
            if streams is None:
                device_copy.copy_(source)
            else:
                stream = streams.to_device
                with torch.cuda.stream(stream):
                    device_copy.copy_(source, non_blocking=True)
                    loaded = stream.record_event()
            return loaded
        except BaseException as error:
            self._failed(error)
            loaded = last_read  # nothing new reads the buffer; the previous copy still might
            raise
        finally:
            self.staging.give_back(staging, loaded)

    def _failed(self, error: BaseException) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = error

    # ---- the end ------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the threads (after their jobs), remove the directory with every file, free the staging buffers.
        Idempotent; does nothing in a forked child."""
        if self.closed or os.getpid() != self._pid:
            return
        self.closed = True
        _OPEN.discard(self)
        self._writer.shutdown(wait=True, cancel_futures=True)
        self._reader.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.path, ignore_errors=True)
        with self._lock:
            self.bytes_on_disk = 0
        self.staging.close()


def _bytes_of(buffer: Tensor, nbytes: int) -> memoryview:
    """The bytes of a contiguous 1-D host buffer as a writable memoryview (no copy)."""
    return memoryview(buffer.view(torch.uint8).numpy()).cast("B")[:nbytes]


def write_file(path: str, buffer: Tensor, nbytes: int) -> None:
    """Write the first ``nbytes`` of ``buffer`` to a new file ``path``, to the disk (not the page cache)."""
    done = 0
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            view = _bytes_of(buffer, nbytes)
            while done < nbytes:
                written = os.pwrite(fd, view[done:], done)
                if written <= 0:
                    raise OSError(errno.EIO, "the write returned no bytes")
                done += written
            os.fdatasync(fd)
            if hasattr(os, "posix_fadvise"):  # written: the page cache need not keep it
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except OSError as error:
        raise DiskTierError(
            f"disk tier: writing {nbytes:,} bytes to {path} failed after {done:,} bytes: "
            f"{error.strerror or error}" + (" (the disk is full)" if error.errno == errno.ENOSPC else "")
        ) from error


def read_file(path: str, buffer: Tensor, nbytes: int) -> None:
    """Read ``nbytes`` from file ``path`` into ``buffer``; :class:`DiskTierError` unless the file holds exactly
    them."""
    done = 0
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise DiskTierError(
                    f"disk tier: {path} holds {size:,} bytes where {nbytes:,} were written (truncated or changed "
                    f"by another process); its contents are not used"
                )
            view = _bytes_of(buffer, nbytes)
            while done < nbytes:
                got = os.preadv(fd, [view[done:]], done)
                if got <= 0:
                    raise DiskTierError(f"disk tier: short read of {path}: {done:,} of {nbytes:,} bytes, then the end "
                                        f"of the file")
                done += got
        finally:
            os.close(fd)
    except OSError as error:
        raise DiskTierError(f"disk tier: reading {nbytes:,} bytes from {path} failed after {done:,} bytes: "
                            f"{error.strerror or error}") from error


@dataclass
class _DiskChunk:
    path: str
    shape: torch.Size
    dtype: torch.dtype
    nbytes: int
    written: Future  # the write job
    reading: Optional[Future] = None  # the read job of the current device copy (result: its CUDA event, or None)
    device_copy: Optional[Tensor] = None  # allocated by prefetch, filled by the read job, until release


@dataclass
class DiskTier:
    """What a :class:`~lightning_fpdt.sequence.host_stash.StashFactory` spills with: the directory, and the host
    bytes its buffer pool may hold before entries go to disk (the strategy sets it per planned length)."""

    files: SpillDirectory
    host_budget_bytes: int

    def stash(self, device: torch.device, pool: HostBufferPool, streams: Optional[CopyStreams]) -> "DiskStash":
        return DiskStash(device, pool, streams, self)


class DiskStash(HostStash):
    """Chunks in host memory up to the tier's host budget, in files beyond it; see the module docstring.

    Args:
        device: where ``get`` returns tensors (a CUDA device, or the CPU for the tests).
        pool: the host buffers, shared by every stash of a factory (the budget counts all of them).
        streams: the copy streams on CUDA (``None`` on CPU).
        tier: the directory and the host budget.
    """

    def __init__(self, device: torch.device, pool: HostBufferPool, streams: Optional[CopyStreams],
                 tier: DiskTier) -> None:
        super().__init__(device, pool, streams)  # self._entries: key -> _HostChunk or _DiskChunk
        self.tier = tier

    def _in_host_memory(self, tensor: Tensor) -> bool:
        nbytes = tensor.numel() * tensor.element_size()
        return (self.pool.has_idle(tensor.dtype, tensor.numel())
                or self.pool.allocated_bytes + nbytes <= self.tier.host_budget_bytes)

    def put(self, key: Hashable, tensor: Tensor) -> None:
        files = self.tier.files
        files.check()
        if key in self._entries:
            raise RuntimeError(f"stash: put of {key!r}, which is already stashed (free it first)")
        if self._in_host_memory(tensor):
            return super().put(key, tensor)
        nbytes = tensor.numel() * tensor.element_size()
        staging, last_read = files.staging.acquire(tensor.dtype, tensor.numel())
        written = self._copy_to_host(staging.view(tensor.shape), tensor, last_read)
        path = files.new_file(nbytes)
        self._entries[key] = _DiskChunk(path, tensor.shape, tensor.dtype, nbytes,
                                        written=files.submit_write(path, staging, nbytes, written))

    def prefetch(self, key: Hashable) -> None:
        entry = self._check(key, "prefetch")
        if isinstance(entry, _HostChunk):
            return super().prefetch(key)
        files = self.tier.files
        files.check()
        if entry.device_copy is not None:
            return
        staging, last_read = files.staging.acquire(entry.dtype, entry.shape.numel())
        if self.streams is None:
            device_copy = torch.empty(entry.shape, dtype=entry.dtype, device=self.device)
        else:
            with torch.cuda.stream(self.streams.to_device):  # allocated where the read job's copy runs
                device_copy = torch.empty(entry.shape, dtype=entry.dtype, device=self.device)
        entry.device_copy = device_copy
        entry.reading = files.submit_read(entry, staging, last_read, device_copy, self.streams)

    def get(self, key: Hashable) -> Tensor:
        entry = self._check(key, "get")
        if isinstance(entry, _HostChunk):
            return super().get(key)
        self.prefetch(key)
        loaded = entry.reading.result()  # the file read and the copy issued (raises the job's DiskTierError)
        if self.streams is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(loaded)
            entry.device_copy.record_stream(compute)  # allocated on the copy stream, used on this one
        return entry.device_copy

    def release(self, key: Hashable) -> None:
        entry = self._check(key, "release")
        if isinstance(entry, _HostChunk):
            return super().release(key)
        if entry.reading is not None:
            _settle(entry.reading)  # the job holds the device copy until it has issued its copy
        entry.device_copy = entry.reading = None

    def free(self, key: Hashable) -> None:
        entry = self._check(key, "free")
        if isinstance(entry, _HostChunk):
            return super().free(key)
        for job in (entry.reading, entry.written):
            if job is not None:
                _settle(job)  # a failure is kept by the directory and raised by the next call
        self.tier.files.remove_file(entry.path, entry.nbytes)
        del self._entries[key]

    def clear(self) -> None:
        super().clear()
        self.tier.files.check()

    @property
    def nbytes(self) -> int:
        """Host bytes held by the stash now (entries in the pool's buffers)."""
        return sum(e.buffer.numel() * e.buffer.element_size() for e in self._entries.values()
                   if isinstance(e, _HostChunk))

    @property
    def disk_bytes(self) -> int:
        """Bytes of this stash's entries on disk."""
        return sum(e.nbytes for e in self._entries.values() if isinstance(e, _DiskChunk))

    @property
    def resident_bytes(self) -> int:
        return sum(e.device_copy.numel() * e.device_copy.element_size() for e in self._entries.values()
                   if e.device_copy is not None)

    def on_disk(self, key: Hashable) -> bool:
        """Whether ``key``'s entry is in a file."""
        return isinstance(self._check(key, "on_disk"), _DiskChunk)


def _settle(job: Future) -> Any:
    """Wait for ``job``; its failure is the directory's to raise."""
    try:
        return job.result()
    except BaseException:
        return None
