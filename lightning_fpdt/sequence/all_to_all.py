"""All-to-all between the sequence-sharded and the head-sharded layouts (Ulysses).

Sequence-sharded tensors are ``(B, s, h, D)``: ``s`` local tokens of every head. Head-sharded tensors are
``(B, h/P, P·s, D)``: all ``P·s`` tokens of the group (in source-rank order, which the layout makes contiguous
global order) for ``h/P`` heads, in the ``(B, heads, seq, D)`` order the attention kernels take.

Several tensors with the same dtype travel in one collective (q, k and v in forward; dq, dk and dv in backward):
each is laid out as ``(P, n_t)`` by destination rank and the blocks are concatenated along the second dim.

Uneven heads (``ranges``, from :class:`~lightning_fpdt.sequence.heads.HeadSplit`): rank ``r`` holds heads
``[start_r, stop_r)`` of each tensor, ``h_r`` of them; blocks differ in size by rank, so the collective takes split
sizes. Ranges of kv heads may overlap (a kv head goes to every rank whose query heads read it); going back, the
copies of such a head are summed, which is the backward of sending it several times. With ``ranges=None`` the even
split runs unchanged: one equal-split collective, no extra copy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fpdt.sequence.heads import HeadRanges


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Size of ``group``; 1 when there is no group or no process group at all."""
    if group is None:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    if group is None:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return dist.get_rank(group)


WIDE = torch.complex128
"""The widest element torch copies (16 bytes): a layout copy moves its tensors' bytes as these where it can."""


def copy_wide(dst: Tensor, src: Tensor) -> Tensor:
    """``dst.copy_(src)`` for two tensors of one dtype and shape, moved as 16-byte elements where both strides allow
    it (:func:`widens`); the bytes are the same either way. A copy between permuted layouts (the blocks of an
    all-to-all) computes every element's address from its index, and on 2-byte elements that arithmetic, not the
    memory, bounds it: a sixteenth as many addresses to compute moves the same bytes several times faster."""
    if dst.dtype == src.dtype and dst.shape == src.shape and widens(dst) and widens(src):
        dst.view(WIDE).copy_(src.view(WIDE))  # (…, D) -view-> (…, D·itemsize/16)
        return dst
    return dst.copy_(src)


def widens(x: Tensor) -> bool:
    """Whether ``x`` can be viewed as 16-byte elements: its last dim contiguous and whole 16-byte runs long, every other
    stride and its offset whole runs."""
    ratio = WIDE.itemsize // x.element_size()
    return (x.dim() > 0 and x.element_size() < WIDE.itemsize and x.stride(-1) == 1 and x.shape[-1] % ratio == 0
            and x.storage_offset() % ratio == 0 and all(stride % ratio == 0 for stride in x.stride()[:-1]))


class Exchange:
    """One equal-split all-to-all over ``blocks``, each ``(P, …)`` indexed by destination (any strides: each is copied
    once, straight into the send buffer). ``start`` queues it on the communication stream and returns at once;
    ``wait`` makes the current stream wait for it (the host does not) and returns the blocks indexed by source, as
    views of the receive buffer. Until ``wait`` the collective may still run: that is the time other work overlaps
    it. ``wait`` before ``start``, or twice, raises ``RuntimeError``."""

    def __init__(self, blocks: list[Tensor], group: Optional[dist.ProcessGroup], sp_size: int) -> None:
        self._blocks, self._group, self._sp_size = blocks, group, sp_size
        self._work: Optional[Any] = None
        self._received: Optional[list[Tensor]] = None
        self._state = "new"

    def start(self) -> "Exchange":
        if self._state != "new":
            raise RuntimeError(f"Exchange.start called on an exchange that is {self._state}")
        blocks, self._blocks = self._blocks, []
        self._state = "started"
        if self._sp_size == 1:
            self._received = [b.contiguous() for b in blocks]  # the outputs own their memory, as after an exchange
            return self
        sizes = [b[0].numel() for b in blocks]
        send = blocks[0].new_empty((self._sp_size, sum(sizes)))  # (P, sum n_t)
        for piece, block in zip(send.split(sizes, dim=1), blocks):
            copy_wide(piece.view(block.shape), block)
        recv = torch.empty_like(send)
        self._work = dist.all_to_all_single(recv, send, group=self._group, async_op=True)
        self._received = [r.view(b.shape) for r, b in zip(recv.split(sizes, dim=1), blocks)]
        return self

    def wait(self) -> list[Tensor]:
        if self._state != "started":
            raise RuntimeError(f"Exchange.wait called on an exchange that is {self._state} (start it once, wait once)")
        self._state = "done"
        if self._work is not None:
            self._work.wait()  # the current stream waits for the collective; the send buffer is released with it
            self._work = None
        received, self._received = self._received, None
        return received


