"""Host memory that costs what it holds, and the readings that say what the process holds.

Pinned memory from PyTorch's caching host allocator (``torch.empty(n, pin_memory=True)``, ``Tensor.pin_memory()``)
is rounded up to a power of two: a 3 GiB buffer pins 4 GiB, and a run planned for 84 GiB of block inputs pins 112.
Here a host buffer is its own anonymous memory mapping of exactly the bytes asked for (rounded to the page), and on
a CUDA machine that mapping is registered with the driver (``cudaHostRegister``): page-locked like ``cudaHostAlloc``
memory, copied to and from the GPU asynchronously at the same rates, and counted byte for byte.

- :class:`HostAllocator` makes such buffers (``empty``) and registers tensors that exist already (``register``:
  FSDP2's sharded parameters when the states live on the host); it counts the bytes it pins and asks its
  :class:`HostMemoryGuard` before each new buffer.
- The mappings are not inherited by child processes (``MADV_DONTFORK``): a fork would otherwise copy every
  page-locked page at once, and a job holding most of the host in pinned buffers would be killed by the first
  process it starts.
- A registration that cannot be ended (``cudaHostUnregister`` fails) keeps its memory mapped until the process ends,
  with a warning: unmapping memory the driver still has registered would let a later mapping at the same address be
  written through the old pages.
- :class:`HostMemoryGuard` refuses a buffer that would leave the host with less than its reserve, with a
  :class:`HostMemoryError` naming the plan the run was accepted on and the change that fits: the kernel's
  out-of-memory killer ends a process without a word, and pinned pages cannot be swapped.
- :func:`available_host_memory`, :func:`resident_bytes`, :func:`peak_resident_bytes` and
  :func:`reset_peak_resident` read the host's and this process's memory (``/proc``), for the planner, the setup
  check and the benchmarks' per-phase host peaks.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

PAGE_BYTES = mmap.PAGESIZE


class HostMemoryError(RuntimeError):
    """The host ran short of memory for a buffer the run needs (the message names the plan and the fix)."""


def available_host_memory() -> Optional[int]:
    """Bytes of memory this host can still give (``MemAvailable`` of /proc/meminfo; psutil elsewhere), or ``None``."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file says kB and means KiB
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def _status_bytes(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resident_bytes() -> Optional[int]:
    """This process's resident memory now (``VmRSS``: pinned and pageable pages alike); off Linux psutil's reading
    where it is installed, else ``None``."""
    found = _status_bytes("VmRSS")
    if found is not None:
        return found
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.Process().memory_info().rss)


def peak_resident_bytes() -> Optional[int]:
    """This process's highest resident memory since it started or since :func:`reset_peak_resident` (``VmHWM``)."""
    return _status_bytes("VmHWM")


def reset_peak_resident() -> bool:
    """Start a new peak of :func:`peak_resident_bytes` here (``/proc/self/clear_refs``); ``False`` where the kernel
    does not allow it (the peak then runs from the process start)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def page_rounded(nbytes: int) -> int:
    """The bytes a mapping of ``nbytes`` takes: whole pages."""
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


@dataclass
class HostMemoryGuard:
    """Refuses a new host buffer that would leave less than ``reserve_bytes`` of the host's memory available.

    ``describe`` says, for the error, on which plan the run was accepted and what change fits (the strategy sets it
    once the plan is known); ``available`` reads the host (tests give their own)."""

    reserve_bytes: int = 2 * 2**30
    """Memory left to the rest of the host: the kernel, page cache the run needs, other processes' growth."""
    describe: Callable[[], str] = lambda: ""
    available: Callable[[], Optional[int]] = available_host_memory

    def check(self, nbytes: int, what: str) -> None:
        """Raise :class:`HostMemoryError` if ``nbytes`` more would leave less than the reserve (not when unknown)."""
        available = self.available()
        if available is None or available - nbytes >= self.reserve_bytes:
            return
        said = self.describe()
        raise HostMemoryError(
            f"host memory ran short: {what} needs {_size(nbytes)} more, the host has {_size(available)} "
            f"available and {_size(self.reserve_bytes)} stay in reserve (pinned pages cannot be swapped; "
            f"going on would end with the kernel killing the process without a message)."
            + (f" {said}" if said else " Plan the run with `lightning-fpdt plan --host-memory-gib auto`.")
        )


def _not_inherited(address: int, nbytes: int) -> None:
    """``MADV_DONTFORK`` on the whole pages of ``[address, address + nbytes)`` (memory another allocator owns: the
    pages it shares with its neighbours stay as they are)."""
    start = page_rounded(address)
    end = (address + nbytes) // PAGE_BYTES * PAGE_BYTES
    if end > start:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTFORK):
            error = ctypes.get_errno()
            warnings.warn(f"fpdt: madvise(MADV_DONTFORK) of the {_size(end - start)} at {start:#x} failed "
                          f"({os.strerror(error)}): a child process started while they are page-locked copies them",
                          RuntimeWarning, stacklevel=3)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**27 else f"{nbytes / 2**20:.2f} MiB"


