"""FPDT chunk-pipelined causal attention over one sequence-parallel group (docs/design.md §4).

Each rank holds ``u`` local chunks of ``c`` tokens (:class:`SequenceLayout`). Chunk ``i`` of every rank is
all-to-all'd into the contiguous global range ``[i·C, (i+1)·C)`` for ``H/P`` heads, attended against the kv chunks
``j <= i`` block by block and merged with the log-sum-exp, then all-to-all'd back. Only the chunks of one step are
materialised at full precision at once; the rest sits in a :class:`ChunkStash`. ``u = 1`` is Ulysses.

Heads (:class:`~lightning_fpdt.sequence.heads.HeadSplit`): rank ``r`` attends for ``h_r`` query heads (``H/P``, or
``⌈H/P⌉``/``⌊H/P⌋`` when ``P`` does not divide ``H``) and the ``hk_r`` kv heads they read; "``H/P``" below is ``h_r``.
The stash keeps the ``hk_r`` kv heads as received; a block whose q heads do not group evenly over them expands them
to one per q head for the kernel call only, and sums the kernel's kv gradients back (``fpdt_blocks._expand_kv``).

Packed documents (:class:`~lightning_fpdt.sequence.documents.DocumentBoundaries`): each block is skipped, computed
whole, or cut into per-document segments (``fpdt_blocks.block_forward``, ``block_backward``); the loops are unchanged.

One chunk of an even split (Ulysses) runs its own loop (:func:`_ulysses_forward`, :func:`_ulysses_backward`): the
heads in pieces whose all-to-alls travel while another piece attends.

Three layers: the loops (:func:`fpdt_forward`, :func:`fpdt_backward`), a thin ``autograd.Function`` that only
handles ``ctx``, and the public ``fpdt_attention`` in :mod:`lightning_fpdt.sequence.attention`, whose one dispatch
(``plan_attention``) validates a call here (:func:`make_plan`) or in ``ring.py`` and runs the plan it gets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fpdt.offload.host_stash import ChunkStash, StashFactory
from lightning_fpdt.sequence.all_to_all import (
    group_rank,
    group_size,
    head_to_seq,
    head_to_seq_piece,
    place_heads,
    place_tokens,
    seq_to_head,
    seq_to_head_piece,
)
from lightning_fpdt.sequence.blocks import (
    FirstPass,
    check_call,
    replicate_kv_heads,
    softmax_scale,
    sum_kv_replicas,
)
from lightning_fpdt.sequence.documents import DocumentBoundaries
from lightning_fpdt.sequence.fpdt_blocks import block_backward, block_forward, kv_chunks_read, q_chunks_reading
from lightning_fpdt.sequence.heads import HeadSplit
from lightning_fpdt.sequence.kernels import BlockKernel, VarlenFlashKernel, accumulation_dtype, make_kernel
from lightning_fpdt.sequence.layout import SequenceLayout


@dataclass
class FPDTPlan:
    """What the loops need besides the tensors: one validated call."""

    group: Optional[dist.ProcessGroup]
    layout: SequenceLayout
    kernel: BlockKernel
    scale: float
    heads: HeadSplit  # which q and kv heads each rank attends for (even: equal all-to-all; else unequal blocks)
    kv_index: Optional[Tensor] = None  # (h_r,) this rank's kv head per q head, when the kernels' grouping is not it
    documents: Optional[DocumentBoundaries] = None  # packed documents: per-document causal masking
    varlen: Optional[VarlenFlashKernel] = None  # packed documents on CUDA: a block's segments in one call
    head_pieces: int = 1  # one chunk of an even split: pieces whose all-to-alls overlap attention (_ulysses_forward)

    @property
    def shared_kv(self) -> bool:
        """Whether the head pieces share this rank's one kv head (it does not split into them): it travels with the
        first piece, every piece reads it, and its gradient is their sum."""
        return self.heads.max_kv_heads % self.head_pieces != 0

    @property
    def one_chunk(self) -> bool:
        """One chunk of an even split (Ulysses): the loops are :func:`_ulysses_forward`, :func:`_ulysses_backward`."""
        return self.layout.num_chunks == 1 and self.heads.even

    def forward(self, q: Tensor, k: Tensor, v: Tensor, stash: ChunkStash, save_for_backward: bool) -> Tensor:
        """The forward loop alone (:func:`fpdt_forward`): what a checkpoint's first pass records."""
        return fpdt_forward(q, k, v, self, stash, save_for_backward)

    def apply(self, query: Tensor, key: Tensor, value: Tensor, stashes: StashFactory, save: bool,
              first_pass: Optional[FirstPass] = None) -> Tensor:
        """The attention with its backward (:class:`_FPDTAttentionFunction`)."""
        return _FPDTAttentionFunction.apply(query, key, value, self, stashes, save, first_pass)


