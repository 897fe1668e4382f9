"""All-to-all between the sequence-sharded and the head-sharded layouts (Ulysses).

Sequence-sharded tensors are ``(B, s, h, D)``: ``s`` local tokens of every head. Head-sharded tensors are
``(B, h/P, P·s, D)``: all ``P·s`` tokens of the group (in source-rank order, which the layout makes contiguous
global order) for ``h/P`` heads, in the ``(B, heads, seq, D)`` order the attention kernels take.

Several tensors with the same dtype travel in one collective (q, k and v in forward; dq, dk and dv in backward):
each is laid out as ``(P, n_t)`` by destination rank and the blocks are concatenated along the second dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Size of ``group``; 1 when there is no group or no process group at all."""
    if group is None:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    if group is None:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return dist.get_rank(group)


def _exchange(blocks: list[Tensor], group: Optional[dist.ProcessGroup], sp_size: int) -> list[Tensor]:
    """One all-to-all over ``blocks``, each ``(P, …)`` indexed by destination (any strides: each is copied once,
    straight into the send buffer); returns them indexed by source."""
    if sp_size == 1:
        return [b.contiguous() for b in blocks]  # the outputs own their memory, as after an exchange
    sizes = [b[0].numel() for b in blocks]
    send = blocks[0].new_empty((sp_size, sum(sizes)))  # (P, sum n_t)
    for piece, block in zip(send.split(sizes, dim=1), blocks):
        piece.view(block.shape).copy_(block)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return [r.view(b.shape) for r, b in zip(recv.split(sizes, dim=1), blocks)]


def seq_to_head(tensors: Sequence[Tensor], group: Optional[dist.ProcessGroup]) -> list[Tensor]:
    """``(B, s, h, D)`` each ``-> (B, h/P, P·s, D)``; one collective for all (they must share a dtype)."""
    sp_size = group_size(group)
    blocks = []
    for x in tensors:
        b, s, h, d = x.shape
        assert h % sp_size == 0, "head counts are validated before the all-to-all"
        # (B, s, h, D) -reshape-> (B, s, P, h/P, D) -permute-> (P, B, h/P, s, D): block p goes to rank p
        blocks.append(x.reshape(b, s, sp_size, h // sp_size, d).permute(2, 0, 3, 1, 4))
    received = _exchange(blocks, group, sp_size)
    out = []
    for y in received:
        p, b, hp, s, d = y.shape
        # (P, B, h/P, s, D) indexed by source rank -permute-> (B, h/P, P, s, D) -> (B, h/P, P·s, D)
        out.append(y.permute(1, 2, 0, 3, 4).reshape(b, hp, p * s, d))
    return out


def head_to_seq(tensors: Sequence[Tensor], group: Optional[dist.ProcessGroup]) -> list[Tensor]:
    """``(B, h/P, P·s, D)`` each ``-> (B, s, h, D)``: the inverse of :func:`seq_to_head`."""
    sp_size = group_size(group)
    blocks = []
    for x in tensors:
        b, hp, seq, d = x.shape
        s = seq // sp_size
        # (B, h/P, P·s, D) -reshape-> (B, h/P, P, s, D) -permute-> (P, B, s, h/P, D): piece p goes back to rank p
        blocks.append(x.reshape(b, hp, sp_size, s, d).permute(2, 0, 3, 1, 4))
    received = _exchange(blocks, group, sp_size)
    out = []
    for y in received:
        p, b, s, hp, d = y.shape
        # (P, B, s, h/P, D) indexed by source rank (= head block) -permute-> (B, s, P, h/P, D) -> (B, s, h, D)
        out.append(y.permute(1, 2, 0, 3, 4).reshape(b, s, p * hp, d))
    return out


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group: Optional[dist.ProcessGroup], *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.group = group
        return tuple(seq_to_head(tensors, group))

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[Optional[Tensor], ...]:
        return (None, *head_to_seq([g.contiguous() for g in grads], ctx.group))


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group: Optional[dist.ProcessGroup], *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.group = group
        return tuple(head_to_seq(tensors, group))

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[Optional[Tensor], ...]:
        return (None, *seq_to_head([g.contiguous() for g in grads], ctx.group))


def all_to_all_seq_to_head(*tensors: Tensor, group: Optional[dist.ProcessGroup] = None) -> tuple[Tensor, ...]:
    """Differentiable :func:`seq_to_head`; its backward is :func:`head_to_seq` of the gradients."""
    return _SeqToHead.apply(group, *tensors)


def all_to_all_head_to_seq(*tensors: Tensor, group: Optional[dist.ProcessGroup] = None) -> tuple[Tensor, ...]:
    """Differentiable :func:`head_to_seq`; its backward is :func:`seq_to_head` of the gradients."""
    return _HeadToSeq.apply(group, *tensors)