_STILL_REGISTERED: list[tuple[int, Tensor]] = []
"""Buffers whose registration could not be ended, kept alive (mapped) until the process ends."""


def _end_registration(address: int, tensor: Tensor) -> None:
    """``cudaHostUnregister`` of ``tensor``'s memory at ``address``; where it fails, the tensor is kept for the life of
    the process (its memory must not be unmapped while the driver may still have it registered) and a warning says
    so."""
    error = int(torch.cuda.cudart().cudaHostUnregister(address))
    if error:
        _STILL_REGISTERED.append((address, tensor))
        warnings.warn(f"fpdt: cudaHostUnregister of the {_size(tensor.untyped_storage().nbytes())} host buffer at "
                      f"{address:#x} failed with CUDA error {error}; it stays mapped until the process ends",
                      RuntimeWarning, stacklevel=3)


def _unregister(held: list[tuple[int, Tensor]], pinned: bool) -> None:
    """End the registrations of ``held`` (address, tensor), then let the tensors go: unregistered before unmapped."""
    while held:
        address, tensor = held.pop()
        if pinned:
            _end_registration(address, tensor)


class HostAllocator:
    """Host buffers of exactly the bytes asked for, page-locked for the GPU's copy engines when ``pin``.

    Args:
        pin: register the buffers with CUDA (``cudaHostRegister``); ``False`` (CPU runs, the tests) leaves them
            pageable, counted the same way.
        guard: asked before each new buffer; ``None``: no check.
    """

    def __init__(self, *, pin: bool, guard: Optional[HostMemoryGuard] = None) -> None:
        self.pin = pin
        self.guard = guard
        self.allocated_bytes = 0
        """Bytes of the buffers this allocator made and the tensors it registered (exactly what was asked for)."""
        self.mapped_bytes = 0
        """The same in whole pages: what the host gives for them."""
        self._lock = threading.Lock()
        self._held: list[tuple[int, Tensor]] = []  # (address, tensor) of registered storages, kept alive till close
        self._finalizer = weakref.finalize(self, _unregister, self._held, pin)

    def empty(self, numel: int, dtype: torch.dtype, what: str = "a host buffer") -> Tensor:
        """A 1-D host tensor of ``numel`` elements on a mapping of its own (uninitialised; zero pages until written)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if self.guard is not None:
            self.guard.check(page_rounded(nbytes), what)
        # private anonymous pages, page-aligned; unmapped with the last tensor that views them
        mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # not inherited by a child process: a fork copies every page-locked page of a private mapping at once
        # (Linux copies DMA-pinned anonymous pages eagerly instead of sharing them copy-on-write), so one fork while
        # the stash is held - a compiler's worker, a data loader's - would double the host memory it holds
        mapping.madvise(mmap.MADV_DONTFORK)
        tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes).view(dtype) if nbytes else \
            torch.empty(0, dtype=dtype)
        if self.pin and nbytes:
            self._register(tensor, nbytes)
        with self._lock:
            self.allocated_bytes += nbytes
            self.mapped_bytes += page_rounded(nbytes)
        return tensor

    def release(self, tensor: Tensor) -> None:
        """Give back a buffer :meth:`empty` made (its registration ends now; its pages go with its last view)."""
        address = tensor.untyped_storage().data_ptr()
        nbytes = tensor.untyped_storage().nbytes()
        with self._lock:
            for index, (held, kept) in enumerate(self._held):
                if held == address:
                    if self.pin:
                        _end_registration(address, kept)
                    del self._held[index]
                    break
            self.allocated_bytes -= nbytes
            self.mapped_bytes -= page_rounded(nbytes)

    def register(self, tensor: Tensor) -> None:
        """Page-lock the memory of an existing host ``tensor`` (its whole storage, once however many tensors view it)
        and count it; counted only unless ``pin``. The allocator keeps the tensor alive until :meth:`close`."""
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if not nbytes or any(address == storage.data_ptr() for address, _ in self._held):
            return
        if self.pin:
            self._register(tensor, nbytes)
            _not_inherited(storage.data_ptr(), nbytes)
        else:
            self._held.append((storage.data_ptr(), tensor))
        with self._lock:
            self.allocated_bytes += nbytes
            self.mapped_bytes += nbytes

    def _register(self, tensor: Tensor, nbytes: int) -> None:
        address = tensor.untyped_storage().data_ptr()
        error = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
        if int(error) != 0:
            raise HostMemoryError(
                f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed with CUDA error {int(error)} (the host could not "
                f"page-lock the memory: too little memory, or a locked-memory limit; `ulimit -l` shows it)"
            )
        with self._lock:
            self._held.append((address, tensor))

    def close(self) -> None:
        """End every registration now (the end of training); the memory goes with the last tensor that views it."""
        self._finalizer()
