"""The disk tier under the host stash: :class:`DiskStash` keeps an entry in host memory within its budget and spills
the rest to files (the package docstring)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from lightning_fpdt.offload.disk.files import SpillDirectory, _DiskChunk, _settle
from lightning_fpdt.offload.host_stash import CopyStreams, HostBufferPool, HostStash, _HostChunk


@dataclass
class DiskTier:
    """What a :class:`~lightning_fpdt.offload.host_stash.StashFactory` spills with: the directory, and the host
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
