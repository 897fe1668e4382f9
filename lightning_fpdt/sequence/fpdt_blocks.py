"""One block of FPDT's chunk loops (docs/design.md §4): q chunk ``i`` against kv chunk ``j``, forward
(:func:`block_forward`, merged into the running output by its log-sum-exp) and backward (:func:`block_backward`, fed
the final output and log-sum-exp), with what a block needs beyond one kernel call: the kernel's view of an uneven
split's kv heads (:func:`_expand_kv`), and packed documents (the blocks they skip, their per-document segments, and
the varlen kernel that takes all of a block's segments in one call). The loops are in
:mod:`lightning_fpdt.sequence.fpdt`.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
from torch import Tensor

from lightning_fpdt.sequence.blocks import merge_partial
from lightning_fpdt.sequence.documents import BlockPlan, DocumentBoundaries, Segment
from lightning_fpdt.sequence.kernels import BlockKernel, VarlenFlashKernel, accumulation_dtype
from lightning_fpdt.sequence.layout import SequenceLayout


class BlockCall(Protocol):
    """What a block reads of its call's plan (:class:`~lightning_fpdt.sequence.fpdt.FPDTPlan`)."""

    layout: SequenceLayout
    kernel: BlockKernel
    scale: float
    kv_index: Optional[Tensor]  # (h_r,) this rank's kv head per q head, when the kernels' grouping is not it
    documents: Optional[DocumentBoundaries]
    varlen: Optional[VarlenFlashKernel]


def block_plans_of(plan: BlockCall, q_chunk: int, kv_chunk: int, chunk_len: int) -> Optional[list[BlockPlan]]:
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


def kv_chunks_read(plan: BlockCall, q_chunk: int, chunk_len: int) -> list[int]:
    """The kv chunks ``j <= q_chunk`` that q chunk ``q_chunk`` reads: all of them, or (packed documents) those sharing
    a document with it; the diagonal always. Skipped chunks are neither computed nor fetched from the stash."""
    return [j for j in range(q_chunk + 1) if block_plans_of(plan, q_chunk, j, chunk_len) != []]


def q_chunks_reading(plan: BlockCall, kv_chunk: int, chunk_len: int) -> list[int]:
    """The q chunks ``i >= kv_chunk`` that read kv chunk ``kv_chunk`` (see :func:`kv_chunks_read`)."""
    return [i for i in range(kv_chunk, plan.layout.num_chunks) if block_plans_of(plan, i, kv_chunk, chunk_len) != []]


def _expand_kv(plan: BlockCall, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """An uneven split's kv heads for one kernel call: ``(B, hk_r, C, D) -index_select-> (B, h_r, C, D)``, local q
    head ``i`` reading kv head ``kv_index[i]``; unchanged when the kernels group the q heads over the kv heads
    themselves (every even split, and the uneven ranks whose heads happen to group evenly)."""
    if plan.kv_index is None:
        return k, v
    return k.index_select(1, plan.kv_index), v.index_select(1, plan.kv_index)


def _reduce_kv_grads(plan: BlockCall, dk: Tensor, dv: Tensor, kv_heads: int) -> tuple[Tensor, Tensor]:
    """The backward of :func:`_expand_kv`: ``(B, h_r, C, D) -index_add-> (B, hk_r, C, D)``, each kv head's gradient
    the sum over the q heads that read it, in the accumulation dtype."""
    if plan.kv_index is None:
        return dk, dv
    acc = accumulation_dtype(dk.dtype)
    shape = (dk.shape[0], kv_heads, *dk.shape[2:])
    return tuple(torch.zeros(shape, dtype=acc, device=g.device).index_add_(1, plan.kv_index, g.to(acc))
                 for g in (dk, dv))


def block_forward(
    plan: BlockCall, q: Tensor, k: Tensor, v: Tensor, q_chunk: int, kv_chunk: int,
    out: Optional[Tensor], lse: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    """Attend q chunk ``q_chunk`` (B, H/P, C, D) to kv chunk ``kv_chunk`` and merge into the running ``(out, lse)``
    (the accumulation dtype once merged; a first block's plain call returns the kernel's output as it is).

    One kernel call, or (packed documents) one per document segment merged into its q rows; rows a block gives no
    key keep ``lse = -inf``, ``out = 0`` until a later block does (every row has its own diagonal block).
    """
    k, v = _expand_kv(plan, k, v)
    causal = q_chunk == kv_chunk
    block_plans = block_plans_of(plan, q_chunk, kv_chunk, q.shape[2])
    if block_plans is None:
        block_out, block_lse = plan.kernel.forward(q, k, v, causal=causal, scale=plan.scale)
        if out is None:  # a first block: nothing to merge with, its output stays in the kernel's dtype
            return block_out, block_lse
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


def block_backward(
    plan: BlockCall, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_chunk: int,
    kv_chunk: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of block ``(q_chunk, kv_chunk)`` given the final ``out, lse`` (never a skipped block); the
    kv gradients for the rank's ``hk_r`` kv heads (:func:`_expand_kv`)."""
    kv_heads = k.shape[1]
    k, v = _expand_kv(plan, k, v)
    dq, dk, dv = _block_backward_heads(plan, dout, q, k, v, out, lse, q_chunk, kv_chunk)
    return (dq, *_reduce_kv_grads(plan, dk, dv, kv_heads))


def _block_backward_heads(
    plan: BlockCall, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_chunk: int,
    kv_chunk: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`block_backward` for kv heads the kernels group the q heads over.

    Packed documents: each segment's gradients go to its q rows and key rows (fp32 sums; a key row can serve
    several segments only within one document, never across).
    """
    causal = q_chunk == kv_chunk
    block_plans = block_plans_of(plan, q_chunk, kv_chunk, q.shape[2])
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


def _packed_rows(plan: BlockCall, q: Tensor, q_chunk: int, kv_chunk: int):
    chunk_len = q.shape[2]
    return plan.documents.packed_rows((q_chunk * chunk_len, (q_chunk + 1) * chunk_len),
                                      (kv_chunk * chunk_len, (kv_chunk + 1) * chunk_len), q.device)


def _varlen_block_forward(
    plan: BlockCall, q: Tensor, k: Tensor, v: Tensor, q_chunk: int, kv_chunk: int,
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
    plan: BlockCall, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_chunk: int,
    kv_chunk: int,
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
