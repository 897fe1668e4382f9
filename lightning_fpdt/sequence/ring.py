"""Hybrid Ulysses × ring attention: sequence parallelism beyond the head count (docs/ring.md).

Ulysses cannot use more ranks than query heads (it scatters heads). Here the ``P = U·R`` sequence-parallel ranks form
``R`` ring ranks of ``U`` Ulysses ranks each (:class:`SequenceLayout` with ``ring_size=R`` says which tokens each
holds). Attention runs in two levels:

1. an all-to-all over the Ulysses group (sequence -> heads): each rank gets its ring rank's whole *share* of the
   sequence (``S/R`` tokens: ring pieces ``ρ`` and ``2R−1−ρ``) for ``H/U`` heads;
2. ring attention over the ring group: the kv shares travel around the ring (point-to-point send/recv overlapped
   with the block compute), each q share attends each kv share block by block with the causal blocks of
   :meth:`SequenceLayout.ring_block` (the diagonal causal, others full or skipped), and the partial results merge by
   log-sum-exp (:func:`merge_partial`);

then the all-to-all back. The backward runs the same ring: kv shares travel again, and each share's dK/dV
accumulator travels with it (ring-flash-attention's scheme), arriving home complete after ``R`` steps.

Three layers, as in the rest of ``sequence/``: the loops (:func:`ring_forward`, :func:`ring_backward`, and
:func:`hybrid_forward` / :func:`hybrid_backward` around them with the all-to-alls), a thin ``autograd.Function``,
and the public ``ring_attention`` in :mod:`lightning_fpdt.sequence.attention`, whose one dispatch
(``plan_attention``) validates a call here (:func:`make_ring_plan`) when the ring has more than one rank. The kernels
are ``kernels.py``'s block kernels (forward returns the LSE; the backward takes the final ``out, lse``), so every
backend of FPDT runs here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fpdt.offload.host_stash import ChunkStash, StashFactory
from lightning_fpdt.sequence.all_to_all import head_to_seq, seq_to_head
from lightning_fpdt.sequence.blocks import (
    FirstPass,
    check_call,
    check_heads,
    merge_partial,
    replicate_kv_heads,
    softmax_scale,
    sum_kv_replicas,
)
from lightning_fpdt.sequence.kernels import BlockKernel, accumulation_dtype, make_kernel
from lightning_fpdt.sequence.layout import SequenceLayout

SequenceGroups = tuple[dist.ProcessGroup, dist.ProcessGroup]
"""``(ulysses_group, ring_group)``: the two axes of a 2-D sequence-parallel mesh."""

KV_TAG, DKV_TAG = 71, 72  # point-to-point tags: kv shares and dK/dV accumulators travel side by side in backward


def split_groups(group: SequenceGroups) -> tuple[dist.ProcessGroup, dist.ProcessGroup, int, int]:
    """``(ulysses_group, ring_group, U, R)`` of a ``(ulysses_group, ring_group)`` pair; ``ValueError`` for anything
    else."""
    if len(group) != 2 or not all(isinstance(g, dist.ProcessGroup) for g in group):
        raise ValueError(
            f"group must be a (ulysses_group, ring_group) pair of process groups, got {group!r}; "
            f"new_sequence_groups(ring_size) builds them"
        )
    ulysses_group, ring_group = group
    return ulysses_group, ring_group, dist.get_world_size(ulysses_group), dist.get_world_size(ring_group)


def new_sequence_groups(ring_size: int, ranks: Optional[list[int]] = None) -> SequenceGroups:
    """This rank's ``(ulysses_group, ring_group)`` over ``ranks`` (default: the whole world), ring-major: the
    Ulysses groups are ``U`` consecutive ranks (the all-to-all carries the most bytes: keep it inside a host), the
    ring groups take every ``U``-th rank. Every rank of the world must call it (``dist.new_group`` is collective).

    Without Lightning; the strategy takes the same groups from its DeviceMesh ``("ring", "ulysses")`` axes.
    """
    ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
    if ring_size < 1 or len(ranks) % ring_size:
        raise ValueError(f"ring_size ({ring_size}) must divide the number of sequence-parallel ranks ({len(ranks)})")
    ulysses_size = len(ranks) // ring_size
    me = dist.get_rank()
    mine: dict[str, dist.ProcessGroup] = {}
    for rho in range(ring_size):
        members = ranks[rho * ulysses_size:(rho + 1) * ulysses_size]
        group = dist.new_group(members)
        if me in members:
            mine["ulysses"] = group
    for j in range(ulysses_size):
        members = ranks[j::ulysses_size]
        group = dist.new_group(members)
        if me in members:
            mine["ring"] = group
    if len(mine) != 2:
        raise ValueError(f"rank {me} is not among the sequence-parallel ranks {ranks}")
    return mine["ulysses"], mine["ring"]


class RingComm:
    """One point-to-point exchange around the ring: send a tensor to the next ring rank, receive the previous one's.

    Life cycle: :meth:`start` posts both operations (asynchronous, so the caller computes meanwhile), :meth:`wait`
    completes them and returns the received tensor; ``wait`` before ``start`` or ``start`` twice raises
    ``RuntimeError``. The sent tensor is kept alive until ``wait`` (the transport may still be reading it).
    """

    def __init__(self, group: dist.ProcessGroup, tag: int) -> None:
        self.group, self.tag = group, tag
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.send_to = dist.get_global_rank(group, (rank + 1) % size)
        self.recv_from = dist.get_global_rank(group, (rank - 1) % size)
        self._requests: Optional[list] = None
        self._sent: Optional[Tensor] = None
        self._received: Optional[Tensor] = None

    def start(self, tensor: Tensor) -> None:
        if self._requests is not None:
            raise RuntimeError("RingComm.start called again before wait: one exchange at a time")
        self._sent = tensor.contiguous()
        self._received = torch.empty_like(self._sent)
        self._requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, self._sent, self.send_to, self.group, self.tag),
            dist.P2POp(dist.irecv, self._received, self.recv_from, self.group, self.tag),
        ])

    def wait(self) -> Tensor:
        if self._requests is None:
            raise RuntimeError("RingComm.wait called before start")
        for request in self._requests:
            request.wait()
        received = self._received
        self._requests = self._sent = self._received = None
        return received


@dataclass
class RingPlan:
    """What the loops need besides the tensors."""

    ulysses_group: dist.ProcessGroup
    ring_group: dist.ProcessGroup
    layout: SequenceLayout  # P = U·R ranks, ring_size R: ring_block and the ring rank come from here
    kernel: BlockKernel
    scale: float
    kv_repeat: int  # replication of each kv head before the Ulysses all-to-all (GQA with U > Hkv)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, stash: ChunkStash, save_for_backward: bool) -> Tensor:
        """The forward path alone (:func:`hybrid_forward`): what a checkpoint's first pass records."""
        return hybrid_forward(q, k, v, self, stash, save_for_backward)

    def apply(self, query: Tensor, key: Tensor, value: Tensor, stashes: StashFactory, save: bool,
              first_pass: Optional[FirstPass] = None) -> Tensor:
        """The attention with its backward (:class:`_RingAttentionFunction`)."""
        return _RingAttentionFunction.apply(query, key, value, self, stashes, save, first_pass)


