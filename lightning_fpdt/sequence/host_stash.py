"""Where the FPDT attention keeps its chunks between the forward and the backward.

The chunk loop talks to a stash through four calls with an explicit life cycle: ``put`` a chunk once, optionally
``prefetch`` it ahead of use, ``get`` it (any number of times), ``free`` it once. Misuse (a second ``put`` of the same
key, ``get`` or ``free`` of a key never put or already freed) raises ``RuntimeError``: those are scheduling bugs that
would otherwise show up as wrong gradients.

:class:`ChunkStash` keeps the tensors where they are (device memory). It is the store for ``offload=False`` and the
contract a host-offloading stash implements with pinned buffers, copy streams and events.
"""

from __future__ import annotations

from collections.abc import Hashable

from torch import Tensor


class ChunkStash:
    """Keyed chunk store that keeps tensors in place; see the module docstring for the life cycle."""

    def __init__(self) -> None:
        self._chunks: dict[Hashable, Tensor] = {}

    def put(self, key: Hashable, tensor: Tensor) -> None:
        if key in self._chunks:
            raise RuntimeError(f"stash: put of {key!r}, which is already stashed (free it first)")
        self._chunks[key] = tensor

    def prefetch(self, key: Hashable) -> None:
        """Start bringing ``key`` back ahead of its ``get``; a no-op for chunks kept in place."""
        self._check(key, "prefetch")

    def get(self, key: Hashable) -> Tensor:
        self._check(key, "get")
        return self._chunks[key]

    def free(self, key: Hashable) -> None:
        self._check(key, "free")
        del self._chunks[key]

    def clear(self) -> None:
        """Drop every chunk (the end of a backward, or a forward whose graph is discarded)."""
        self._chunks.clear()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._chunks

    def __len__(self) -> int:
        return len(self._chunks)

    @property
    def nbytes(self) -> int:
        """Bytes held by the stash now."""
        return sum(t.numel() * t.element_size() for t in self._chunks.values())

    def _check(self, key: Hashable, verb: str) -> None:
        if key not in self._chunks:
            raise RuntimeError(f"stash: {verb} of {key!r}, which was never put or was already freed")
