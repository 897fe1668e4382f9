"""What the FPDT chunk loop and the Ulysses × ring hybrid share (docs/design.md §4).

- the head geometry a group of ranks can split evenly (:func:`check_heads`; the ring needs it, FPDT also runs the
  uneven :class:`~lightning_fpdt.sequence.heads.HeadSplit`) and the even split's GQA kv-head replication that lets
  more ranks than kv heads share a layer (:func:`replicate_kv_heads`, :func:`sum_kv_replicas`);
- the online-softmax merge of block results (:func:`merge_partial`);
- what a checkpointed layer's first forward keeps for its recompute (:class:`FirstPass`);
- the validation of an attention call (:func:`check_call`) and of a model's call into it (:func:`check_exact_call`):
  what cannot be computed exactly raises a ``ValueError`` that names what to do instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_fpdt.sequence.heads import HeadSplit
from lightning_fpdt.sequence.kernels import accumulation_dtype, check_backend_name
from lightning_fpdt.sequence.loss import IGNORE_INDEX


def check_heads(num_heads: int, num_kv_heads: int, sp_size: int) -> int:
    """Validate an *even* head split over ``sp_size`` ranks (the ring hybrid's Ulysses level needs one); returns how
    often each kv head is replicated (GQA). FPDT alone also splits heads unevenly (:class:`HeadSplit`).

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


def heads_allow(num_heads: int, num_kv_heads: int, sp_size: int) -> bool:
    """Whether :func:`check_heads` accepts ``sp_size`` ranks."""
    try:
        check_heads(num_heads, num_kv_heads, sp_size)
    except ValueError:
        return False
    return True


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


def check_call(query: Tensor, key: Tensor, value: Tensor, *, causal: bool, backend: str, sp_size: int) -> HeadSplit:
    """Validate a sequence-parallel attention call over ``sp_size`` ranks (ValueErrors name the fix); returns how the
    heads split over them (:class:`HeadSplit`: even or not; the ring asks :func:`check_heads` for an even one)."""
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
    return HeadSplit(num_heads=query.shape[2], num_kv_heads=key.shape[2], sp_size=sp_size)


def softmax_scale(query: Tensor, scale: Optional[float]) -> float:
    """``scale``, or ``D ** -0.5`` for ``None``."""
    return query.shape[-1] ** -0.5 if scale is None else scale


def check_exact_call(*, attention_mask: Optional[Tensor], dropout: float, sliding_window: Optional[int]) -> None:
    """Refuse what the fpdt attention cannot compute exactly in a model's attention call (a Hugging Face module's,
    whole or in head groups): a mask, attention dropout, a sliding window."""
    if attention_mask is not None:
        raise ValueError(
            "the fpdt attention is causal over the whole sequence and takes no attention mask: drop padding "
            f"(right-pad and set the padded labels to {IGNORE_INDEX}) instead of passing an attention_mask with zeros"
        )
    if dropout:
        raise ValueError(f"attention dropout ({dropout}) is not supported by the fpdt attention: set it to 0")
    if sliding_window:
        raise ValueError(
            "sliding-window attention is not supported by the fpdt attention: disable it in the model config "
            "(e.g. use_sliding_window=False, or sliding_window=None for Mistral) for full causal attention"
        )


def in_backward() -> bool:
    """True while autograd runs a backward: a checkpoint recomputing a layer's forward."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class FirstPass:
    """What a checkpointed layer's first (no-grad) forward leaves for its recompute: the validated call, the stash of
    chunks (or shares) its backward reads, and the local output, set when the recompute takes it back. The attention
    functions of FPDT and of the ring hybrid return that output instead of computing again."""

    plan: Any
    stash: Any  # a ChunkStash
    out: Optional[Tensor]
