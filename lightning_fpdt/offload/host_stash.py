"""Where the FPDT attention keeps its chunks between the forward and the backward.

The chunk loop talks to a stash through a small life cycle: ``put`` a chunk once; ``prefetch`` it ahead of use;
``get`` it (blocks the compute stream until it is resident); ``release`` the resident copy after use (the stash keeps
its own); ``free`` it once at the end. Misuse (a second ``put`` of the same key, ``get``/``prefetch``/``release``/
``free`` of a key never put or already freed) raises ``RuntimeError``: those are scheduling bugs that would
otherwise show up as wrong gradients or a hang.

- :class:`ChunkStash` keeps the tensors where they are (device memory): ``offload=False``.
- :class:`HostStash` keeps them in host memory (pinned on CUDA) from a :class:`HostBufferPool` that allocates each
  buffer size once and reuses it across chunks, layers and steps (pinning is slow); its buffers hold exactly the bytes
  asked for (:class:`~lightning_fpdt.offload.host_memory.HostAllocator`). On CUDA, ``put`` copies on a
  device-to-host stream and ``prefetch`` on a host-to-device stream, ordered by CUDA events only: no
  ``synchronize()`` and no barrier anywhere in the chunk loops. On CPU the same logic runs with plain tensors and
  no streams, so the multi-process CPU tests cover it.
- :class:`~lightning_fpdt.offload.disk.DiskStash` (a factory with a ``disk`` tier) keeps them in host memory
  up to a budget and in files beyond it.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_fpdt.offload.host_memory import HostAllocator, HostMemoryGuard


class ChunkStash:
    """Keyed chunk store that keeps tensors in place; see the module docstring for the life cycle."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, Any] = {}  # key -> tensor here; key -> _HostChunk in HostStash

    def put(self, key: Hashable, tensor: Tensor) -> None:
        if key in self._entries:
            raise RuntimeError(f"stash: put of {key!r}, which is already stashed (free it first)")
        self._entries[key] = tensor

    def prefetch(self, key: Hashable) -> None:
        """Start bringing ``key`` back ahead of its ``get``; a no-op for chunks kept in place."""
        self._check(key, "prefetch")

    def get(self, key: Hashable) -> Tensor:
        self._check(key, "get")
        return self._entries[key]

    def release(self, key: Hashable) -> None:
        """The caller is done with the tensor ``get`` returned (for now); a no-op for chunks kept in place."""
        self._check(key, "release")

    def free(self, key: Hashable) -> None:
        self._check(key, "free")
        del self._entries[key]

    def clear(self) -> None:
        """Drop every chunk (the end of a backward, or a forward whose graph is discarded)."""
        for key in list(self._entries):
            self.free(key)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes held by the stash now."""
        return sum(t.numel() * t.element_size() for t in self._entries.values())

    def _check(self, key: Hashable, verb: str) -> Any:
        if key not in self._entries:
            raise RuntimeError(f"stash: {verb} of {key!r}, which was never put or was already freed")
        return self._entries[key]


class HostBufferPool:
    """Host buffers (pinned on CUDA machines) by ``(dtype, numel)``, allocated once and reused.

    A buffer handed back carries the event of its last device read; its next user waits on that event before
    writing, so a buffer is never overwritten while a copy still reads it. Each buffer is exactly the bytes asked for
    (rounded to the page): ``allocated_bytes`` is what the host gives.

    Args:
        pin_memory: page-lock the buffers (CUDA machines).
        guard: asked before each new buffer (the strategy's: a host that runs short ends the run with an error that
            names its plan, not with the kernel's out-of-memory kill).
        what: what the buffers hold, for that error.
    """

    def __init__(self, pin_memory: bool, guard: Optional[HostMemoryGuard] = None, what: str = "a host buffer") -> None:
        self.pin_memory = pin_memory
        self.allocator = HostAllocator(pin=pin_memory, guard=guard)
        self.what = what
        self._idle: dict[tuple[torch.dtype, int], list[tuple[Tensor, Optional[torch.cuda.Event]]]] = {}

    @property
    def allocated_bytes(self) -> int:
        """Host memory this pool has allocated (the peak of what was live at once)."""
        return self.allocator.allocated_bytes

    def acquire(self, dtype: torch.dtype, numel: int) -> tuple[Tensor, Optional[torch.cuda.Event]]:
        idle = self._idle.get((dtype, numel))
        if idle:
            return idle.pop()
        return self.allocator.empty(numel, dtype, what=self.what), None

    def has_idle(self, dtype: torch.dtype, numel: int) -> bool:
        """Whether a buffer of this size waits to be reused (acquiring it allocates nothing)."""
        return bool(self._idle.get((dtype, numel)))

    def give_back(self, buffer: Tensor, last_read: Optional[torch.cuda.Event]) -> None:
        self._idle.setdefault((buffer.dtype, buffer.numel()), []).append((buffer, last_read))

    def trim(self) -> int:
        """Free the idle buffers (a new sequence length needs other sizes); returns the bytes freed."""
        freed = 0
        for buffers in self._idle.values():
            for buffer, last_read in buffers:
                if last_read is not None:
                    last_read.synchronize()  # a copy may still read it
                freed += buffer.numel() * buffer.element_size()
                self.allocator.release(buffer)
        self._idle.clear()
        return freed


@dataclass
class _HostChunk:
    host: Tensor  # the stash's own copy, (shape) view of a pool buffer
    buffer: Tensor  # the pool buffer behind it
    device_copy: Optional[Tensor] = None  # resident copy after prefetch, until release
    written: Optional[torch.cuda.Event] = None  # device-to-host copy finished
    loaded: Optional[torch.cuda.Event] = None  # host-to-device copy finished


class CopyStreams:
    """One CUDA stream per copy direction, shared by every stash of a model."""

    def __init__(self, device: torch.device) -> None:
        self.to_host = torch.cuda.Stream(device=device)
        self.to_device = torch.cuda.Stream(device=device)


class HostStash(ChunkStash):
    """Chunks in host memory, brought back on demand; see the module docstring.

    Args:
        device: where ``get`` returns tensors (a CUDA device, or the CPU for the tests).
        pool: the host buffers, shared by every stash of a model.
        streams: the copy streams on CUDA (``None`` on CPU).
    """

    def __init__(self, device: torch.device, pool: HostBufferPool, streams: Optional[CopyStreams]) -> None:
        super().__init__()  # self._entries: key -> _HostChunk
        self.device = device
        self.pool = pool
        self.streams = streams

    def put(self, key: Hashable, tensor: Tensor) -> None:
        if key in self._entries:
            raise RuntimeError(f"stash: put of {key!r}, which is already stashed (free it first)")
        buffer, last_read = self.pool.acquire(tensor.dtype, tensor.numel())
        entry = _HostChunk(host=buffer.view(tensor.shape), buffer=buffer)
        entry.written = self._copy_to_host(entry.host, tensor, last_read)
        self._entries[key] = entry

    def _copy_to_host(self, host: Tensor, tensor: Tensor, last_read: Optional[torch.cuda.Event]
                      ) -> Optional[torch.cuda.Event]:
        """Copy ``tensor`` into the host buffer ``host`` (on CUDA: on the device-to-host stream, once the chunk is
        computed and the buffer's last reader is done); returns the event of the copy's end (``None`` on CPU)."""
        if self.streams is None:
            host.copy_(tensor)
            return None
        produced = torch.cuda.current_stream(self.device).record_event()
        stream = self.streams.to_host
        with torch.cuda.stream(stream):
            stream.wait_event(produced)  # the chunk is computed
            if last_read is not None:
                stream.wait_event(last_read)  # the buffer's previous contents have been read back
            host.copy_(tensor, non_blocking=True)
            written = stream.record_event()
        tensor.record_stream(stream)  # its memory is not reused before the copy has read it
        return written

    def prefetch(self, key: Hashable) -> None:
        entry = self._check(key, "prefetch")
        if entry.device_copy is not None:
            return
        if self.streams is None:
            entry.device_copy = entry.host.clone()  # a separate tensor, as on the GPU
            return
        stream = self.streams.to_device
        with torch.cuda.stream(stream):
            stream.wait_event(entry.written)
            device_copy = torch.empty(entry.host.shape, dtype=entry.host.dtype, device=self.device)
            device_copy.copy_(entry.host, non_blocking=True)
            entry.loaded = stream.record_event()
        entry.device_copy = device_copy

    def get(self, key: Hashable) -> Tensor:
        entry = self._check(key, "get")
        self.prefetch(key)
        if self.streams is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(entry.loaded)
            entry.device_copy.record_stream(compute)  # allocated on the copy stream, used on this one
        return entry.device_copy

    def release(self, key: Hashable) -> None:
        self._check(key, "release").device_copy = None

    def free(self, key: Hashable) -> None:
        entry = self._check(key, "free")
        # the buffer's last reader: the host-to-device copy if there was one, else the device-to-host write
        self.pool.give_back(entry.buffer, entry.loaded or entry.written)
        del self._entries[key]

    @property
    def nbytes(self) -> int:
        """Host bytes held by the stash now."""
        return sum(e.buffer.numel() * e.buffer.element_size() for e in self._entries.values())

    @property
    def resident_bytes(self) -> int:
        """Device bytes of chunks prefetched and not yet released."""
        return sum(
            e.device_copy.numel() * e.device_copy.element_size()
            for e in self._entries.values()
            if e.device_copy is not None
        )



class StashFactory:
    """Makes the stashes of each attention call; shares one buffer pool and one pair of copy streams among all of
    them (every layer, every step), so pinned memory is allocated once.

    Args:
        offload: keep q/k/v/out/lse chunks in host memory between forward and backward.
        offload_dq: keep the partial dQ sums of the backward in host memory too (a tighter GPU budget, more copies).
        pin_memory: pin host buffers on CUDA machines (pageable copies are ~3× slower and synchronous).
        what: what the stashes hold, named when the host runs short.
    """

    def __init__(self, *, offload: bool = False, offload_dq: bool = False, pin_memory: bool = True,
                 what: str = "the attention stash") -> None:
        self.offload = offload
        self.offload_dq = offload_dq
        self.pin_memory = pin_memory
        self.what = what
        self.guard: Optional[HostMemoryGuard] = None
        """Asked before each new host buffer (set before the first one; the strategy sets it at setup)."""
        self.disk: Optional[Any] = None
        """A :class:`~lightning_fpdt.offload.disk.DiskTier`: chunks beyond its host budget go to files
        (``offload/disk/``); ``None``: all in host memory. The strategy sets it per planned length."""
        self._pool: Optional[HostBufferPool] = None
        self._streams: dict[torch.device, CopyStreams] = {}

    def chunks(self, device: torch.device) -> ChunkStash:
        return self._host_stash(device) if self.offload else ChunkStash()

    def partial_dq(self, device: torch.device) -> ChunkStash:
        return self._host_stash(device) if self.offload_dq else ChunkStash()

    @property
    def host_bytes(self) -> int:
        """Host memory allocated for stashed chunks so far."""
        return 0 if self._pool is None else self._pool.allocated_bytes

    @property
    def pinned_bytes(self) -> int:
        """Of :attr:`host_bytes`, what is page-locked (the buffers of a CUDA run)."""
        return 0 if self._pool is None or not self._pool.pin_memory else self._pool.allocated_bytes

    def trim(self) -> int:
        """Free the host buffers no stash holds now (between steps: all of them); returns the bytes freed."""
        return 0 if self._pool is None else self._pool.trim()

    def _host_stash(self, device: torch.device) -> HostStash:
        cuda = device.type == "cuda"
        if self._pool is None:
            self._pool = HostBufferPool(pin_memory=cuda and self.pin_memory, what=self.what)
        self._pool.allocator.guard = self.guard  # the strategy's, also when it came after the pool
        streams = None
        if cuda:
            streams = self._streams.get(device)
            if streams is None:
                streams = self._streams[device] = CopyStreams(device)
        if self.disk is not None:
            return self.disk.stash(device, self._pool, streams)
        return HostStash(device, self._pool, streams)
