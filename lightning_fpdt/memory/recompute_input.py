"""The input of a checkpointed block's recompute and what the recompute restores: the device copy of the input from
the stash (a leaf, or, where the input waits on the host through the backward, an identity node whose saved views
point at the host copy), and the random number generator states of the first forward (memory/block_offload.py,
docs/design.md §6)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_fpdt.offload.host_stash import ChunkStash, HostStash


class RngState:
    """The random number generator states a block's first forward starts from (CPU, and ``device``'s when it is a
    CUDA device), so that the recompute, and a forward regenerating block inputs, draw the same dropout masks; the
    states outside are left as they were (``torch.utils.checkpoint``'s ``preserve_rng_state``)."""

    def __init__(self, device: torch.device) -> None:
        self.cpu = torch.get_rng_state()
        self.device = device if device.type == "cuda" else None
        self.cuda = torch.cuda.get_rng_state(device) if self.device is not None else None

    @contextlib.contextmanager
    def restored(self) -> Any:
        with torch.random.fork_rng(devices=[] if self.device is None else [self.device], device_type="cuda"):
            torch.set_rng_state(self.cpu)
            if self.device is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


class RecomputeInput:
    """The input of a block's recompute: its device copy from the stash (prefetched, or loaded now). Without
    ``on_host`` a leaf whose ``grad`` is the block's input gradient (a leaf without grad where the block's input
    had none: only the parameters' gradients are computed). With it (and a host stash) an alias from
    :class:`InputTap`, whose gradient goes to ``taps``; the tensors the recompute saves from it point at the host
    copy (:class:`SavedOnHost`), and :meth:`free_device_copy` lets the memory go before the recompute ends, where
    ``frees_early`` (the block reads its input no more once its MLP starts)."""

    def __init__(self, stash: ChunkStash, key: int, *, on_host: bool, frees_early: bool,
                 needs_grad: bool) -> None:
        self.stash, self.key = stash, key
        loaded = stash.get(key)
        stash.release(key)
        self.taps: list[Tensor] = []
        self._storage: Optional[torch.UntypedStorage] = None
        if on_host and isinstance(stash, HostStash):
            if needs_grad:
                with torch.enable_grad():  # a backward runs with grad mode off
                    self._tensor = InputTap.apply(loaded.new_empty(0).requires_grad_(), loaded, self.taps)
            else:  # an input without gradient (frozen embeddings): only the parameters' gradients are computed
                self._tensor = loaded
            self.saved_tensor_hooks: Any = SavedOnHost(stash, key, loaded)
            if frees_early:  # freed when the MLP starts; other blocks may read the input to their end
                self._storage = loaded.untyped_storage()
            self.leaf = None
        else:
            stash.free(key)
            self._tensor = self.leaf = loaded.detach().requires_grad_(needs_grad)
            self.saved_tensor_hooks = contextlib.nullcontext()

    def pop(self) -> Tensor:
        """The tensor, handed over once: this object keeps no reference to its value (but the leaf's)."""
        tensor, self._tensor = self._tensor, None
        return tensor

    def free_device_copy(self) -> None:
        """With ``on_host``: the recompute reads the input no more; its device copy goes now."""
        if self._storage is not None:
            self.saved_tensor_hooks.free_input(self._storage)
            self._storage = None

    def finish(self) -> Optional[Tensor]:
        """After the block's backward: the input's gradient; the stash entry freed."""
        self._storage = None
        if self.leaf is not None:
            return self.leaf.grad
        self.stash.release(self.key)  # the copy the first norm's backward took back
        self.stash.free(self.key)
        return self.taps[0] if self.taps else None


class InputTap(torch.autograd.Function):
    """The identity on a block input ``x`` (no grad) as a graph node: the gradient it receives is appended to
    ``into``. Unlike a leaf (whose gradient accumulator keeps the tensor), it leaves ``x``'s memory to whoever else
    holds it; ``anchor`` (empty, requiring grad) makes the output require grad."""

    @staticmethod
    def forward(ctx, anchor: Tensor, x: Tensor, into: list) -> Tensor:
        ctx.into = into
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[None, None, None]:
        ctx.into.append(grad)
        return None, None, None


@dataclass(frozen=True)
class OnHost:
    """A saved tensor that views a block input, by its view of the input's host copy."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class SavedOnHost(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks of a recompute whose input waits on the host: a tensor saved that views the block input
    ``value`` is kept as its view of the input's copy in ``stash`` (entry ``key``), brought back to the device
    (and shared by every such tensor) when the backward unpacks it. The hooks keep integers, not ``value``: they
    live as long as the saved tensors do."""

    def __init__(self, stash: ChunkStash, key: int, value: Tensor) -> None:
        device = value.device
        self._address: Optional[int] = value.untyped_storage().data_ptr()  # None once the device copy is gone

        def pack(t: Tensor) -> Any:
            if t.device == device and t.untyped_storage().data_ptr() == self._address:
                return OnHost(tuple(t.size()), tuple(t.stride()), t.storage_offset())
            return t

        def unpack(packed: Any) -> Tensor:
            if isinstance(packed, OnHost):
                return stash.get(key).as_strided(packed.size, packed.stride, packed.offset)
            return packed

        super().__init__(pack, unpack)

    def free_input(self, storage: torch.UntypedStorage) -> None:
        """Free the input's device copy (``storage``) before the recompute ends; a tensor allocated at its address
        afterwards is not the input."""
        storage.resize_(0)
        self._address = None
