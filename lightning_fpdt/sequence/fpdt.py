"""FPDT chunk-pipelined causal attention over a sequence-parallel group (DESIGN.md §4).

Each rank holds ``u`` local chunks of ``c`` tokens (:class:`SequenceLayout`). Chunk ``i`` of every rank is
all-to-all'd into the contiguous global range ``[i·C, (i+1)·C)`` for ``H/P`` heads, attended against the kv chunks
``j <= i`` block by block and merged with the log-sum-exp, then all-to-all'd back. Only the chunks of one step are
materialised at full precision at once; the rest sits in a :class:`ChunkStash`. ``u = 1`` is Ulysses.

Packed documents (:class:`~lightning_fpdt.sequence.documents.DocumentBoundaries`): each block is skipped, computed
whole, or cut into per-document segments (:func:`_block_forward`, :func:`_block_backward`); the loops are unchanged.

Three layers, as in the rest of ``sequence/``: the loops (:func:`fpdt_forward`, :func:`fpdt_backward`), a thin
``autograd.Function`` that only handles ``ctx``, and the public :func:`fpdt_attention` / :class:`FPDTAttention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fpdt.sequence.all_to_all import group_rank, group_size, head_to_seq, seq_to_head
from lightning_fpdt.sequence.documents import BlockPlan, DocumentBoundaries, Segment
from lightning_fpdt.sequence.host_stash import ChunkStash, StashFactory
from lightning_fpdt.sequence.kernels import (
    BlockKernel,
    VarlenFlashKernel,
    accumulation_dtype,
    check_backend_name,
    make_kernel,
)
from lightning_fpdt.sequence.layout import SequenceLayout


def check_heads(num_heads: int, num_kv_heads: int, sp_size: int) -> int:
    """Validate the head geometry for ``sp_size`` ranks; returns how often each kv head is replicated (GQA).

    ``Hkv % P == 0``: kv heads are scattered like query heads (factor 1). ``P % Hkv == 0``: each kv head is
    replicated ``P / Hkv`` times before the all-to-all so every rank receives the one its query heads read.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if num_heads % sp_size:
        valid = [p for p in range(1, num_heads + 1) if num_heads % p == 0]
        raise ValueError(
            f"num_heads ({num_heads}) is not divisible by sequence_parallel_size ({sp_size}); "
            f"Ulysses scatters heads, so use a sequence_parallel_size in {valid}"
        )
    if num_kv_heads % sp_size == 0:
        return 1
    if sp_size % num_kv_heads == 0:
        return sp_size // num_kv_heads
    raise ValueError(
        f"num_kv_heads ({num_kv_heads}) and sequence_parallel_size ({sp_size}) must divide one another "
        f"(scatter kv heads when num_kv_heads % P == 0, replicate them when P % num_kv_heads == 0)"
    )


def replicate_kv_heads(k: Tensor, v: Tensor, repeat: int) -> tuple[Tensor, Tensor]:
    """``(B, n, Hkv, D) -> (B, n, Hkv·repeat, D)`` before the all-to-all (``repeat`` from :func:`check_heads`): rank
    ``p`` then receives kv head ``p // repeat``, the one its query heads read."""
    if repeat == 1:
        return k, v
    return k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)


def sum_kv_replicas(dk: Tensor, dv: Tensor, repeat: int) -> tuple[Tensor, Tensor]:
    """The backward of :func:`replicate_kv_heads`: ``(B, n, Hkv·repeat, D) -> (B, n, Hkv, D)``, a replicated kv
    head's gradient being the sum over its replicas."""
    if repeat == 1:
        return dk, dv
    return dk.unflatten(2, (-1, repeat)).sum(3), dv.unflatten(2, (-1, repeat)).sum(3)