def _chunk(plan: FPDTPlan, x: Tensor, index: int) -> Tensor:
    return plan.layout.local_chunk(x, index, dim=1)


ULYSSES_HEAD_PIECES = 2
"""Head pieces of the one-chunk path (Ulysses) on several ranks: while one piece's attention computes, the next
piece's q, k, v arrive and the last one's output leaves, so a layer's all-to-alls wait on the step's path for one
piece only (one of ``G`` of their time) instead of all of it."""


def head_pieces_for(heads: HeadSplit, num_chunks: int) -> int:
    """The head pieces ``G`` of the one-chunk path: :data:`ULYSSES_HEAD_PIECES` where every rank's query heads split
    into that many and its kv heads either split as well or are one (a kv head the pieces share: Llama-3-8B on eight
    ranks); an even split with one chunk on several ranks. Else 1."""
    if num_chunks != 1 or not heads.even or heads.sp_size == 1:
        return 1
    q_heads, kv_heads = heads.max_heads, heads.max_kv_heads  # an even split's: every rank's, after replication
    pieces = ULYSSES_HEAD_PIECES
    return pieces if q_heads % pieces == 0 and (kv_heads % pieces == 0 or kv_heads == 1) else 1


def _piece(x: Tensor, piece: int, num_pieces: int) -> Tensor:
    # (B, h, ...) -> (B, h/G, ...): head piece `piece` of `num_pieces` (a view)
    return x.unflatten(1, (num_pieces, -1))[:, piece]