def _exchange_uneven(send: list[list[Tensor]], recv_shapes: list[list[tuple[int, ...]]],
                     group: Optional[dist.ProcessGroup]) -> list[list[Tensor]]:
    """One all-to-all of unequal blocks: ``send[p]`` are the tensors for rank ``p`` (any strides: each is copied
    once, into the send buffer), ``recv_shapes[p]`` the shapes of those rank ``p`` sends here; returns them indexed
    by source, as views of the receive buffer."""
    first = send[0][0]
    send_sizes = [sum(t.numel() for t in blocks) for blocks in send]
    recv_sizes = [sum(math.prod(shape) for shape in shapes) for shapes in recv_shapes]
    send_buffer = first.new_empty(sum(send_sizes))
    offset = 0
    for blocks in send:
        for block in blocks:
            send_buffer[offset:offset + block.numel()].view(block.shape).copy_(block)
            offset += block.numel()
    recv_buffer = first.new_empty(sum(recv_sizes))
    dist.all_to_all_single(recv_buffer, send_buffer, output_split_sizes=recv_sizes, input_split_sizes=send_sizes,
                           group=group)
    received, offset = [], 0
    for shapes in recv_shapes:
        pieces = []
        for shape in shapes:
            size = math.prod(shape)
            pieces.append(recv_buffer[offset:offset + size].view(shape))
            offset += size
        received.append(pieces)
    return received


def _seq_to_head_uneven(tensors: Sequence[Tensor], group: Optional[dist.ProcessGroup],
                        ranges: Sequence[HeadRanges]) -> list[Tensor]:
    sp_size, rank = group_size(group), group_rank(group)
    # (B, s, h, D) -slice heads [start_p, stop_p)-> (B, s, h_p, D) -transpose-> (B, h_p, s, D): block p goes to rank p
    send = [[x[:, :, heads[p][0]:heads[p][1]].transpose(1, 2) for x, heads in zip(tensors, ranges)]
            for p in range(sp_size)]
    # every source sends this rank the same heads of its s tokens: (B, h_r, s, D) per tensor
    shapes = [(x.shape[0], heads[rank][1] - heads[rank][0], x.shape[1], x.shape[3])
              for x, heads in zip(tensors, ranges)]
    received = _exchange_uneven(send, [shapes] * sp_size, group)
    # (B, h_r, s, D) from each source rank -cat by source-> (B, h_r, P·s, D)
    return [torch.cat([pieces[t] for pieces in received], dim=2) for t in range(len(tensors))]