def merge_partial(
    out: Optional[Tensor], lse: Optional[Tensor], block_out: Tensor, block_lse: Tensor
) -> tuple[Tensor, Tensor]:
    """Online-softmax merge of a block's ``(out, lse)`` into the running ones, in the accumulation dtype.

    ``new_lse = logaddexp(lse, block_lse)`` and each side is weighted by ``exp(its_lse − new_lse) <= 1``, so no
    exponential of a raw logit is ever taken (``log1p(exp(·))`` forms overflow at logits of ~±90 in fp32).
    Rows that have seen no key yet (both ``-inf``) stay zero instead of becoming NaN.
    """
    acc = accumulation_dtype(block_out.dtype)
    block_out, block_lse = block_out.to(acc), block_lse.to(acc)
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)  # (B, h, Sq)
    finite_lse = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    out = out * torch.exp(lse - finite_lse).unsqueeze(-1) + block_out * torch.exp(block_lse - finite_lse).unsqueeze(-1)
    return out, new_lse


@dataclass
class _Plan:
    """What the loops need besides the tensors."""

    group: Optional[dist.ProcessGroup]
    layout: SequenceLayout
    kernel: BlockKernel
    scale: float
    kv_repeat: int  # replication of each kv head before the all-to-all (GQA with P > Hkv)
    documents: Optional[DocumentBoundaries] = None  # packed documents: per-document causal masking
    varlen: Optional[VarlenFlashKernel] = None  # packed documents on CUDA: a block's segments in one call


def _block_plans(plan: _Plan, q_chunk: int, kv_chunk: int, chunk_len: int) -> Optional[list[BlockPlan]]:
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


def _kv_chunks_read(plan: _Plan, q_chunk: int, chunk_len: int) -> list[int]:
    """The kv chunks ``j <= q_chunk`` that q chunk ``q_chunk`` reads: all of them, or (packed documents) those sharing
    a document with it; the diagonal always. Skipped chunks are neither computed nor fetched from the stash."""
    return [j for j in range(q_chunk + 1) if _block_plans(plan, q_chunk, j, chunk_len) != []]


def _q_chunks_reading(plan: _Plan, kv_chunk: int, chunk_len: int) -> list[int]:
    """The q chunks ``i >= kv_chunk`` that read kv chunk ``kv_chunk`` (see :func:`_kv_chunks_read`)."""
    return [i for i in range(kv_chunk, plan.layout.num_chunks) if _block_plans(plan, i, kv_chunk, chunk_len) != []]


