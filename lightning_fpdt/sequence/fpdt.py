"""FPDT chunk-pipelined causal attention over one sequence-parallel group (docs/design.md §4).

Each rank holds ``u`` local chunks of ``c`` tokens (:class:`SequenceLayout`). Chunk ``i`` of every rank is
all-to-all'd into the contiguous global range ``[i·C, (i+1)·C)`` for ``H/P`` heads, attended against the kv chunks
``j <= i`` block by block and merged with the log-sum-exp, then all-to-all'd back. Only the chunks of one step are
materialised at full precision at once; the rest sits in a :class:`ChunkStash`. ``u = 1`` is Ulysses.

Heads (:class:`~lightning_fpdt.sequence.heads.HeadSplit`): rank ``r`` attends for ``h_r`` query heads (``H/P``, or
``⌈H/P⌉``/``⌊H/P⌋`` when ``P`` does not divide ``H``) and the ``hk_r`` kv heads they read; "``H/P``" below is ``h_r``.
The stash keeps the ``hk_r`` kv heads as received; a block whose q heads do not group evenly over them expands them
to one per q head for the kernel call only, and sums the kernel's kv gradients back (:func:`_expand_kv`).

Packed documents (:class:`~lightning_fpdt.sequence.documents.DocumentBoundaries`): each block is skipped, computed
whole, or cut into per-document segments (:func:`_block_forward`, :func:`_block_backward`); the loops are unchanged.

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

from lightning_fpdt.sequence.all_to_all import group_rank, group_size, head_to_seq, seq_to_head
from lightning_fpdt.sequence.blocks import (
    FirstPass,
    check_call,
    merge_partial,
    replicate_kv_heads,
    softmax_scale,
    sum_kv_replicas,
)
from lightning_fpdt.sequence.documents import BlockPlan, DocumentBoundaries, Segment
from lightning_fpdt.sequence.heads import HeadSplit
from lightning_fpdt.offload.host_stash import ChunkStash, StashFactory
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

    def forward(self, q: Tensor, k: Tensor, v: Tensor, stash: ChunkStash, save_for_backward: bool) -> Tensor:
        """The forward loop alone (:func:`fpdt_forward`): what a checkpoint's first pass records."""
        return fpdt_forward(q, k, v, self, stash, save_for_backward)

    def apply(self, query: Tensor, key: Tensor, value: Tensor, stashes: StashFactory, save: bool,
              first_pass: Optional[FirstPass] = None) -> Tensor:
        """The attention with its backward (:class:`_FPDTAttentionFunction`)."""
        return _FPDTAttentionFunction.apply(query, key, value, self, stashes, save, first_pass)


def _block_plans(plan: FPDTPlan, q_chunk: int, kv_chunk: int, chunk_len: int) -> Optional[list[BlockPlan]]:
    """The per-document kernel calls of block ``(q_chunk, kv_chunk)``; ``None``: one plain call (no documents, or
    one document covering the whole block for every batch item); ``[]``: skip the block."""
    if plan.documents is None:
        return None
    q_range = (q_chunk * chunk_len, (q_chunk + 1) * chunk_len)
    kv_range = (kv_chunk * chunk_len, (kv_chunk + 1) * chunk_len)
    block_plans = plan.documents.block_plans(q_range, kv_range)
    whole_block = (Segment(0, chunk_len, 0, chunk_len, causal=q_chunk == kv_chunk),)
    if block_plans == [BlockPlan(0, plan.documents.batch_size, whole_block)]:
        return None  # the whole block lies in one document for every item
    return block_plans


def _kv_chunks_read(plan: FPDTPlan, q_chunk: int, chunk_len: int) -> list[int]:
    """The kv chunks ``j <= q_chunk`` that q chunk ``q_chunk`` reads: all of them, or (packed documents) those sharing
    a document with it; the diagonal always. Skipped chunks are neither computed nor fetched from the stash."""
    return [j for j in range(q_chunk + 1) if _block_plans(plan, q_chunk, j, chunk_len) != []]


def _q_chunks_reading(plan: FPDTPlan, kv_chunk: int, chunk_len: int) -> list[int]:
    """The q chunks ``i >= kv_chunk`` that read kv chunk ``kv_chunk`` (see :func:`_kv_chunks_read`)."""
    return [i for i in range(kv_chunk, plan.layout.num_chunks) if _block_plans(plan, i, kv_chunk, chunk_len) != []]


