"""A disk tier under the host stash: entries spill to files once the host memory given to the stash is spoken for.

The life cycle is :class:`~lightning_fpdt.sequence.host_stash.ChunkStash`'s (``put``, ``prefetch``, ``get``,
``release``, ``free``; misuse raises ``RuntimeError``). A :class:`DiskStash` keeps an entry in the host buffer pool
while the pool's bytes stay within :attr:`DiskTier.host_budget_bytes` (an idle buffer of the entry's size is reused
at no cost); past that, the entry goes to a file:

- ``put`` hands the tensor to a writer thread and returns. The thread streams it to the file through its staging
  buffers, a piece at a time: the device-to-host copy of a piece (on the copy stream, after a CUDA event of the compute
  stream recorded by ``put``) overlaps the write of the piece before (``os.pwrite``; each piece's pages are pushed to
  the disk and dropped from the page cache, ``sync_file_range`` and ``POSIX_FADV_DONTNEED``: the spilled bytes must
  not stay in host memory, the memory the tier exists to spare). The write holds the tensor until its last piece is
  copied; a ``put`` to disk first waits for the write before it, so a written-behind tensor outlives its block's
  forward only where the disk is slower than that forward (the time the planner counts), never into the next one.
- ``prefetch`` allocates the device copy (on the host-to-device stream, as :class:`HostStash`) and hands the entry to
  a reader thread, which reads the file a piece at a time into its staging buffers (``os.preadv``) and issues each
  piece's host-to-device copy on that stream, recording an event; the read of a piece overlaps the copy of the piece
  before. ``get`` waits for the read and makes the compute stream wait for the last event.
- ``free`` removes the file: its space is free again at once.

Staging buffers (:class:`StagingBuffers`) are each thread's own: :data:`STAGING_DEPTH` buffers of
``min(piece_bytes, the largest entry)`` (anonymous mappings registered with CUDA, ``host_memory.HostAllocator``), so
the tier's host memory does not grow with the entry: a 12 GiB block input streams through four 256 MiB buffers
(:data:`STAGING_PIECE_BYTES`), not two copies of itself. On CPU the same threads, files and buffers run with plain
tensors and no streams, so the tests cover the logic.

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
import ctypes
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
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_fpdt.sequence.host_memory import HostAllocator, HostMemoryGuard
from lightning_fpdt.sequence.host_stash import CopyStreams, HostBufferPool, HostStash, _HostChunk

STAGING_DEPTH = 2
"""Staging buffers of each thread: the writer copies a piece from the device into one while it writes the other to
the disk; the reader reads a piece into one while the other feeds the device."""
STAGING_PIECE_BYTES = 256 * 2**20
"""The largest staging buffer: an entry larger than this streams through pieces of this size (256 MiB: a piece's
write, about 0.17 s at 1.5 GB/s, dwarfs its copy from the device and the call's own cost)."""
STAGING_THREADS = 2
"""Threads with staging buffers of their own: the writer and the reader."""
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


def staging_bytes(entry_bytes: int, piece_bytes: int = STAGING_PIECE_BYTES) -> int:
    """Host bytes of the tier's staging buffers once entries of ``entry_bytes`` went through it: each thread's
    buffers of ``min(piece_bytes, entry_bytes)``, as many as an entry has pieces up to :data:`STAGING_DEPTH` (an
    entry of one piece uses one)."""
    pieces = -(-entry_bytes // piece_bytes)
    return STAGING_THREADS * min(STAGING_DEPTH, pieces) * min(piece_bytes, entry_bytes)


class StagingBuffers:
    """One thread's host buffers between the device and the files: :data:`STAGING_DEPTH` buffers, used in turn, each
    ``min(piece_bytes, the largest entry it carried)`` bytes (a larger entry replaces a smaller buffer once).

    Only the owning thread takes them (no lock); each buffer carries the CUDA event of its last host-to-device copy,
    waited for before the buffer is written again or given back.
    """

    def __init__(self, allocator: HostAllocator, piece_bytes: int, depth: int = STAGING_DEPTH,
                 what: str = "a disk staging buffer") -> None:
        if piece_bytes < 1:
            raise ValueError(f"piece_bytes must be at least 1 byte, got {piece_bytes}")
        self.allocator = allocator
        self.piece_bytes = piece_bytes
        self.depth = depth
        self.what = what
        self._buffers: list[Optional[Tensor]] = [None] * depth
        self._last_read: list[Optional[torch.cuda.Event]] = [None] * depth

    def take(self, turn: int, entry_bytes: int) -> Tensor:
        """The buffer of piece number ``turn`` of an entry of ``entry_bytes``, once its last device read is done."""
        index = turn % self.depth
        self._settle(index)
        size = min(self.piece_bytes, entry_bytes)
        buffer = self._buffers[index]
        if buffer is None or buffer.numel() < size:
            if buffer is not None:
                self.allocator.release(buffer)
                self._buffers[index] = None
            buffer = self._buffers[index] = self.allocator.empty(size, torch.uint8, what=self.what)
        return buffer

    def read_by(self, turn: int, event: Optional[torch.cuda.Event]) -> None:
        """Piece ``turn``'s buffer is read by the host-to-device copy ending with ``event``."""
        self._last_read[turn % self.depth] = event

    def _settle(self, index: int) -> None:
        if self._last_read[index] is not None:
            self._last_read[index].synchronize()
            self._last_read[index] = None

    def close(self) -> None:
        """Free the buffers (their copies done first); the owning thread has ended."""
        for index, buffer in enumerate(self._buffers):
            self._settle(index)
            if buffer is not None:
                self.allocator.release(buffer)
        self._buffers = [None] * self.depth


class Staging:
    """The writer's and the reader's :class:`StagingBuffers`, on one allocator (its count is the tier's pinned host
    memory)."""

    def __init__(self, allocator: HostAllocator, piece_bytes: int = STAGING_PIECE_BYTES,
                 depth: int = STAGING_DEPTH) -> None:
        self.allocator = allocator
        self.writes = StagingBuffers(allocator, piece_bytes, depth, "a disk staging buffer (writes)")
        self.reads = StagingBuffers(allocator, piece_bytes, depth, "a disk staging buffer (reads)")

    @property
    def allocated_bytes(self) -> int:
        return self.allocator.allocated_bytes

    def close(self) -> None:
        self.writes.close()
        self.reads.close()
        self.allocator.close()


_OPEN: "weakref.WeakSet[SpillDirectory]" = weakref.WeakSet()
"""The spill directories of this process not yet closed: removed at exit (the only module state; see close)."""


def _close_open() -> None:
    for directory in list(_OPEN):
        directory.close()


atexit.register(_close_open)


class SpillDirectory:
    """The spill files of one process: its directory, one writer and one reader thread, their staging buffers.

    Args:
        offload_dir: the directory given by the user (created if missing, :func:`prepare_offload_dir`).
        rank: this process's global rank, in the directory's name.
        pin_memory: page-lock the staging buffers (CUDA runs).
        guard: asked before each new staging buffer (the strategy's host memory guard).
        piece_bytes: the largest staging buffer (:data:`STAGING_PIECE_BYTES`; the tests stream through small ones).
    """

    def __init__(self, offload_dir: str, *, rank: int, pin_memory: bool, guard: Optional[HostMemoryGuard] = None,
                 piece_bytes: int = STAGING_PIECE_BYTES) -> None:
        self.root = prepare_offload_dir(offload_dir)
        self.path = os.path.join(self.root, directory_name(rank))
        # a directory of this name is ours or a dead process's that had our pid: no live process can own it
        shutil.rmtree(self.path, ignore_errors=True)
        os.makedirs(self.path)
        self.staging = Staging(HostAllocator(pin=pin_memory, guard=guard), piece_bytes)
        self.failure: Optional[BaseException] = None
        """The first background failure; raised again by every later stash call (module docstring)."""
        self.bytes_on_disk = 0
        """Bytes of the files now (counted from ``put``, so including writes still in flight)."""
        self.peak_bytes_on_disk = 0
        self._serial = itertools.count()
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="fpdt-disk-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="fpdt-disk-read")
        self._last_write: Optional[Future] = None
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

    def submit_write(self, path: str, source: Tensor, produced: Optional[torch.cuda.Event],
                     streams: Optional[CopyStreams]) -> Future:
        """Write ``source`` (1-D bytes; on the device, computed at ``produced``) to the new file ``path`` behind,
        once the write before it is done: the writes hold their tensors, and at most one is in flight."""
        if self._last_write is not None:
            _settle(self._last_write)
        self.check()  # that write may have failed
        self._last_write = self._writer.submit(self._write_job, path, source, produced, streams)
        return self._last_write

    def submit_read(self, entry: "_DiskChunk", device_copy: Tensor, streams: Optional[CopyStreams]) -> Future:
        return self._reader.submit(self._read_job, entry, device_copy, streams)

    # ---- the threads -------------------------------------------------------------------------------------------
    def _write_job(self, path: str, source: Tensor, produced: Optional[torch.cuda.Event],
                   streams: Optional[CopyStreams]) -> None:
        buffers = self.staging.writes
        nbytes = source.numel()
        in_flight: list[tuple[Tensor, int, int, Optional[torch.cuda.Event]]] = []  # buffer, offset, bytes, copied
        done = turn = offset = 0
        stream = None if streams is None else streams.to_host
        if stream is not None and produced is not None:
            stream.wait_event(produced)  # the tensor is computed: every piece's copy is queued behind this
        try:
            with _SpillFile(path, "write", nbytes) as file:
                while offset < nbytes or in_flight:
                    while offset < nbytes and len(in_flight) < buffers.depth:  # the next piece from the device
                        buffer = buffers.take(turn, nbytes)
                        count = min(buffer.numel(), nbytes - offset)
                        in_flight.append((buffer, offset, count,
                                          _copy_piece(buffer[:count], source[offset:offset + count], stream)))
                        offset += count
                        turn += 1
                    buffer, at, count, copied = in_flight.pop(0)
                    if copied is not None:
                        copied.synchronize()  # the piece is in the staging buffer
                    file.write(buffer[:count], at)
                    done = at + count
                file.finish()
        except OSError as error:
            failure = DiskTierError(
                f"disk tier: writing {nbytes:,} bytes to {path} failed after {done:,} bytes: "
                f"{error.strerror or error}" + (" (the disk is full)" if error.errno == errno.ENOSPC else ""))
            self._failed(failure)
            raise failure from error
        except BaseException as error:
            self._failed(error)
            raise
        finally:
            for _, _, _, copied in in_flight:
                if copied is not None:
                    copied.synchronize()  # no copy may still read the source, nor write a buffer, after this
            del source  # the device memory may go (its stream use is recorded)

    def _read_job(self, entry: "_DiskChunk", device_copy: Tensor,
                  streams: Optional[CopyStreams]) -> Optional[torch.cuda.Event]:
        buffers = self.staging.reads
        loaded = None
        turn = offset = 0
        try:
            entry.written.result()  # the file is whole (raises the write's failure)
            with _SpillFile(entry.path, "read", entry.nbytes) as file:
                while offset < entry.nbytes:
                    buffer = buffers.take(turn, entry.nbytes)  # its previous copy to the device is done
                    count = min(buffer.numel(), entry.nbytes - offset)
                    file.read(buffer[:count], offset)
                    target = device_copy[offset:offset + count]
                    if streams is None:
                        target.copy_(buffer[:count])
                    else:
                        with torch.cuda.stream(streams.to_device):
                            target.copy_(buffer[:count], non_blocking=True)
                            loaded = streams.to_device.record_event()
                        buffers.read_by(turn, loaded)
                    offset += count
                    turn += 1
            return loaded
        except OSError as error:
            failure = DiskTierError(f"disk tier: reading {entry.nbytes:,} bytes from {entry.path} failed after "
                                    f"{offset:,} bytes: {error.strerror or error}")
            self._failed(failure)
            raise failure from error
        except BaseException as error:
            self._failed(error)
            raise

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
        self._last_write = None
        shutil.rmtree(self.path, ignore_errors=True)
        with self._lock:
            self.bytes_on_disk = 0
        self.staging.close()


def _copy_piece(buffer: Tensor, piece: Tensor, stream: Optional[torch.cuda.Stream]) -> Optional[torch.cuda.Event]:
    """Copy ``piece`` into the host ``buffer``: on CUDA on ``stream`` (returns the copy's end)."""
    if stream is None:
        buffer.copy_(piece)
        return None
    with torch.cuda.stream(stream):
        buffer.copy_(piece, non_blocking=True)
        return stream.record_event()


def _bytes_of(buffer: Tensor) -> memoryview:
    """The bytes of a contiguous 1-D uint8 host buffer as a writable memoryview (no copy)."""
    return memoryview(buffer.numpy()).cast("B")


_SYNC_FILE_RANGE_WRITE, _SYNC_FILE_RANGE_WAIT = 2, 1 | 2 | 4  # start writeback; wait before, write, wait after


def _libc_sync_file_range() -> Optional[Callable[[int, int, int, int], int]]:
    """Linux's ``sync_file_range`` (writeback of a range of a file, without waiting for the whole file), or
    ``None``."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)
    return function


_sync_file_range = _libc_sync_file_range()


class _SpillFile:
    """One spill file, written or read a piece at a time at given offsets; its pages leave the page cache as it goes.

    Written: each piece's writeback starts at once and is waited for one piece later, then its pages are dropped
    (``sync_file_range``, ``POSIX_FADV_DONTNEED``; where the call is missing, ``fdatasync`` of the whole file at the
    end does it), so the page cache holds about two pieces, not the entry. Read: each piece's pages are dropped once
    read. A file of another size than ``nbytes`` is refused at the read (:class:`DiskTierError`), never used.
    """

    def __init__(self, path: str, mode: str, nbytes: int) -> None:
        self.path, self.mode, self.nbytes = path, mode, nbytes
        self._pending: Optional[tuple[int, int]] = None  # the written piece whose writeback is not yet waited for

    def __enter__(self) -> "_SpillFile":
        cloexec = getattr(os, "O_CLOEXEC", 0)
        if self.mode == "write":
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | cloexec, 0o600)
            return self
        self.fd = os.open(self.path, os.O_RDONLY | cloexec)
        size = os.fstat(self.fd).st_size
        if size != self.nbytes:
            os.close(self.fd)
            raise DiskTierError(f"disk tier: {self.path} holds {size:,} bytes where {self.nbytes:,} were written "
                                f"(truncated or changed by another process); its contents are not used")
        return self

    def __exit__(self, *exc: Any) -> None:
        os.close(self.fd)

    def write(self, buffer: Tensor, offset: int) -> None:
        view, done = _bytes_of(buffer), 0
        while done < len(view):
            written = os.pwrite(self.fd, view[done:], offset + done)
            if written <= 0:
                raise OSError(errno.EIO, "the write returned no bytes")
            done += written
        if _sync_file_range is not None:
            _push(self.fd, offset, len(view), _SYNC_FILE_RANGE_WRITE)  # to the disk, behind
            if self._pending is not None:
                self._written(*self._pending)
            self._pending = (offset, len(view))

    def _written(self, offset: int, count: int) -> None:
        _push(self.fd, offset, count, _SYNC_FILE_RANGE_WAIT)
        _drop_cached(self.fd, offset, count)

    def finish(self) -> None:
        """The file's last piece on the disk and out of the page cache."""
        if self._pending is not None:
            self._written(*self._pending)
            self._pending = None
        os.fdatasync(self.fd)  # the size, and every piece where sync_file_range is missing
        _drop_cached(self.fd, 0, 0)

    def read(self, buffer: Tensor, offset: int) -> None:
        view, done = _bytes_of(buffer), 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise DiskTierError(f"disk tier: short read of {self.path}: {offset + done:,} of {self.nbytes:,} "
                                    f"bytes, then the end of the file")
            done += got
        _drop_cached(self.fd, offset, len(view))


_NOT_TAKEN = {errno.EINVAL, errno.ESPIPE, errno.ENOSYS, errno.EOPNOTSUPP}
"""sync_file_range errors that say the file system does not take the call: its pages then stay cached until the
file's fdatasync."""


def _push(fd: int, offset: int, count: int, flags: int) -> None:
    """``sync_file_range`` of a written piece; a write error it reports (it is reported once) raises ``OSError``."""
    if _sync_file_range(fd, offset, count, flags):
        error = ctypes.get_errno()
        if error not in _NOT_TAKEN:
            raise OSError(error, os.strerror(error))


def _drop_cached(fd: int, offset: int, count: int) -> None:
    if hasattr(os, "posix_fadvise"):  # clean pages: the page cache need not keep them (count 0: to the end)
        os.posix_fadvise(fd, offset, count, os.POSIX_FADV_DONTNEED)


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
        source = tensor.contiguous().view(-1).view(torch.uint8)  # its bytes (a copy only if it was not contiguous)
        produced = None
        if self.streams is not None:
            produced = torch.cuda.current_stream(self.device).record_event()
            source.record_stream(self.streams.to_host)  # its memory is not reused before the copies have read it
        path = files.new_file(nbytes)
        self._entries[key] = _DiskChunk(path, tensor.shape, tensor.dtype, nbytes,
                                        written=files.submit_write(path, source, produced, self.streams))

    def prefetch(self, key: Hashable) -> None:
        entry = self._check(key, "prefetch")
        if isinstance(entry, _HostChunk):
            return super().prefetch(key)
        files = self.tier.files
        files.check()
        if entry.device_copy is not None:
            return
        if self.streams is None:
            device_copy = torch.empty(entry.shape, dtype=entry.dtype, device=self.device)
        else:
            with torch.cuda.stream(self.streams.to_device):  # allocated where the read job's copy runs
                device_copy = torch.empty(entry.shape, dtype=entry.dtype, device=self.device)
        entry.device_copy = device_copy
        entry.reading = files.submit_read(entry, device_copy.view(-1).view(torch.uint8), self.streams)

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
