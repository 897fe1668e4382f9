"""Checkpoint every transformer block and keep its input in host memory (docs/design.md §6).

Under plain activation checkpointing each block keeps its input on the GPU until the backward: ``L × S/P × hidden``
for the whole model, which at millions of tokens no longer fits. Here the input of each block goes to (pinned) host
memory asynchronously after the block's forward, and comes back one block ahead in the backward, while the block
after it is still computing its gradients.

Attention objects passed as ``attentions`` are told to record during a block's first (no-grad) forward, so the
recompute takes their output back instead of running attention again (docs/design.md §4). MLPs passed as
``unused_mlp_values`` feed only the residual add that ends their block: nothing reads their value in the recompute,
and a tiled MLP there skips computing it (:func:`mlp_value_unused`), since its backward recomputes the tiles anyway.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_fpdt.sequence.host_stash import ChunkStash, StashFactory

_UNUSED_VALUES: ContextVar[frozenset[int]] = ContextVar("fpdt_unused_mlp_values", default=frozenset())
"""Ids of the MLPs whose value nothing reads in the block recompute running on this thread (empty otherwise)."""


def mlp_value_unused(mlp: nn.Module) -> bool:
    """Whether ``mlp`` runs inside its block's recompute, where nothing reads its output value."""
    return id(mlp) in _UNUSED_VALUES.get()


class BlockCheckpoints:
    """The stash of block inputs of one model, and the order blocks ran in (for the one-ahead prefetch)."""

    def __init__(self, stashes: StashFactory, prefetch: int, attentions: Sequence[Any] = ()) -> None:
        self.stashes = stashes
        self.prefetch = prefetch
        self.attentions = list(attentions)
        """Told to keep what the recompute needs (no attention recompute); objects with a ``recording`` flag."""
        self.forward_order: list[int] = []  # stash keys of this step's blocks, in forward order
        self._stash: Optional[ChunkStash] = None

    def stash(self, device: torch.device) -> ChunkStash:
        if self._stash is None:
            self._stash = self.stashes.chunks(device)
        return self._stash

    def prefetch_before(self, key: int) -> None:
        """Start bringing back the inputs of the ``prefetch`` blocks that run backward after block ``key``."""
        if key not in self.forward_order:
            return
        index = self.forward_order.index(key)
        for earlier in self.forward_order[max(0, index - self.prefetch) : index]:
            if earlier in self._stash:
                self._stash.prefetch(earlier)

    def set_recording(self, on: bool) -> None:
        for attention in self.attentions:
            attention.recording = on


class _OffloadedCheckpoint(torch.autograd.Function):
    """One block, checkpointed, its first input kept in the host stash.

    | tensor | shape | kept for backward |
    |---|---|---|
    | hidden (in) | (B, S/P, hidden) | in the host stash (pinned), prefetched one block ahead in backward |
    | other tensor inputs | small (position ids, RoPE tables) | as they are |
    | block activations | — | no: recomputed in backward (attention is not: see the module docstring) |
    """

    @staticmethod
    def forward(ctx, block: "CheckpointedForward", spec: Any, *leaves: Any) -> Any:
        owner, key = block.owner, block.key
        hidden = leaves[0]
        stash = owner.stash(hidden.device)
        if key in stash:
            stash.free(key)  # a graph discarded without backward
        stash.put(key, hidden.detach())
        owner.forward_order.append(key)
        ctx.block, ctx.spec, ctx.others = block, spec, leaves[1:]
        owner.set_recording(True)
        try:
            with torch.no_grad():
                return block.run(spec, (hidden, *leaves[1:]))
        finally:
            owner.set_recording(False)

    @staticmethod
    def backward(ctx, *grad_outputs: Tensor) -> tuple[Optional[Tensor], ...]:
        block = ctx.block
        owner, stash = block.owner, block.owner._stash
        owner.prefetch_before(block.key)
        hidden = stash.get(block.key).detach().requires_grad_()
        stash.release(block.key)
        stash.free(block.key)
        others = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, Tensor) else x for x in ctx.others]
        unused = _UNUSED_VALUES.set(block.unused_mlp_values)
        try:
            with torch.enable_grad():
                outputs = block.run(ctx.spec, (hidden, *others))
        finally:
            _UNUSED_VALUES.reset(unused)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        # The roots of the block's backward as gradient edges (autograd node + output index), not tensors: the backward
        # reads their nodes, never their values, so the recomputed outputs (for a transformer block one hidden-sized
        # tensor, B·S/P·hidden) are freed here instead of living through the whole backward of the block.
        roots = [(get_gradient_edge(o), g) for o, g in zip(outputs, grad_outputs)
                 if isinstance(o, Tensor) and o.requires_grad and g is not None]
        del outputs
        # backward (not autograd.grad): the block's parameters accumulate their gradients here
        torch.autograd.backward([edge for edge, _ in roots], [g for _, g in roots])
        other_grads = [x.grad if isinstance(x, Tensor) and x.requires_grad else None for x in others]
        if block.key == owner.forward_order[0]:
            owner.forward_order.clear()  # the first block's backward ends the step
        return (None, None, hidden.grad, *other_grads)


class CheckpointedForward:
    """What replaces a block's ``forward``: the original forward, checkpointed with its input offloaded."""

    def __init__(self, forward: Callable[..., Any], owner: BlockCheckpoints, key: int,
                 unused_mlp_values: frozenset[int]) -> None:
        self.forward, self.owner, self.key = forward, owner, key
        self.__wrapped__ = forward  # the wrapper convention: what this forward wraps
        self.unused_mlp_values = unused_mlp_values

    def run(self, spec: Any, leaves: tuple) -> Any:
        args, kwargs = tree_unflatten(list(leaves), spec)
        return self.forward(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        if not leaves or not isinstance(leaves[0], Tensor) or not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)  # evaluation, or a call without hidden states first
        # parameters take part through the recompute in backward; this marks the output as needing grad
        return _OffloadedCheckpoint.apply(self, spec, *leaves)


def offloaded_blocks(blocks: Sequence[nn.Module]) -> Optional[BlockCheckpoints]:
    """The owner of ``blocks`` when :func:`apply_block_offload` has already wrapped all of them, else ``None``."""
    forwards = [block.forward for block in blocks]
    if forwards and all(isinstance(f, CheckpointedForward) for f in forwards):
        return forwards[0].owner
    return None


def apply_block_offload(
    blocks: Sequence[nn.Module], *, stashes: StashFactory, prefetch: int = 1, attentions: Sequence[Any] = (),
    unused_mlp_values: Optional[Mapping[nn.Module, nn.Module]] = None,
) -> BlockCheckpoints:
    """Checkpoint each of ``blocks`` with its input in ``stashes`` (host memory when offloading); in place,
    idempotent. ``attentions`` record their first pass; ``unused_mlp_values`` maps a block to its MLP whose output
    only feeds the block's residual add (see the module docstring). Returns the blocks' owner."""
    if not blocks:
        raise ValueError("apply_block_offload got no blocks")
    wrapped = offloaded_blocks(blocks)
    if wrapped is not None:
        return wrapped  # fit then validate must not wrap twice
    owner = BlockCheckpoints(stashes, prefetch, attentions)
    unused = unused_mlp_values or {}
    for key, block in enumerate(blocks):
        mlp = unused.get(block)
        unused_ids = frozenset() if mlp is None else frozenset({id(mlp)})
        block.forward = CheckpointedForward(block.forward, owner, key, unused_ids)
    return owner