def _expand_kv(plan: FPDTPlan, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """An uneven split's kv heads for one kernel call: ``(B, hk_r, C, D) -index_select-> (B, h_r, C, D)``, local q
    head ``i`` reading kv head ``kv_index[i]``; unchanged when the kernels group the q heads over the kv heads
    themselves (every even split, and the uneven ranks whose heads happen to group evenly)."""
    if plan.kv_index is None:
        return k, v
    return k.index_select(1, plan.kv_index), v.index_select(1, plan.kv_index)


def _reduce_kv_grads(plan: FPDTPlan, dk: Tensor, dv: Tensor, kv_heads: int) -> tuple[Tensor, Tensor]:
    """The backward of :func:`_expand_kv`: ``(B, h_r, C, D) -index_add-> (B, hk_r, C, D)``, each kv head's gradient
    the sum over the q heads that read it, in the accumulation dtype."""
    if plan.kv_index is None:
        return dk, dv
    acc = accumulation_dtype(dk.dtype)
    shape = (dk.shape[0], kv_heads, *dk.shape[2:])
    return tuple(torch.zeros(shape, dtype=acc, device=g.device).index_add_(1, plan.kv_index, g.to(acc))
                 for g in (dk, dv))


def _block_forward(
    plan: FPDTPlan, q: Tensor, k: Tensor, v: Tensor, q_chunk: int, kv_chunk: int,
    out: Optional[Tensor], lse: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    """Attend q chunk ``q_chunk`` (B, H/P, C, D) to kv chunk ``kv_chunk`` and merge into the running ``(out, lse)``.

    One kernel call, or (packed documents) one per document segment merged into its q rows; rows a block gives no
    key keep ``lse = -inf``, ``out = 0`` until a later block does (every row has its own diagonal block).
    """
    k, v = _expand_kv(plan, k, v)
    causal = q_chunk == kv_chunk
    block_plans = _block_plans(plan, q_chunk, kv_chunk, q.shape[2])
    if block_plans is None:
        block_out, block_lse = plan.kernel.forward(q, k, v, causal=causal, scale=plan.scale)
        return merge_partial(out, lse, block_out, block_lse)
    assert block_plans, "skipped blocks are not computed"
    if plan.varlen is not None:
        return _varlen_block_forward(plan, q, k, v, q_chunk, kv_chunk, out, lse)
    if out is None:
        acc = accumulation_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)  # (B, H/P, C, D)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)  # (B, H/P, C)
    for items in block_plans:
        b = slice(items.batch_start, items.batch_end)
        for seg in items.segments:
            rows, keys = slice(seg.q_start, seg.q_end), slice(seg.k_start, seg.k_end)
            seg_out, seg_lse = plan.kernel.forward(
                q[b, :, rows], k[b, :, keys], v[b, :, keys], causal=seg.causal, scale=plan.scale
            )
            out[b, :, rows], lse[b, :, rows] = merge_partial(out[b, :, rows], lse[b, :, rows], seg_out, seg_lse)
    return out, lse


def _block_backward(
    plan: FPDTPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_chunk: int, kv_chunk: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of block ``(q_chunk, kv_chunk)`` given the final ``out, lse`` (never a skipped block); the
    kv gradients for the rank's ``hk_r`` kv heads (:func:`_expand_kv`)."""
    kv_heads = k.shape[1]
    k, v = _expand_kv(plan, k, v)
    dq, dk, dv = _block_backward_heads(plan, dout, q, k, v, out, lse, q_chunk, kv_chunk)
    return (dq, *_reduce_kv_grads(plan, dk, dv, kv_heads))


def _block_backward_heads(
    plan: FPDTPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_chunk: int,
    kv_chunk: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_block_backward` for kv heads the kernels group the q heads over.

    Packed documents: each segment's gradients go to its q rows and key rows (fp32 sums; a key row can serve
    several segments only within one document, never across).
    """
    causal = q_chunk == kv_chunk
    block_plans = _block_plans(plan, q_chunk, kv_chunk, q.shape[2])
    if block_plans is None:
        return plan.kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=plan.scale)
    assert block_plans, "skipped blocks are not computed"
    if plan.varlen is not None:
        return _varlen_block_backward(plan, dout, q, k, v, out, lse, q_chunk, kv_chunk)
    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # (B, H/P, C, D)
    dk, dv = (torch.zeros(k.shape, dtype=acc, device=k.device) for _ in range(2))  # (B, Hkv/P, C, D)
    for items in block_plans:
        b = slice(items.batch_start, items.batch_end)
        for seg in items.segments:
            rows, keys = slice(seg.q_start, seg.q_end), slice(seg.k_start, seg.k_end)
            seg_dq, seg_dk, seg_dv = plan.kernel.backward(
                dout[b, :, rows], q[b, :, rows], k[b, :, keys], v[b, :, keys], out[b, :, rows], lse[b, :, rows],
                causal=seg.causal, scale=plan.scale,
            )
            dq[b, :, rows] += seg_dq
            dk[b, :, keys] += seg_dk
            dv[b, :, keys] += seg_dv
    return dq, dk, dv


def _chunk(plan: FPDTPlan, x: Tensor, index: int) -> Tensor:
    return plan.layout.local_chunk(x, index, dim=1)


def _packed_rows(plan: FPDTPlan, q: Tensor, q_chunk: int, kv_chunk: int):
    chunk_len = q.shape[2]
    return plan.documents.packed_rows((q_chunk * chunk_len, (q_chunk + 1) * chunk_len),
                                      (kv_chunk * chunk_len, (kv_chunk + 1) * chunk_len), q.device)


def _varlen_block_forward(
    plan: FPDTPlan, q: Tensor, k: Tensor, v: Tensor, q_chunk: int, kv_chunk: int,
    out: Optional[Tensor], lse: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    """All segments of a block, over the whole batch, in one varlen call; rows without a segment get no key."""
    rows = _packed_rows(plan, q, q_chunk, kv_chunk)
    # (B, h, C, D) -transpose-> (B, C, h, D) -gather segments' tokens-> (N, h, D)
    q_packed = q.transpose(1, 2)[rows.q_items, rows.q_rows]
    k_packed, v_packed = (x.transpose(1, 2)[rows.k_items, rows.k_rows] for x in (k, v))
    seg_out, seg_lse = plan.varlen.forward(q_packed, k_packed, v_packed, rows.cum_q, rows.cum_k, rows.max_q,
                                           rows.max_k, causal=rows.causal, scale=plan.scale)  # (N, h, D), (h, N)
    block_out = torch.zeros_like(q)  # (B, h, C, D)
    block_lse = torch.full(q.shape[:3], float("-inf"), dtype=seg_lse.dtype, device=q.device)  # (B, h, C)
    block_out.transpose(1, 2)[rows.q_items, rows.q_rows] = seg_out  # written through the view
    block_lse.transpose(1, 2)[rows.q_items, rows.q_rows] = seg_lse.t()
    return merge_partial(out, lse, block_out, block_lse)


def _varlen_block_backward(
    plan: FPDTPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_chunk: int, kv_chunk: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of :func:`_varlen_block_forward` with the final ``out, lse``; zero where no segment reaches."""
    rows = _packed_rows(plan, q, q_chunk, kv_chunk)
    q_side = [x.transpose(1, 2)[rows.q_items, rows.q_rows] for x in (dout, q, out)]  # (N, h, D) each
    lse_packed = lse.transpose(1, 2)[rows.q_items, rows.q_rows].t().contiguous()  # (B, h, C) -> (h, N)
    k_packed, v_packed = (x.transpose(1, 2)[rows.k_items, rows.k_rows] for x in (k, v))
    dq_packed, dk_packed, dv_packed = plan.varlen.backward(
        q_side[0], q_side[1], k_packed, v_packed, q_side[2], lse_packed, rows.cum_q, rows.cum_k, rows.max_q,
        rows.max_k, causal=rows.causal, scale=plan.scale,
    )
    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # (B, h, C, D)
    dk, dv = (torch.zeros(k.shape, dtype=acc, device=k.device) for _ in range(2))
    # a block's segments are distinct documents: no token appears twice, plain writes suffice
    dq.transpose(1, 2)[rows.q_items, rows.q_rows] = dq_packed.to(acc)
    dk.transpose(1, 2)[rows.k_items, rows.k_rows] = dk_packed.to(acc)
    dv.transpose(1, 2)[rows.k_items, rows.k_rows] = dv_packed.to(acc)
    return dq, dk, dv


def fpdt_forward(q: Tensor, k: Tensor, v: Tensor, plan: FPDTPlan, stash: ChunkStash, save_for_backward: bool) -> Tensor:
    """The forward chunk loop; stashes what the backward needs when ``save_for_backward``.

    Stash keys (head-sharded, per global chunk ``i``): ``("k", i)``, ``("v", i)`` always (later q chunks read
    them); ``("q", i)``, ``("lse", i)`` only for the backward, which needs no recompute with them. The output is
    not stashed: the backward rebuilds its head-sharded chunks from the returned local output (see
    :func:`fpdt_backward`).
    While block ``(i, j)`` computes, kv chunk ``j + 1`` (the next one read) is on its way back (double buffer).
    """
    num_chunks = plan.layout.num_chunks
    chunk_len = q.shape[1] // num_chunks * plan.layout.sp_size  # C: global tokens per chunk
    out_local = torch.empty_like(q)  # (B, S/P, H, D)
    for i in range(num_chunks):
        kv_chunks = _kv_chunks_read(plan, i, chunk_len)  # 0 … i, less the blocks packed documents skip
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
            out_acc, lse_acc = _block_forward(plan, q_heads, k_j, v_j, i, j, out_acc, lse_acc)
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
    dout: Tensor, out: Tensor, plan: FPDTPlan, stash: ChunkStash, dq_store: ChunkStash, q_meta: Tensor, kv_meta: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward chunk loop: outer over kv chunks ``j``, inner over q chunks ``i >= j``.

    ``dK_j, dV_j`` are complete after the inner loop; ``dQ_j`` after outer step ``j`` (it needs only kv chunks
    ``<= j``), so all three go back in one all-to-all per step and the stashed chunks of ``j`` are freed. The
    partial ``dQ_i`` of later chunks wait in ``dq_store`` (device memory, or host memory under a tight budget).
    While block ``(i, j)`` computes, the q-side chunks of ``i + 1`` are on their way back. ``out`` is the forward's
    local output: its head-sharded chunks travel in the same all-to-all as ``dout``'s (the forward does not stash
    them, which saves a quarter of the stash: the layer keeps its output anyway, for the output projection).
    """
    num_chunks = plan.layout.num_chunks
    acc = accumulation_dtype(q_meta.dtype)
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
        q_chunks = _q_chunks_reading(plan, j, chunk_len)  # j … u - 1, less the blocks packed documents skip
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
            dq, dk, dv = _block_backward(plan, dout_i, q_i, k_j, v_j, out_i, lse_i, i, j)
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
    | out | (B, S/P, H, D) | sequence | yes (saved output, no copy: the output projection keeps it anyway): the backward all-to-alls its chunks with dout's |
    | stash ("q"/"k"/"v", i) | (B, H/P, C, D) | heads | yes (host memory when offloading): the block backward needs q, k, v |
    | stash ("lse", i) | (B, H/P, C) fp32 | heads | yes: with out it makes the blockwise backward exact |
    | stash ("dout"/"out", i) | (B, H/P, C, D) | heads | backward only: all-to-all'd once, read by every kv step |
    | partial dQ ("dq", i) | (B, H/P, C, D) fp32 | heads | backward only: device or host by the memory budget |

    ``H/P`` and ``Hkv/P`` are this rank's query and kv heads after the all-to-all, ``h_r`` and ``hk_r`` of the plan's
    :class:`HeadSplit` (unequal over the ranks when ``P`` does not divide the heads); the stashed kv chunks hold the
    ``hk_r`` kv heads as received, never expanded to one per query head.

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
        dq_store = ctx.stashes.partial_dq(dout.device)
        dq, dk, dv = fpdt_backward(dout.contiguous(), out, ctx.plan, ctx.stash, dq_store, ctx.q_meta, ctx.kv_meta)
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
    )


def _local_kv_index(heads: HeadSplit, rank: int, device: torch.device) -> Optional[Tensor]:
    index = heads.local_kv_index(rank)
    return None if index is None else torch.tensor(index, dtype=torch.long, device=device)


def varlen_kernel_for(backend: str, device: torch.device, dtype: torch.dtype) -> Optional[VarlenFlashKernel]:
    """The varlen kernel packed documents use on CUDA in fp16/bf16 (not under ``backend="math"``, the reference)."""
    return VarlenFlashKernel() if backend != "math" and VarlenFlashKernel.usable(device, dtype) else None