def _ulysses_forward(q: Tensor, k: Tensor, v: Tensor, plan: FPDTPlan, stash: ChunkStash,
                     save_for_backward: bool) -> Tensor:
    """The one-chunk loop of an even split (Ulysses), in ``G`` head pieces (:func:`head_pieces_for`).

    Every piece's all-to-all starts at once; they travel one after another on the communication stream while the
    pieces before them attend, and each piece's output leaves while the next attends. The stash gets the whole
    head-sharded ``q, k, v, lse`` (chunk 0) as the chunk loop stashes them, so either backward reads them.
    """
    num_pieces, group = plan.head_pieces, plan.group
    shared_kv = plan.shared_kv  # this rank's one kv head: it comes with piece 0, every piece reads it
    k, v = replicate_kv_heads(k, v, plan.heads.kv_repeat)  # (B, S/P, Hkv, D) -> (B, S/P, P, D) when P > Hkv
    # (B, S/P, H, D) -piece g of each rank's heads-> (P, B, H/(P·G), S/P, D) -all_to_all-> by source; k, v alike, or
    # (shared) whole with piece 0
    arriving = [seq_to_head_piece([q] if shared_kv else [q, k, v], group, g, num_pieces,
                                  whole=[k, v] if shared_kv and g == 0 else ()) for g in range(num_pieces)]
    batch, seq, sp_size = q.shape[0], q.shape[1] * plan.layout.sp_size, plan.layout.sp_size
    q_heads, k_heads, v_heads = (x.new_empty((batch, x.shape[2] // sp_size, seq, x.shape[3])) for x in (q, k, v))
    lse_heads: Optional[Tensor] = None  # (B, H/P, S), in the kernel's dtype for it
    leaving = []
    for g, exchange in enumerate(arriving):
        # (P, B, H/(P·G), S/P, D) by source -> (B, H/(P·G), S, D): piece g of this rank's heads, all tokens
        q_y, *kv_y = exchange.wait()
        q_g = place_heads(q_y, _piece(q_heads, g, num_pieces))
        if kv_y:  # piece g's kv heads, or (shared) all of them, read by the pieces after it too
            k_g, v_g = (place_heads(y, x if shared_kv else _piece(x, g, num_pieces))
                        for y, x in zip(kv_y, (k_heads, v_heads)))
        out_g, lse_g = block_forward(plan, q_g, k_g, v_g, 0, 0, None, None)
        if lse_heads is None:
            lse_heads = lse_g.new_empty(q_heads.shape[:3])
        _piece(lse_heads, g, num_pieces).copy_(lse_g)
        # (B, H/(P·G), S, D) -all_to_all-> (P, B, S/P, H/(P·G), D) by source: back to the tokens' ranks
        leaving.append(head_to_seq_piece([out_g.to(q.dtype)], group))
    out_local = torch.empty_like(q)  # (B, S/P, H, D)
    for g, exchange in enumerate(leaving):
        place_tokens(exchange.wait()[0], out_local, g, num_pieces)
    if save_for_backward:
        for name, x in (("q", q_heads), ("k", k_heads), ("v", v_heads), ("lse", lse_heads)):
            stash.put((name, 0), x)
    return out_local


def _ulysses_backward(dout: Tensor, out: Tensor, plan: FPDTPlan, stash: ChunkStash, q_meta: Tensor,
                      kv_meta: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of :func:`_ulysses_forward`, in the same head pieces: each piece's ``dout, out`` arrive while the
    piece before computes, and its ``dq, dk, dv`` leave while the next computes. One block: every gradient is
    complete from its one kernel call, nothing summed in the accumulation dtype; but a kv head the pieces share
    (:attr:`FPDTPlan.shared_kv`), whose gradient is the sum of theirs and leaves after the last."""
    num_pieces, group = plan.head_pieces, plan.group
    shared_kv = plan.shared_kv
    arriving = [seq_to_head_piece([dout, out], group, g, num_pieces) for g in range(num_pieces)]
    names = ("q", "k", "v", "lse")
    for name in names:
        stash.prefetch((name, 0))
    q_heads, k_heads, v_heads, lse_heads = (stash.get((name, 0)) for name in names)
    repeat = plan.heads.kv_repeat
    dq_local = torch.empty(q_meta.shape, dtype=q_meta.dtype, device=dout.device)  # (B, S/P, H, D)
    kv_shape = (*kv_meta.shape[:2], kv_meta.shape[2] * repeat, kv_meta.shape[3])  # replicated kv heads, if any
    dk_local, dv_local = (torch.empty(kv_shape, dtype=kv_meta.dtype, device=dout.device) for _ in range(2))
    leaving = []  # (exchange, the tensors its pieces go into, piece, pieces)
    dk_sum = dv_sum = None  # shared kv: the pieces' gradients of it, in the accumulation dtype
    for g, exchange in enumerate(arriving):
        dout_g, out_g = (place_heads(y) for y in exchange.wait())  # (B, H/(P·G), S, D) each
        k_g, v_g = (x if shared_kv else _piece(x, g, num_pieces) for x in (k_heads, v_heads))
        dq, dk, dv = block_backward(plan, dout_g, _piece(q_heads, g, num_pieces), k_g, v_g, out_g,
                                    _piece(lse_heads, g, num_pieces), 0, 0)
        if not shared_kv:
            leaving.append((head_to_seq_piece([dq.to(q_meta.dtype), dk.to(kv_meta.dtype), dv.to(kv_meta.dtype)],
                                              group), (dq_local, dk_local, dv_local), g, num_pieces))
            continue
        leaving.append((head_to_seq_piece([dq.to(q_meta.dtype)], group), (dq_local,), g, num_pieces))
        if dk_sum is None:
            acc = accumulation_dtype(kv_meta.dtype)
            dk_sum, dv_sum = dk.to(acc), dv.to(acc)
        else:
            dk_sum.add_(dk)
            dv_sum.add_(dv)
    if shared_kv:  # the shared kv heads' gradients leave whole, after the last piece
        leaving.append((head_to_seq_piece([dk_sum.to(kv_meta.dtype), dv_sum.to(kv_meta.dtype)], group),
                        (dk_local, dv_local), 0, 1))
    for name in names:
        stash.release((name, 0))
    for exchange, targets, g, pieces in leaving:
        for y, x in zip(exchange.wait(), targets):
            place_tokens(y, x, g, pieces)
    for name in names:
        stash.free((name, 0))
    dk_local, dv_local = sum_kv_replicas(dk_local, dv_local, repeat)
    return dq_local, dk_local, dv_local


def fpdt_forward(q: Tensor, k: Tensor, v: Tensor, plan: FPDTPlan, stash: ChunkStash, save_for_backward: bool) -> Tensor:
    """The forward chunk loop; stashes what the backward needs when ``save_for_backward``.

    Stash keys (head-sharded, per global chunk ``i``): ``("k", i)``, ``("v", i)`` always (later q chunks read
    them); ``("q", i)``, ``("lse", i)`` only for the backward, which needs no recompute with them. The output is
    not stashed: the backward rebuilds its head-sharded chunks from the returned local output (see
    :func:`fpdt_backward`).
    While block ``(i, j)`` computes, kv chunk ``j + 1`` (the next one read) is on its way back (double buffer).
    """
    if plan.one_chunk:
        return _ulysses_forward(q, k, v, plan, stash, save_for_backward)
    num_chunks = plan.layout.num_chunks
    chunk_len = q.shape[1] // num_chunks * plan.layout.sp_size  # C: global tokens per chunk
    out_local = torch.empty_like(q)  # (B, S/P, H, D)
    for i in range(num_chunks):
        kv_chunks = kv_chunks_read(plan, i, chunk_len)  # 0 … i, less the blocks packed documents skip
        if kv_chunks[0] < i:
            stash.prefetch(("k", kv_chunks[0]))  # overlaps the all-to-all below
            stash.prefetch(("v", kv_chunks[0]))
        q_i, k_i, v_i = _chunk(plan, q, i), _chunk(plan, k, i), _chunk(plan, v, i)  # (B, c, H|Hkv, D)
        # even split: (B, c, Hkv, D) -> (B, c, P, D) when P > Hkv; uneven: the all-to-all sends each rank its kv heads
        k_i, v_i = replicate_kv_heads(k_i, v_i, plan.heads.kv_repeat)
        # even: (B, c, H, D) -reshape-> (B, c, P, H/P, D) -all_to_all-> (P, B, H/P, c, D) -> (B, H/P, C, D); k, v alike
        # uneven: (B, c, H, D) -slice heads of rank p-> (B, h_p, c, D) -all_to_all(splits)-> P x (B, h_r, c, D)
        #   -cat by source-> (B, h_r, C, D); k, v with the kv heads of rank p (a kv head may go to several ranks)
        q_heads, k_heads, v_heads = seq_to_head([q_i, k_i, v_i], plan.group, plan.heads.ranges("q", "kv", "kv"))
        stash.put(("k", i), k_heads)
        stash.put(("v", i), v_heads)
        out_acc = lse_acc = None
        for n, j in enumerate(kv_chunks):
            if n + 1 < len(kv_chunks) and kv_chunks[n + 1] < i:
                stash.prefetch(("k", kv_chunks[n + 1]))
                stash.prefetch(("v", kv_chunks[n + 1]))
            k_j = k_heads if j == i else stash.get(("k", j))
            v_j = v_heads if j == i else stash.get(("v", j))
            out_acc, lse_acc = block_forward(plan, q_heads, k_j, v_j, i, j, out_acc, lse_acc)
            if j < i:
                stash.release(("k", j))
                stash.release(("v", j))
        out_heads = out_acc.to(q.dtype)  # (B, H/P, C, D)
        if save_for_backward:
            stash.put(("q", i), q_heads)
            stash.put(("lse", i), lse_acc)
        # (B, H/P, C, D) -all_to_all-> (B, c, H, D) (uneven: (B, h_r, C, D) -all_to_all(splits)-> (B, c, H, D))
        (out_i,) = head_to_seq([out_heads], plan.group, plan.heads.ranges("q"))
        _chunk(plan, out_local, i).copy_(out_i)
    if not save_for_backward:
        stash.clear()
    return out_local


Q_SIDE = ("q", "out", "lse", "dout")


def fpdt_backward(
    dout: Tensor, out: Tensor, plan: FPDTPlan, stash: ChunkStash, stashes: StashFactory, q_meta: Tensor, kv_meta: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward chunk loop: outer over kv chunks ``j``, inner over q chunks ``i >= j``.

    ``dK_j, dV_j`` are complete after the inner loop; ``dQ_j`` after outer step ``j`` (it needs only kv chunks
    ``<= j``), so all three go back in one all-to-all per step and the stashed chunks of ``j`` are freed. The
    partial ``dQ_i`` of later chunks wait in ``stashes``' partial-dQ store (device memory, or host memory under a tight
    budget); the one-chunk loop has none.
    While block ``(i, j)`` computes, the q-side chunks of ``i + 1`` are on their way back. ``out`` is the forward's
    local output: its head-sharded chunks travel in the same all-to-all as ``dout``'s (the forward does not stash
    them, which saves a quarter of the stash: the layer keeps its output anyway, for the output projection).
    """
    if plan.one_chunk:
        return _ulysses_backward(dout, out, plan, stash, q_meta, kv_meta)
    num_chunks = plan.layout.num_chunks
    acc = accumulation_dtype(q_meta.dtype)
    dq_store = stashes.partial_dq(dout.device)
    # q_meta, kv_meta: meta tensors with the inputs' shapes and dtypes (the inputs themselves are not kept)
    dq_local = torch.empty(q_meta.shape, dtype=q_meta.dtype, device=dout.device)
    dk_local, dv_local = (torch.empty(kv_meta.shape, dtype=kv_meta.dtype, device=dout.device) for _ in range(2))

    def stash_dout(i: int) -> None:
        # (B, c, H, D) -all_to_all-> (B, H/P, C, D) for dout and out in one collective, once per chunk, when the
        # first kv step reaches it (so only a chunk or two of them is on the device at a time when the stash offloads)
        dout_heads, out_heads = seq_to_head([_chunk(plan, dout, i), _chunk(plan, out, i)], plan.group,
                                            plan.heads.ranges("q", "q"))
        stash.put(("dout", i), dout_heads)
        stash.put(("out", i), out_heads)

    chunk_len = q_meta.shape[1] // num_chunks * plan.layout.sp_size  # C: global tokens per chunk
    stash_dout(0)
    for j in range(num_chunks):
        k_j, v_j = stash.get(("k", j)), stash.get(("v", j))
        if j + 1 < num_chunks:
            stash.prefetch(("k", j + 1))
            stash.prefetch(("v", j + 1))
        dk_acc = torch.zeros(k_j.shape, dtype=acc, device=k_j.device)
        dv_acc = torch.zeros(v_j.shape, dtype=acc, device=v_j.device)
        q_chunks = q_chunks_reading(plan, j, chunk_len)  # j … u - 1, less the blocks packed documents skip
        for n, i in enumerate(q_chunks):
            next_i = q_chunks[n + 1] if n + 1 < len(q_chunks) else None
            if j == 0:  # every chunk's dout, also of q chunks this step skips: later steps read them
                for later in range(i + 1, num_chunks if next_i is None else next_i + 1):
                    stash_dout(later)
            if next_i is not None:
                for name in Q_SIDE:
                    stash.prefetch((name, next_i))
                if ("dq", next_i) in dq_store:
                    dq_store.prefetch(("dq", next_i))
            q_i, out_i, lse_i, dout_i = (stash.get((name, i)) for name in Q_SIDE)
            dq, dk, dv = block_backward(plan, dout_i, q_i, k_j, v_j, out_i, lse_i, i, j)
            for name in Q_SIDE:
                stash.release((name, i))
            if ("dq", i) in dq_store:
                dq = dq_store.get(("dq", i)).add_(dq)
                dq_store.release(("dq", i))
                dq_store.free(("dq", i))
            dq_store.put(("dq", i), dq.to(acc))
            dk_acc.add_(dk)
            dv_acc.add_(dv)
        dq_j = dq_store.get(("dq", j))
        dq_store.release(("dq", j))
        dq_store.free(("dq", j))
        # (B, H/P, C, D) -all_to_all-> (B, c, H, D): one collective for dq, dk, dv, in the inputs' dtype; a kv head
        # that several ranks read gets the sum of their gradients (even split: sum_kv_replicas; uneven: head_to_seq)
        dq_i, dk_i, dv_i = head_to_seq(
            [dq_j.to(q_meta.dtype), dk_acc.to(kv_meta.dtype), dv_acc.to(kv_meta.dtype)], plan.group,
            plan.heads.ranges("q", "kv", "kv"),
        )
        dk_i, dv_i = sum_kv_replicas(dk_i, dv_i, plan.heads.kv_repeat)
        _chunk(plan, dq_local, j).copy_(dq_i)
        _chunk(plan, dk_local, j).copy_(dk_i)
        _chunk(plan, dv_local, j).copy_(dv_i)
        for name in ("k", "v", *Q_SIDE):
            stash.free((name, j))
    return dq_local, dk_local, dv_local


class _FPDTAttentionFunction(torch.autograd.Function):
    """FPDT attention of the local sequence shard.

    | tensor | shape | sharded dim | kept for backward |
    |---|---|---|---|
    | q (in) | (B, S/P, H, D) | sequence | no: its head-sharded chunks are in the stash |
    | k, v (in) | (B, S/P, Hkv, D) | sequence | no: their head-sharded chunks are in the stash |
    | out | (B, S/P, H, D) | sequence | yes, no copy (see below): the backward all-to-alls its chunks with dout's |
    | stash ("q"/"k"/"v", i) | (B, H/P, C, D) | heads | yes (host memory when offloading): the block backward reads |
    | stash ("lse", i) | (B, H/P, C) fp32 | heads | yes: with out it makes the blockwise backward exact |
    | stash ("dout"/"out", i) | (B, H/P, C, D) | heads | backward only: all-to-all'd once, read by every kv step |
    | partial dQ ("dq", i) | (B, H/P, C, D) fp32 | heads | backward only: device or host by the memory budget |

    ``H/P`` and ``Hkv/P`` are this rank's query and kv heads after the all-to-all, ``h_r`` and ``hk_r`` of the plan's
    :class:`HeadSplit` (unequal over the ranks when ``P`` does not divide the heads); the stashed kv chunks hold the
    ``hk_r`` kv heads as received, never expanded to one per query head. ``out`` is saved without a copy: the output
    projection keeps it anyway.

    Nothing is recomputed in backward: the block backward runs on the stashed chunks (with packed documents, on the
    same per-document segments as the forward; the plan holds the boundaries).
    """

    @staticmethod
    def forward(
        ctx, q: Tensor, k: Tensor, v: Tensor, plan: FPDTPlan, stashes: StashFactory, save: bool,
        first_pass: Optional[FirstPass] = None,
    ) -> Tensor:
        if first_pass is None:
            stash = stashes.chunks(q.device)
            out = fpdt_forward(q, k, v, plan, stash, save_for_backward=save)
        else:
            # a checkpoint's recompute: the first forward's output and stashed chunks, nothing computed again
            stash, out = first_pass.stash, first_pass.out.view(first_pass.out.shape)
        ctx.plan, ctx.stash, ctx.stashes = plan, stash, stashes
        # shapes and dtypes only: q, k, v themselves are not kept (their chunks are in the stash)
        ctx.q_meta = torch.empty_like(q, device="meta")
        ctx.kv_meta = torch.empty_like(k, device="meta")
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        (out,) = ctx.saved_tensors
        dq, dk, dv = fpdt_backward(dout.contiguous(), out, ctx.plan, ctx.stash, ctx.stashes, ctx.q_meta, ctx.kv_meta)
        ctx.stash = None
        return dq, dk, dv, None, None, None, None



def make_plan(
    query: Tensor, key: Tensor, value: Tensor, *, causal: bool, scale: Optional[float],
    group: Optional[dist.ProcessGroup], num_chunks: int, backend: str, documents: Optional[DocumentBoundaries] = None,
    layout: Optional[SequenceLayout] = None,
) -> FPDTPlan:
    """Validate the call (ValueErrors name the fix) and fix what the loops need. ``layout``: the batch's layout
    (the strategy builds it once per batch); ``None`` builds it from the group and ``num_chunks``."""
    sp_size = group_size(group)
    heads = check_call(query, key, value, causal=causal, backend=backend, sp_size=sp_size)
    if layout is None:
        layout = SequenceLayout(sp_size, group_rank(group), num_chunks)
    elif (layout.sp_size, layout.sp_rank, layout.ring_size) != (sp_size, group_rank(group), 1):
        raise ValueError(
            f"the batch's layout ({layout}) is not this group's: {sp_size} ranks, rank {group_rank(group)}, no ring; "
            f"build the layout from the same sequence-parallel group the attention runs over"
        )
    if query.shape[1] % layout.num_chunks:
        raise ValueError(
            f"local sequence length {query.shape[1]} is not divisible by num_chunks ({layout.num_chunks}): pad the "
            f"global sequence to a multiple of sequence_parallel_size * num_chunks = {layout.num_pieces}"
        )
    global_shape = (query.shape[0], query.shape[1] * sp_size)  # (B, S)
    if documents is not None and (documents.batch_size, documents.seq_len) != global_shape:
        raise ValueError(
            f"documents describe {documents.batch_size} sequences of {documents.seq_len} tokens, but the attention "
            f"got {query.shape[0]} sequences of {query.shape[1]} local tokens × {sp_size} ranks = "
            f"{query.shape[1] * sp_size}: build them from the global batch padded like it "
            f"(DocumentBoundaries.from_document_ids(ids).padded(layout.padded_length(S)))"
        )
    return FPDTPlan(
        group=group,
        layout=layout,
        kernel=make_kernel(backend, query.device, query.dtype),
        scale=softmax_scale(query, scale),
        heads=heads,
        kv_index=_local_kv_index(heads, group_rank(group), query.device),
        documents=documents,
        varlen=varlen_kernel_for(backend, query.device, query.dtype) if documents is not None else None,
        head_pieces=head_pieces_for(heads, layout.num_chunks),
    )


def _local_kv_index(heads: HeadSplit, rank: int, device: torch.device) -> Optional[Tensor]:
    index = heads.local_kv_index(rank)
    return None if index is None else torch.tensor(index, dtype=torch.long, device=device)


def varlen_kernel_for(backend: str, device: torch.device, dtype: torch.dtype) -> Optional[VarlenFlashKernel]:
    """The varlen kernel packed documents use on CUDA in fp16/bf16 (not under ``backend="math"``, the reference)."""
    return VarlenFlashKernel() if backend != "math" and VarlenFlashKernel.usable(device, dtype) else None