def _head_to_seq_uneven(tensors: Sequence[Tensor], group: Optional[dist.ProcessGroup],
                        ranges: Sequence[HeadRanges]) -> list[Tensor]:
    sp_size = group_size(group)
    # (B, h_r, P·s, D) -slice tokens of rank p-> (B, h_r, s, D) -transpose-> (B, s, h_r, D): piece p goes back to p
    send = [[x.unflatten(2, (sp_size, -1))[:, :, p].transpose(1, 2) for x in tensors] for p in range(sp_size)]
    recv_shapes = [[(x.shape[0], x.shape[2] // sp_size, heads[p][1] - heads[p][0], x.shape[3])
                    for x, heads in zip(tensors, ranges)] for p in range(sp_size)]
    received = _exchange_uneven(send, recv_shapes, group)
    out = []
    for t, heads in enumerate(ranges):
        pieces = [pieces[t] for pieces in received]  # (B, s, h_p, D) from rank p
        if all(heads[p][1] == heads[p + 1][0] for p in range(sp_size - 1)):
            out.append(torch.cat(pieces, dim=2))  # disjoint blocks in head order -> (B, s, h, D)
            continue
        # overlapping blocks (kv heads sent to several ranks): the copies' values are summed, in the accumulation
        # dtype (a gradient of a kv head read on two ranks is the sum of both)
        acc = torch.promote_types(pieces[0].dtype, torch.float32)
        total = torch.zeros((*pieces[0].shape[:2], heads[-1][1], pieces[0].shape[3]), dtype=acc,
                            device=pieces[0].device)  # (B, s, h, D)
        for (start, stop), piece in zip(heads, pieces):
            total[:, :, start:stop] += piece
        out.append(total.to(pieces[0].dtype))
    return out


def seq_to_head(tensors: Sequence[Tensor], group: Optional[dist.ProcessGroup],
                ranges: Optional[Sequence[HeadRanges]] = None) -> list[Tensor]:
    """``(B, s, h, D)`` each ``-> (B, h/P, P·s, D)``; one collective for all (they must share a dtype).

    ``ranges``: per tensor, the heads each rank receives (an uneven :class:`HeadSplit`); rank ``r`` then gets
    ``(B, h_r, P·s, D)``. ``None``: ``h/P`` heads each, the equal-split collective (one head piece of one)."""
    if ranges is not None:
        return _seq_to_head_uneven(tensors, group, ranges)
    return [place_heads(y) for y in seq_to_head_piece(tensors, group, 0, 1).wait()]


def head_to_seq(tensors: Sequence[Tensor], group: Optional[dist.ProcessGroup],
                ranges: Optional[Sequence[HeadRanges]] = None) -> list[Tensor]:
    """``(B, h/P, P·s, D)`` each ``-> (B, s, h, D)``: the inverse of :func:`seq_to_head` (with ``ranges``, rank
    ``r`` sends ``(B, h_r, P·s, D)``; heads that several ranks hold come back as the sum of their copies)."""
    if ranges is not None:
        return _head_to_seq_uneven(tensors, group, ranges)
    return [place_tokens(y) for y in head_to_seq_piece(tensors, group).wait()]


def seq_to_head_piece(tensors: Sequence[Tensor], group: Optional[dist.ProcessGroup], piece: int,
                      num_pieces: int, *, whole: Sequence[Tensor] = ()) -> Exchange:
    """:func:`seq_to_head` of head piece ``piece`` of ``num_pieces`` (even split), started: ``wait`` gives each
    tensor's ``(P, B, h/(P·G), s, D)`` by source rank, for :func:`place_heads`. Rank ``r`` receives heads
    ``r·h/P + piece·h/(P·G) …`` of every source's ``s`` tokens: the pieces of one tensor together are
    :func:`seq_to_head`'s result, so one piece's attention can run while the next piece travels. ``whole``: tensors
    that travel in the same collective with all of each rank's heads (``(P, B, h/P, s, D)``, after ``tensors``'
    pieces), as kv heads that every piece reads do."""
    sp_size = group_size(group)
    blocks = [_head_piece(x, sp_size, piece, num_pieces) for x in tensors]
    blocks += [_head_piece(x, sp_size, 0, 1) for x in whole]
    return Exchange(blocks, group, sp_size).start()


def _head_piece(x: Tensor, sp_size: int, piece: int, num_pieces: int) -> Tensor:
    assert x.shape[2] % (sp_size * num_pieces) == 0, "head counts and pieces are validated before the all-to-all"
    # (B, s, h, D) -view-> (B, s, P, G, h/(P·G), D) -piece, permute-> (P, B, h/(P·G), s, D): block p to rank p
    return x.unflatten(2, (sp_size, num_pieces, -1))[:, :, :, piece].permute(2, 0, 3, 1, 4)


def place_heads(received: Tensor, heads: Optional[Tensor] = None) -> Tensor:
    """A received piece ``(P, B, h', s, D)`` by source rank -permute-> ``heads`` ``(B, h', P·s, D)`` (one copy, the
    one :func:`seq_to_head` makes; a new tensor when ``heads`` is ``None``); returns ``heads``."""
    p, b, hp, s, d = received.shape
    if heads is None:
        heads = received.new_empty((b, hp, p * s, d))
    copy_wide(heads.view(b, hp, p, s, d), received.permute(1, 2, 0, 3, 4))
    return heads


def head_to_seq_piece(tensors: Sequence[Tensor], group: Optional[dist.ProcessGroup]) -> Exchange:
    """:func:`head_to_seq` of one head piece ``(B, h', P·s, D)`` per tensor, started: ``wait`` gives each tensor's
    ``(P, B, s, h', D)`` by source rank (= the rank whose heads they are), for :func:`place_tokens`."""
    sp_size = group_size(group)
    # (B, h', P·s, D) -reshape-> (B, h', P, s, D) -permute-> (P, B, s, h', D): piece p goes back to rank p
    blocks = [x.unflatten(2, (sp_size, -1)).permute(2, 0, 3, 1, 4) for x in tensors]
    return Exchange(blocks, group, sp_size).start()


def place_tokens(received: Tensor, tokens: Optional[Tensor] = None, piece: int = 0, num_pieces: int = 1) -> Tensor:
    """A received piece ``(P, B, s, h', D)`` by source rank into its heads of ``tokens`` ``(B, s, H, D)`` (head piece
    ``piece`` of every rank's ``H/P``; a new tensor when ``tokens`` is ``None``, the whole heads in one piece);
    returns ``tokens``."""
    p, b, s, hp, d = received.shape
    if tokens is None:
        assert num_pieces == 1, "a new tensor holds the whole heads: one piece"
        tokens = received.new_empty((b, s, p * hp, d))
    # (B, s, H, D) -view-> (B, s, P, G, h', D) -piece-> (B, s, P, h', D) <-permute- (P, B, s, h', D)
    copy_wide(tokens.view(b, s, p, num_pieces, hp, d)[:, :, :, piece], received.permute(1, 2, 0, 3, 4))
    return tokens


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group: Optional[dist.ProcessGroup], ranges: Optional[Sequence[HeadRanges]],
                *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.group, ctx.ranges = group, ranges
        return tuple(seq_to_head(tensors, group, ranges))

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[Optional[Tensor], ...]:
        return (None, None, *head_to_seq([g.contiguous() for g in grads], ctx.group, ctx.ranges))


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group: Optional[dist.ProcessGroup], ranges: Optional[Sequence[HeadRanges]],
                *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.group, ctx.ranges = group, ranges
        return tuple(head_to_seq(tensors, group, ranges))

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[Optional[Tensor], ...]:
        return (None, None, *seq_to_head([g.contiguous() for g in grads], ctx.group, ctx.ranges))


def all_to_all_seq_to_head(*tensors: Tensor, group: Optional[dist.ProcessGroup] = None,
                           ranges: Optional[Sequence[HeadRanges]] = None) -> tuple[Tensor, ...]:
    """Differentiable :func:`seq_to_head`; its backward is :func:`head_to_seq` of the gradients (with ``ranges``,
    the gradients of a head sent to several ranks summed)."""
    return _SeqToHead.apply(group, ranges, *tensors)


def all_to_all_head_to_seq(*tensors: Tensor, group: Optional[dist.ProcessGroup] = None,
                           ranges: Optional[Sequence[HeadRanges]] = None) -> tuple[Tensor, ...]:
    """Differentiable :func:`head_to_seq`; its backward is :func:`seq_to_head` of the gradients. With overlapping
    ``ranges`` this is not the inverse but the adjoint of :func:`seq_to_head` (copies summed)."""
    return _HeadToSeq.apply(group, ranges, *tensors)