def _rows(x: Tensor, rows: slice) -> Tensor:
    """``x[:, :, rows]`` of a ``(B, h, S, …)`` tensor; a partial slice is made contiguous for the kernels."""
    if rows.start == 0 and rows.stop == x.shape[2]:
        return x
    return x[:, :, rows].contiguous()


def ring_forward(q: Tensor, kv: Tensor, plan: RingPlan) -> tuple[Tensor, Tensor]:
    """The forward ring: this ring rank's q share against every ring rank's kv share, merged by log-sum-exp.

    ``q (B, h, S/R, D)``, ``kv (2, B, hk, S/R, D)`` (k and v stacked: one message per step). Step ``s`` holds the
    kv share of ring rank ``(ρ − s) mod R``; the next one is on its way while the block computes. Returns the merged
    ``out (B, h, S/R, D)`` and ``lse (B, h, S/R)`` in the accumulation dtype.
    """
    layout, ring_size = plan.layout, plan.layout.ring_size
    comm = RingComm(plan.ring_group, KV_TAG)
    out = lse = None
    for step in range(ring_size):
        if step + 1 < ring_size:
            comm.start(kv)
        block = layout.ring_block((layout.ring_rank - step) % ring_size, q.shape[2])
        block_out, block_lse = plan.kernel.forward(
            _rows(q, block.q), _rows(kv[0], block.kv), _rows(kv[1], block.kv), causal=block.causal, scale=plan.scale
        )
        if out is None:  # step 0 is the diagonal: every row has seen at least itself
            out, lse = merge_partial(None, None, block_out, block_lse)
        else:
            out[:, :, block.q], lse[:, :, block.q] = merge_partial(
                out[:, :, block.q], lse[:, :, block.q], block_out, block_lse
            )
        if step + 1 < ring_size:
            kv = comm.wait()
    return out, lse


