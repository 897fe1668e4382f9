"""The staging buffers of the disk tier's writer and reader threads: a few pinned pieces each, so the tier's host
memory does not grow with the entry."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_fpdt.offload.host_memory import HostAllocator

STAGING_DEPTH = 2
"""Staging buffers of each thread: the writer copies a piece from the device into one while it writes the other to
the disk; the reader reads a piece into one while the other feeds the device."""
STAGING_PIECE_BYTES = 256 * 2**20
"""The largest staging buffer: an entry larger than this streams through pieces of this size (256 MiB: a piece's
write, about 0.17 s at 1.5 GB/s, dwarfs its copy from the device and the call's own cost)."""
STAGING_THREADS = 2
"""Threads with staging buffers of their own: the writer and the reader."""

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