def _block_forward(
    plan: _Plan, q: Tensor, k: Tensor, v: Tensor, q_chunk: int, kv_chunk: int,
    out: Optional[Tensor], lse: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    """Attend q chunk ``q_chunk`` (B, H/P, C, D) to kv chunk ``kv_chunk`` and merge into the running ``(out, lse)``.

    One kernel call, or (packed documents) one per document segment merged into its q rows; rows a block gives no
    key keep ``lse = -inf``, ``out = 0`` until a later block does (every row has its own diagonal block).
    """
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
    plan: _Plan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_chunk: int, kv_chunk: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of block ``(q_chunk, kv_chunk)`` given the final ``out, lse`` (never a skipped block).

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


def _chunk(plan: _Plan, x: Tensor, index: int) -> Tensor:
    return plan.layout.local_chunk(x, index, dim=1)


def _packed_rows(plan: _Plan, q: Tensor, q_chunk: int, kv_chunk: int):
    chunk_len = q.shape[2]
    return plan.documents.packed_rows((q_chunk * chunk_len, (q_chunk + 1) * chunk_len),
                                      (kv_chunk * chunk_len, (kv_chunk + 1) * chunk_len), q.device)


def _varlen_block_forward(
    plan: _Plan, q: Tensor, k: Tensor, v: Tensor, q_chunk: int, kv_chunk: int,
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
    plan: _Plan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_chunk: int, kv_chunk: int,
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


def fpdt_forward(q: Tensor, k: Tensor, v: Tensor, plan: _Plan, stash: ChunkStash, save_for_backward: bool) -> Tensor:
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
        k_i, v_i = replicate_kv_heads(k_i, v_i, plan.kv_repeat)  # (B, c, Hkv, D) -> (B, c, P, D) when P > Hkv
        # (B, c, H, D) -reshape-> (B, c, P, H/P, D) -all_to_all-> (P, B, H/P, c, D) -> (B, H/P, C, D); k, v alike
        q_heads, k_heads, v_heads = seq_to_head([q_i, k_i, v_i], plan.group)
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
        # (B, H/P, C, D) -all_to_all-> (B, c, H, D)
        (out_i,) = head_to_seq([out_heads], plan.group)
        _chunk(plan, out_local, i).copy_(out_i)
    if not save_for_backward:
        stash.clear()
    return out_local


Q_SIDE = ("q", "out", "lse", "dout")


def fpdt_backward(
    dout: Tensor, out: Tensor, plan: _Plan, stash: ChunkStash, dq_store: ChunkStash, q_meta: Tensor, kv_meta: Tensor
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
        dout_heads, out_heads = seq_to_head([_chunk(plan, dout, i), _chunk(plan, out, i)], plan.group)
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
        # (B, H/P, C, D) -all_to_all-> (B, c, H, D): one collective for dq, dk, dv, in the inputs' dtype
        dq_i, dk_i, dv_i = head_to_seq(
            [dq_j.to(q_meta.dtype), dk_acc.to(kv_meta.dtype), dv_acc.to(kv_meta.dtype)], plan.group
        )
        dk_i, dv_i = sum_kv_replicas(dk_i, dv_i, plan.kv_repeat)
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

    Nothing is recomputed in backward: the block backward runs on the stashed chunks (with packed documents, on the
    same per-document segments as the forward; the plan holds the boundaries).
    """

    @staticmethod
    def forward(
        ctx, q: Tensor, k: Tensor, v: Tensor, plan: _Plan, stashes: StashFactory, save: bool,
        first_pass: Optional["_FirstPass"] = None,
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


def fpdt_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    causal: bool = True,
    scale: Optional[float] = None,
    group: Union[dist.ProcessGroup, tuple[dist.ProcessGroup, dist.ProcessGroup], None] = None,
    num_chunks: int = 1,
    backend: str = "auto",
    stashes: Optional[StashFactory] = None,
    documents: Optional[DocumentBoundaries] = None,
) -> Tensor:
    """Exact causal attention of a sequence-sharded batch over the sequence-parallel ``group``.

    Args:
        query: ``(B, S/P, H, D)``, this rank's tokens in :class:`SequenceLayout` order, RoPE applied.
        key, value: ``(B, S/P, Hkv, D)``.
        causal: must be ``True``: FPDT's schedule is the causal one.
        scale: softmax scale, ``D ** -0.5`` by default.
        group: the sequence-parallel process group (``None``: the default group, or one process), or a
            ``(ulysses_group, ring_group)`` pair: the Ulysses × ring hybrid (:func:`~lightning_fpdt.sequence.ring.
            ring_attention`) for more ranks than heads.
        num_chunks: FPDT chunks per rank ``u``; ``1`` is Ulysses.
        backend: block kernel, one of ``"auto"``, ``"math"``, ``"flash"``, ``"cudnn"``.
        stashes: where chunks wait for the backward (:class:`StashFactory`; default: device memory).
        documents: packed documents of the *global* (padded) sequences (:class:`DocumentBoundaries`): a token
            attends only to earlier tokens of its own document; ``None``: one document per sequence.

    Returns:
        ``(B, S/P, H, D)``, this rank's tokens of the attention output.
    """
    if isinstance(group, tuple):  # (ulysses_group, ring_group): the hybrid over a 2-D mesh (sequence/ring.py)
        from lightning_fpdt.sequence.ring import ring_attention  # ring.py builds on this module

        if documents is not None:
            raise ValueError("packed documents are not supported with ring_size > 1 yet: use ring_size=1")
        return ring_attention(query, key, value, causal=causal, scale=scale, group=group, num_chunks=num_chunks,
                              backend=backend, stashes=stashes)
    plan = _make_plan(query, key, value, causal=causal, scale=scale, group=group, num_chunks=num_chunks,
                      backend=backend, documents=documents)
    # decided here: inside Function.forward grad mode is always off
    save = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
    return _FPDTAttentionFunction.apply(query, key, value, plan, stashes or StashFactory(), save)


def _make_plan(
    query: Tensor, key: Tensor, value: Tensor, *, causal: bool, scale: Optional[float],
    group: Optional[dist.ProcessGroup], num_chunks: int, backend: str, documents: Optional[DocumentBoundaries] = None,
) -> _Plan:
    """Validate the call (ValueErrors name the fix) and fix what the loops need."""
    if not causal:
        raise ValueError(
            "FPDT attention is causal only (its chunk schedule skips future chunks); for bidirectional attention "
            "run without the fpdt strategy"
        )
    if query.dim() != 4 or key.shape != value.shape or key.dim() != 4:
        raise ValueError(
            f"expected query (B, S/P, H, D) and key/value (B, S/P, Hkv, D) of equal shape, got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if query.shape[:2] != key.shape[:2] or query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"query {tuple(query.shape)} and key {tuple(key.shape)} must agree in batch, local length and head dim"
        )
    check_backend_name(backend)
    sp_size = group_size(group)
    kv_repeat = check_heads(query.shape[2], key.shape[2], sp_size)
    layout = SequenceLayout(sp_size, group_rank(group), num_chunks)
    if query.shape[1] % num_chunks:
        raise ValueError(
            f"local sequence length {query.shape[1]} is not divisible by num_chunks ({num_chunks}): pad the global "
            f"sequence to a multiple of sequence_parallel_size * num_chunks = {layout.num_pieces}"
        )
    global_shape = (query.shape[0], query.shape[1] * sp_size)  # (B, S)
    if documents is not None and (documents.batch_size, documents.seq_len) != global_shape:
        raise ValueError(
            f"documents describe {documents.batch_size} sequences of {documents.seq_len} tokens, but the attention "
            f"got {query.shape[0]} sequences of {query.shape[1]} local tokens × {sp_size} ranks = "
            f"{query.shape[1] * sp_size}: build them from the global batch padded like it "
            f"(DocumentBoundaries.from_document_ids(ids).padded(layout.padded_length(S)))"
        )
    return _Plan(
        group=group,
        layout=layout,
        kernel=make_kernel(backend, query.device, query.dtype),
        scale=query.shape[-1] ** -0.5 if scale is None else scale,
        kv_repeat=kv_repeat,
        documents=documents,
        varlen=varlen_kernel_for(backend, query.device, query.dtype) if documents is not None else None,
    )


def varlen_kernel_for(backend: str, device: torch.device, dtype: torch.dtype) -> Optional[VarlenFlashKernel]:
    """The varlen kernel packed documents use on CUDA in fp16/bf16 (not under ``backend="math"``, the reference)."""
    return VarlenFlashKernel() if backend != "math" and VarlenFlashKernel.usable(device, dtype) else None


def _attention_function(plan: object) -> type[torch.autograd.Function]:
    """The autograd.Function that runs ``plan``: FPDT's, or the ring hybrid's for a ring plan (sequence/ring.py)."""
    if isinstance(plan, _Plan):
        return _FPDTAttentionFunction
    from lightning_fpdt.sequence.ring import _RingAttentionFunction  # ring.py builds on this module

    return _RingAttentionFunction


def _in_backward() -> bool:
    """True while autograd runs a backward: a checkpoint recomputing a layer's forward."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class _FirstPass:
    """What a checkpointed layer's first (no-grad) forward leaves for its recompute."""

    plan: _Plan
    stash: ChunkStash  # the q/k/v/lse chunks, as for a normal backward
    out: Optional[Tensor]  # the local output (B, S/P, H, D), set when the recompute takes it back


class FPDTAttention:
    """:func:`fpdt_attention` bound to a group and options: what a strategy installs in a model.

    One instance serves a whole model (it owns the host buffer pool and the copy streams); each attention layer
    calls it through its own :meth:`for_layer` handle. Under activation checkpointing (``recording`` is set while a
    checkpoint runs a block's first, no-grad forward) a layer computes attention once, keeps its output and chunks,
    and the recompute in backward gets them back instead of running attention again.
    """

    def __init__(
        self,
        *,
        group: Union[dist.ProcessGroup, tuple[dist.ProcessGroup, dist.ProcessGroup], None] = None,
        num_chunks: int = 1,
        backend: str = "auto",
        offload: bool = False,
        offload_dq: bool = False,
        head_chunks: int = 1,
    ) -> None:
        check_backend_name(backend)
        if num_chunks < 1:
            raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
        if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1:
            raise ValueError(f"head_chunks must be a positive int, got {head_chunks!r}")
        self.group = group
        self.num_chunks = num_chunks
        self.head_chunks = head_chunks
        """Head groups G: the layers the strategy installs run projection, attention and output projection per group
        of ``H/G`` query heads (``sequence/head_chunks.py``); 1 is one group of all heads."""
        self.backend = backend
        self.stashes = StashFactory(offload=offload, offload_dq=offload_dq)
        self.recording = False
        """Set by a checkpoint around a block's first forward: keep what the recompute will need."""
        self.kernel_calls = 0
        """Attention computations run (a recompute served from the first forward does not count)."""
        self.documents: Optional[DocumentBoundaries] = None
        """Packed documents of the current batch (set per batch by the strategy); ``None``: plain causal."""

    @property
    def offload(self) -> bool:
        return self.stashes.offload

    @offload.setter
    def offload(self, value: bool) -> None:
        self.stashes.offload = value

    def plan(self, query: Tensor, key: Tensor, value: Tensor, causal: bool, scale: Optional[float]) -> object:
        """FPDT's :class:`_Plan`, or the ring hybrid's plan for a ``(ulysses_group, ring_group)`` pair."""
        if isinstance(self.group, tuple):  # (ulysses_group, ring_group): the hybrid (sequence/ring.py)
            from lightning_fpdt.sequence.ring import _make_ring_plan  # ring.py builds on this module

            if self.documents is not None:
                raise ValueError("packed documents are not supported with ring_size > 1 yet: use ring_size=1")
            return _make_ring_plan(query, key, value, causal=causal, scale=scale, group=self.group,
                                   num_chunks=self.num_chunks, backend=self.backend)
        return _make_plan(query, key, value, causal=causal, scale=scale, group=self.group,
                          num_chunks=self.num_chunks, backend=self.backend, documents=self.documents)

    def __call__(self, query: Tensor, key: Tensor, value: Tensor, *, causal: bool = True, scale: Optional[float] = None) -> Tensor:
        self.kernel_calls += 1
        save = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
        plan = self.plan(query, key, value, causal, scale)
        return _attention_function(plan).apply(query, key, value, plan, self.stashes, save)

    def for_layer(self) -> "LayerAttention":
        return LayerAttention(self)

    def __repr__(self) -> str:
        return (f"FPDTAttention(num_chunks={self.num_chunks}, backend={self.backend!r}, offload={self.offload}, "
                f"head_chunks={self.head_chunks})")


def check_document_ids(shared: FPDTAttention, document_ids: Optional[Tensor]) -> None:
    """A model passing ``document_ids`` (it masks documents single-process) needs the strategy to have found the
    documents of the global batch: the local ids cannot say where a document continues on another rank."""
    if document_ids is not None and shared.documents is None:
        raise ValueError(
            "the model passes document_ids to its attention, but the fpdt strategy found neither 'document_ids' "
            "nor position_ids restarting at 0 in the batch: put them in the dict the dataloader returns (e.g. "
            "PackedTokenDataset(document_ids=True)), so the strategy sees every document of the global sequence"
        )


def check_exact_call(*, attention_mask: Optional[Tensor], dropout: float, sliding_window: Optional[int]) -> None:
    """Refuse what the fpdt attention cannot compute exactly in a model's attention call (a Hugging Face module's,
    whole or in head groups): a mask, attention dropout, a sliding window."""
    if attention_mask is not None:
        raise ValueError(
            "the fpdt attention is causal over the whole sequence and takes no attention mask: drop padding "
            "(right-pad and set the padded labels to -100) instead of passing an attention_mask with zeros"
        )
    if dropout:
        raise ValueError(f"attention dropout ({dropout}) is not supported by the fpdt attention: set it to 0")
    if sliding_window:
        raise ValueError(
            "sliding-window attention is not supported by the fpdt attention: disable it in the model config "
            "(e.g. use_sliding_window=False, or sliding_window=None for Mistral) for full causal attention"
        )


class LayerAttention:
    """One layer's handle on a shared :class:`FPDTAttention` (see there)."""

    def __init__(self, shared: FPDTAttention) -> None:
        self.shared = shared
        self._first_pass: Optional[_FirstPass] = None
        self._kept_out: Optional[ChunkStash] = None  # the first pass's output, on the host when offloading

    def __call__(self, query: Tensor, key: Tensor, value: Tensor, *, causal: bool = True, scale: Optional[float] = None,
                 document_ids: Optional[Tensor] = None) -> Tensor:
        shared = self.shared
        check_document_ids(shared, document_ids)
        if self._first_pass is not None and _in_backward():
            return self._replay(query, key, value)
        if not shared.recording:
            return shared(query, key, value, causal=causal, scale=scale)
        # a checkpoint's first forward (no grad)
        return self.record(query, key, value, causal=causal, scale=scale)

    def record(self, query: Tensor, key: Tensor, value: Tensor, *, causal: bool = True,
               scale: Optional[float] = None) -> Tensor:
        """Compute the attention now (no graph) and stash as for a backward, keeping the output: a later call
        inside a backward takes both back instead of computing again. What a checkpoint's first forward does, and
        what each head group of ``sequence/head_chunks.py`` does."""
        shared = self.shared
        self.discard()
        shared.kernel_calls += 1
        plan = shared.plan(query, key, value, causal, scale)
        stash = shared.stashes.chunks(query.device)
        if isinstance(plan, _Plan):
            out = fpdt_forward(query, key, value, plan, stash, save_for_backward=True)
        else:  # the ring hybrid's plan
            from lightning_fpdt.sequence.ring import hybrid_forward

            out = hybrid_forward(query, key, value, plan, stash, save_for_backward=True)
        self._kept_out = shared.stashes.chunks(out.device)  # host memory when offloading
        self._kept_out.put("out", out)
        self._first_pass = _FirstPass(plan=plan, stash=stash, out=None)  # out comes back from _kept_out in _replay
        return out

    @property
    def recorded(self) -> bool:
        """A first pass is kept and waits for its replay."""
        return self._first_pass is not None

    def kept_output(self) -> Tensor:
        """The recorded output, resident (a head group's recomputed forward sums its output projection from it);
        the kept copy stays for the replay."""
        if self._first_pass is None:
            raise RuntimeError("kept_output called without a recorded first pass (record first)")
        out = self._kept_out.get("out")
        self._kept_out.release("out")
        return out

    def _replay(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        first_pass, kept = self._first_pass, self._kept_out
        self._first_pass = self._kept_out = None
        first_pass.out = kept.get("out")
        kept.release("out")
        kept.free("out")
        return _attention_function(first_pass.plan).apply(query, key, value, first_pass.plan, self.shared.stashes, True,
                                                           first_pass)

    def discard(self) -> None:
        """Drop what a first pass kept (its graph was discarded without a backward)."""
        if self._first_pass is not None:
            self._first_pass.stash.clear()
            self._kept_out.clear()
        self._first_pass = self._kept_out = None

    def __repr__(self) -> str:
        return f"LayerAttention({self.shared!r})"
