"""FPDT chunk-pipelined causal attention over a sequence-parallel group (DESIGN.md §4).

Each rank holds ``u`` local chunks of ``c`` tokens (:class:`SequenceLayout`). Chunk ``i`` of every rank is
all-to-all'd into the contiguous global range ``[i·C, (i+1)·C)`` for ``H/P`` heads, attended against the kv chunks
``j <= i`` block by block and merged with the log-sum-exp, then all-to-all'd back. Only the chunks of one step are
materialised at full precision at once; the rest sits in a :class:`ChunkStash`. ``u = 1`` is Ulysses.

Three layers, as in the rest of ``sequence/``: the loops (:func:`fpdt_forward`, :func:`fpdt_backward`), a thin
``autograd.Function`` that only handles ``ctx``, and the public :func:`fpdt_attention` / :class:`FPDTAttention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fpdt.sequence.all_to_all import group_rank, group_size, head_to_seq, seq_to_head
from lightning_fpdt.sequence.host_stash import ChunkStash
from lightning_fpdt.sequence.kernels import BlockKernel, accumulation_dtype, check_backend_name, make_kernel
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


def _chunk(plan: _Plan, x: Tensor, index: int) -> Tensor:
    return plan.layout.local_chunk(x, index, dim=1)


def fpdt_forward(q: Tensor, k: Tensor, v: Tensor, plan: _Plan, stash: ChunkStash, save_for_backward: bool) -> Tensor:
    """The forward chunk loop; stashes what the backward needs when ``save_for_backward``.

    Stash keys (head-sharded, per global chunk ``i``): ``("k", i)``, ``("v", i)`` always (later q chunks read
    them); ``("q", i)``, ``("out", i)``, ``("lse", i)`` only for the backward, which needs no recompute with them.
    """
    num_chunks = plan.layout.num_chunks
    out_local = torch.empty_like(q)  # (B, S/P, H, D)
    for i in range(num_chunks):
        q_i, k_i, v_i = _chunk(plan, q, i), _chunk(plan, k, i), _chunk(plan, v, i)  # (B, c, H|Hkv, D)
        if plan.kv_repeat > 1:
            # (B, c, Hkv, D) -> (B, c, P, D): rank p receives kv head p // kv_repeat, the one its q heads read
            k_i, v_i = (x.repeat_interleave(plan.kv_repeat, dim=2) for x in (k_i, v_i))
        # (B, c, H, D) -reshape-> (B, c, P, H/P, D) -all_to_all-> (P, B, H/P, c, D) -> (B, H/P, C, D); k, v alike
        q_heads, k_heads, v_heads = seq_to_head([q_i, k_i, v_i], plan.group)
        stash.put(("k", i), k_heads)
        stash.put(("v", i), v_heads)
        out_acc = lse_acc = None
        for j in range(i + 1):
            if j + 1 < i:
                stash.prefetch(("k", j + 1))
                stash.prefetch(("v", j + 1))
            k_j = k_heads if j == i else stash.get(("k", j))
            v_j = v_heads if j == i else stash.get(("v", j))
            block_out, block_lse = plan.kernel.forward(q_heads, k_j, v_j, causal=(j == i), scale=plan.scale)
            out_acc, lse_acc = merge_partial(out_acc, lse_acc, block_out, block_lse)
        out_heads = out_acc.to(q.dtype)  # (B, H/P, C, D)
        if save_for_backward:
            stash.put(("q", i), q_heads)
            stash.put(("out", i), out_heads)
            stash.put(("lse", i), lse_acc)
        # (B, H/P, C, D) -all_to_all-> (B, c, H, D)
        (out_i,) = head_to_seq([out_heads], plan.group)
        _chunk(plan, out_local, i).copy_(out_i)
    if not save_for_backward:
        stash.clear()
    return out_local


def fpdt_backward(
    dout: Tensor, plan: _Plan, stash: ChunkStash, q_like: Tensor, kv_like: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward chunk loop: outer over kv chunks ``j``, inner over q chunks ``i >= j``.

    ``dK_j, dV_j`` are complete after the inner loop; ``dQ_j`` after outer step ``j`` (it needs only kv chunks
    ``<= j``), so all three go back in one all-to-all per step and the stashed chunks of ``j`` are freed.
    """
    num_chunks = plan.layout.num_chunks
    acc = accumulation_dtype(q_like.dtype)
    dq_local, dk_local, dv_local = torch.empty_like(q_like), torch.empty_like(kv_like), torch.empty_like(kv_like)
    for i in range(num_chunks):
        # (B, c, H, D) -all_to_all-> (B, H/P, C, D), once per chunk
        (dout_heads,) = seq_to_head([_chunk(plan, dout, i)], plan.group)
        stash.put(("dout", i), dout_heads)
    dq_acc: dict[int, Tensor] = {}  # partial dQ_i in the accumulation dtype, for q chunks i > current j
    for j in range(num_chunks):
        k_j, v_j = stash.get(("k", j)), stash.get(("v", j))
        dk_acc = torch.zeros(k_j.shape, dtype=acc, device=k_j.device)
        dv_acc = torch.zeros(v_j.shape, dtype=acc, device=v_j.device)
        for i in range(j, num_chunks):
            if i + 1 < num_chunks:
                for name in ("q", "out", "lse", "dout"):
                    stash.prefetch((name, i + 1))
            q_i, out_i, lse_i, dout_i = (stash.get((name, i)) for name in ("q", "out", "lse", "dout"))
            dq, dk, dv = plan.kernel.backward(dout_i, q_i, k_j, v_j, out_i, lse_i, causal=(i == j), scale=plan.scale)
            dq_acc[i] = dq.to(acc) if i not in dq_acc else dq_acc[i].add_(dq)
            dk_acc.add_(dk)
            dv_acc.add_(dv)
        dq_j = dq_acc.pop(j)
        # (B, H/P, C, D) -all_to_all-> (B, c, H, D): one collective for dq, dk, dv, in the inputs' dtype
        dq_i, dk_i, dv_i = head_to_seq([dq_j.to(q_like.dtype), dk_acc.to(kv_like.dtype), dv_acc.to(kv_like.dtype)], plan.group)
        if plan.kv_repeat > 1:
            # (B, c, Hkv·r, D) -> (B, c, Hkv, D): a replicated kv head's gradient is the sum over its replicas
            dk_i, dv_i = (g.unflatten(2, (-1, plan.kv_repeat)).sum(3) for g in (dk_i, dv_i))
        _chunk(plan, dq_local, j).copy_(dq_i)
        _chunk(plan, dk_local, j).copy_(dk_i)
        _chunk(plan, dv_local, j).copy_(dv_i)
        for name in ("k", "v", "q", "out", "lse", "dout"):
            stash.free((name, j))
    return dq_local, dk_local, dv_local