def ring_backward(
    dout: Tensor, q: Tensor, kv: Tensor, out: Tensor, lse: Tensor, plan: RingPlan
) -> tuple[Tensor, Tensor]:
    """The backward ring: kv shares travel as in forward and each share's dK/dV accumulator travels with it.

    At step ``s`` this rank holds the kv share of ring rank ``κ = (ρ − s) mod R`` and receives the accumulator of
    that same share (``κ``'s own contribution and those of the ring ranks in between), adds its block's dK/dV and
    passes it on; after the ``R``-th pass every accumulator is home, complete. ``dQ`` stays here. Every block
    backward is fed the *final* ``out`` and ``lse`` of its q rows, which makes the blockwise gradients exact.
    Returns ``dq (B, h, S/R, D)`` and ``dkv (2, B, hk, S/R, D)`` in the accumulation dtype.
    """
    layout, ring_size = plan.layout, plan.layout.ring_size
    acc = accumulation_dtype(q.dtype)
    kv_comm, dkv_comm = RingComm(plan.ring_group, KV_TAG), RingComm(plan.ring_group, DKV_TAG)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    for step in range(ring_size):
        if step + 1 < ring_size:
            kv_comm.start(kv)
        block = layout.ring_block((layout.ring_rank - step) % ring_size, q.shape[2])
        block_dq, block_dk, block_dv = plan.kernel.backward(
            _rows(dout, block.q), _rows(q, block.q), _rows(kv[0], block.kv), _rows(kv[1], block.kv),
            _rows(out, block.q), _rows(lse, block.q), causal=block.causal, scale=plan.scale,
        )
        dq[:, :, block.q] += block_dq
        # the accumulator of the kv share held now: fresh for this rank's own share, else from the previous rank
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device) if step == 0 else dkv_comm.wait()
        dkv[0, :, :, block.kv] += block_dk
        dkv[1, :, :, block.kv] += block_dv
        if step + 1 < ring_size:
            kv = kv_comm.wait()
        dkv_comm.start(dkv)
    return dq, dkv_comm.wait()  # this ring rank's own share, every ring rank's contribution summed


SAVED = ("q", "kv", "out", "lse")
"""Stash keys of what the backward needs: the head-sharded shares (see the table of :class:`_RingAttentionFunction`)."""


def hybrid_forward(
    q: Tensor, k: Tensor, v: Tensor, plan: RingPlan, stash: ChunkStash, save_for_backward: bool
) -> Tensor:
    """All-to-all over the Ulysses group, the ring, all-to-all back; returns the local output. When
    ``save_for_backward``, stashes the head-sharded ``q``, ``kv``, ``out`` and ``lse`` (host memory when offloading:
    then only one layer's shares are on the device in backward)."""
    k, v = replicate_kv_heads(k, v, plan.kv_repeat)  # (B, S/P, Hkv, D) -> (B, S/P, U, D) when U > Hkv
    # (B, S/P, H, D) -reshape-> (B, S/P, U, H/U, D) -all_to_all-> (U, B, H/U, S/P, D) -> (B, H/U, S/R, D); k, v alike
    q_heads, k_heads, v_heads = seq_to_head([q, k, v], plan.ulysses_group)
    kv = torch.stack([k_heads, v_heads])  # (2, B, hk, S/R, D)
    out, lse = ring_forward(q_heads, kv, plan)
    out_heads = out.to(q.dtype)  # (B, H/U, S/R, D)
    if save_for_backward:
        for name, tensor in zip(SAVED, (q_heads, kv, out_heads, lse)):
            stash.put(name, tensor)
    # (B, H/U, S/R, D) -all_to_all-> (B, S/P, H, D)
    (out_local,) = head_to_seq([out_heads], plan.ulysses_group)
    return out_local


def hybrid_backward(dout: Tensor, plan: RingPlan, stash: ChunkStash) -> tuple[Tensor, Tensor, Tensor]:
    """The inverse path: ``dout`` all-to-all'd to heads, the backward ring on the stashed shares, ``dq, dk, dv``
    all-to-all'd back in one collective (in the inputs' dtype)."""
    for name in SAVED:
        stash.prefetch(name)  # on its way back from the host while dout is all-to-all'd
    (dout_heads,) = seq_to_head([dout], plan.ulysses_group)  # (B, S/P, H, D) -> (B, H/U, S/R, D)
    q_heads, kv, out_heads, lse = (stash.get(name) for name in SAVED)
    dq, dkv = ring_backward(dout_heads, q_heads, kv, out_heads, lse, plan)
    q_dtype, kv_dtype = q_heads.dtype, kv.dtype
    del q_heads, kv, out_heads, lse
    for name in SAVED:
        stash.release(name)
        stash.free(name)
    # (B, H/U, S/R, D) -all_to_all-> (B, S/P, H, D); dk, dv alike
    dq_local, dk_local, dv_local = head_to_seq(
        [dq.to(q_dtype), dkv[0].to(kv_dtype), dkv[1].to(kv_dtype)], plan.ulysses_group
    )
    dk_local, dv_local = sum_kv_replicas(dk_local, dv_local, plan.kv_repeat)
    return dq_local, dk_local, dv_local


