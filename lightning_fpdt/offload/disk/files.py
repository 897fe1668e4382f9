"""The disk tier's files and threads: :class:`SpillDirectory` (one directory per process, a writer and a reader thread,
one file per entry) and the pieces its threads stream through."""

from __future__ import annotations

import atexit
import ctypes
import errno
import itertools
import os
import shutil
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_fpdt.offload.disk.directory import DiskTierError, directory_name, prepare_offload_dir
from lightning_fpdt.offload.disk.staging import STAGING_PIECE_BYTES, Staging
from lightning_fpdt.offload.host_memory import HostAllocator, HostMemoryGuard
from lightning_fpdt.offload.host_stash import CopyStreams

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


def _settle(job: Future) -> Any:
    """Wait for ``job``; its failure is the directory's to raise."""
    try:
        return job.result()
    except BaseException:
        return None