class _FPDTAttentionFunction(torch.autograd.Function):
    """FPDT attention of the local sequence shard.

    | tensor | shape | sharded dim | kept for backward |
    |---|---|---|---|
    | q (in) | (B, S/P, H, D) | sequence | no: its head-sharded chunks are in the stash |
    | k, v (in) | (B, S/P, Hkv, D) | sequence | no: their head-sharded chunks are in the stash |
    | out | (B, S/P, H, D) | sequence | no: its head-sharded chunks are in the stash |
    | stash ("q"/"k"/"v"/"out", i) | (B, H/P, C, D) | heads | yes: the block backward needs q, k, v and the final out |
    | stash ("lse", i) | (B, H/P, C) fp32 | heads | yes: with out it makes the blockwise backward exact |

    Nothing is recomputed in backward: the block backward runs on the stashed chunks.
    """

    @staticmethod
    def forward(
        ctx, q: Tensor, k: Tensor, v: Tensor, plan: _Plan, make_stash: Callable[[], ChunkStash], save: bool
    ) -> Tensor:
        stash = make_stash()
        out = fpdt_forward(q, k, v, plan, stash, save_for_backward=save)
        ctx.plan, ctx.stash = plan, stash
        # shapes and dtypes only: q, k, v themselves are not kept (their chunks are in the stash)
        ctx.q_meta = torch.empty_like(q, device="meta")
        ctx.kv_meta = torch.empty_like(k, device="meta")
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q_like = torch.empty(ctx.q_meta.shape, dtype=ctx.q_meta.dtype, device=dout.device)
        kv_like = torch.empty(ctx.kv_meta.shape, dtype=ctx.kv_meta.dtype, device=dout.device)
        dq, dk, dv = fpdt_backward(dout.contiguous(), ctx.plan, ctx.stash, q_like, kv_like)
        ctx.stash = None
        return dq, dk, dv, None, None, None


def fpdt_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    causal: bool = True,
    scale: Optional[float] = None,
    group: Optional[dist.ProcessGroup] = None,
    num_chunks: int = 1,
    backend: str = "auto",
    make_stash: Callable[[], ChunkStash] = ChunkStash,
) -> Tensor:
    """Exact causal attention of a sequence-sharded batch over the sequence-parallel ``group``.

    Args:
        query: ``(B, S/P, H, D)``, this rank's tokens in :class:`SequenceLayout` order, RoPE applied.
        key, value: ``(B, S/P, Hkv, D)``.
        causal: must be ``True``: FPDT's schedule is the causal one.
        scale: softmax scale, ``D ** -0.5`` by default.
        group: the sequence-parallel process group (``None``: the default group, or one process).
        num_chunks: FPDT chunks per rank ``u``; ``1`` is Ulysses.
        backend: block kernel, one of ``"auto"``, ``"math"``, ``"flash"``, ``"cudnn"``.
        make_stash: factory of the chunk store (host offload plugs in here).

    Returns:
        ``(B, S/P, H, D)``, this rank's tokens of the attention output.
    """
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
    plan = _Plan(
        group=group,
        layout=layout,
        kernel=make_kernel(backend, query.device, query.dtype),
        scale=query.shape[-1] ** -0.5 if scale is None else scale,
        kv_repeat=kv_repeat,
    )
    # decided here: inside Function.forward grad mode is always off
    save = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
    return _FPDTAttentionFunction.apply(query, key, value, plan, make_stash, save)


class FPDTAttention:
    """:func:`fpdt_attention` bound to a group and options; the ``attention_fn`` a strategy installs in a model."""

    def __init__(
        self, *, group: Optional[dist.ProcessGroup] = None, num_chunks: int = 1, backend: str = "auto"
    ) -> None:
        check_backend_name(backend)
        if num_chunks < 1:
            raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
        self.group = group
        self.num_chunks = num_chunks
        self.backend = backend

    def __call__(self, query: Tensor, key: Tensor, value: Tensor, *, causal: bool = True, scale: Optional[float] = None) -> Tensor:
        return fpdt_attention(
            query, key, value, causal=causal, scale=scale, group=self.group, num_chunks=self.num_chunks,
            backend=self.backend,
        )

    def __repr__(self) -> str:
        return f"FPDTAttention(num_chunks={self.num_chunks}, backend={self.backend!r})"