class _RingAttentionFunction(torch.autograd.Function):
    """Hybrid Ulysses × ring attention of the local sequence shard.

    | tensor | shape | sharded dim | kept for backward |
    |---|---|---|---|
    | q (in) | (B, S/P, H, D) | sequence | no: its head-sharded share is in the stash |
    | k, v (in) | (B, S/P, Hkv, D) | sequence | no: their head-sharded share is in the stash |
    | out | (B, S/P, H, D) | sequence | no: its head-sharded share is in the stash |
    | stash "q" | (B, H/U, S/R, D) | heads (U), sequence (R) | yes (host when offloading): each block backward reads |
    | stash "kv" | (2, B, hk, S/R, D) | heads (U), sequence (R) | yes: it travels the ring again in backward |
    | stash "out" | (B, H/U, S/R, D) | heads, sequence | yes: with lse it makes the blockwise backward exact |
    | stash "lse" | (B, H/U, S/R) fp32 | heads, sequence | yes: see out |
    | dq, dkv (backward) | as q, kv, fp32 | heads, sequence | backward only, on the device: dkv travels with kv |

    ``hk = max(Hkv, U)/U`` kv heads per rank. Nothing is recomputed in backward (under activation checkpointing the
    recompute takes the first forward's output and stash: ``first_pass``, as for FPDT).
    """

    @staticmethod
    def forward(
        ctx, q: Tensor, k: Tensor, v: Tensor, plan: RingPlan, stashes: StashFactory, save: bool,
        first_pass: Optional[FirstPass] = None,
    ) -> Tensor:
        if first_pass is None:
            stash = stashes.chunks(q.device)
            out = hybrid_forward(q, k, v, plan, stash, save_for_backward=save)
        else:
            # a checkpoint's recompute: the first forward's output and stash, nothing computed again
            stash, out = first_pass.stash, first_pass.out.view(first_pass.out.shape)
        ctx.plan, ctx.stash = plan, stash
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        dq, dk, dv = hybrid_backward(dout.contiguous(), ctx.plan, ctx.stash)
        ctx.stash = None
        return dq, dk, dv, None, None, None, None


def make_ring_plan(
    query: Tensor, key: Tensor, value: Tensor, *, causal: bool, scale: Optional[float], group: SequenceGroups,
    num_chunks: int, backend: str, layout: Optional[SequenceLayout] = None,
) -> RingPlan:
    """Validate the call (ValueErrors print every factor) and fix what the loops need. ``layout``: the batch's
    layout (the strategy builds it once per batch); ``None`` builds it from the two groups."""
    ulysses_group, ring_group, ulysses_size, ring_size = split_groups(group)
    sp_size = ulysses_size * ring_size
    try:
        check_heads(query.shape[2], key.shape[2], ulysses_size)
    except ValueError as error:
        raise ValueError(
            f"with ring_size {ring_size} the heads are split over U = sequence_parallel_size ({sp_size}) / ring_size "
            f"({ring_size}) = {ulysses_size} ranks: {error}; or choose another ring_size"
        ) from error
    sp_rank = dist.get_rank(ring_group) * ulysses_size + dist.get_rank(ulysses_group)  # ring-major
    if layout is None:
        layout = SequenceLayout(sp_size, sp_rank, num_chunks, ring_size=ring_size)  # raises for num_chunks > 1
    elif (layout.sp_size, layout.sp_rank, layout.ring_size) != (sp_size, sp_rank, ring_size):
        raise ValueError(
            f"the batch's layout ({layout}) is not this mesh's: {sp_size} ranks in a ring of {ring_size}, rank "
            f"{sp_rank}; build the layout from the same sequence-parallel mesh the attention runs over"
        )
    layout.check_divisible(query.shape[1] * sp_size)
    # the Ulysses level is FPDT's own validation (causal, shapes, backend, GQA replication over U ranks)
    kv_repeat = check_call(query, key, value, causal=causal, backend=backend, sp_size=ulysses_size).kv_repeat
    return RingPlan(ulysses_group=ulysses_group, ring_group=ring_group, layout=layout,
                    kernel=make_kernel(backend, query.device, query.dtype), scale=softmax_scale(query, scale),
                    kv_repeat=kv_repeat)
