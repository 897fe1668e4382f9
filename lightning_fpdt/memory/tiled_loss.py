"""Tiled loss: the causal-LM cross-entropy without ever materialising the full logits (docs/design.md §6).

The logits of a 128K vocabulary take 0.5 MB per token in fp32 (256 GiB at 512K tokens), more than any GPU. Here
the hidden states are projected and cross-entropied one token tile at a time: each tile's logits are upcast to fp32,
the loss and its gradient ``(softmax - onehot) / N_valid`` are taken right away, the hidden-state gradient of the tile
is written and the lm_head gradient accumulated (fp32), and the tile's logits are dropped. Only the two gradients are
kept; backward just scales them by the incoming gradient.

Three layers: :func:`tiled_cross_entropy_forward` holds the tile loop, :class:`TiledCrossEntropyFunction` only
handles ``ctx``, :func:`tiled_cross_entropy` is the public call. Switching a model's loss to it is model-specific:
``lightning_fpdt.integrations.apply_tiled_loss`` (the ``TiledLoss`` callback declares it).
"""

from __future__ import annotations

import functools
from typing import Any, Literal, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor

from lightning_fpdt.memory.tiling import auto_loss_tiles, check_num_tiles, tile_bounds
from lightning_fpdt.sequence.loss import IGNORE_INDEX

WEIGHT_GRAD_SLICE_BYTES = 64 * 2**20
"""A low-precision lm_head gradient is accumulated into its fp32 buffer in vocabulary slices of at most this many
bytes (a whole ``(V, hidden)`` temporary would be 1 GiB for Llama-3 in bf16)."""
def _cross_entropy_tile(
    h_tile: Tensor,
    weight: Tensor,
    targets: Tensor,
    valid: Tensor,
    denom: Tensor,
    grad_hidden: Optional[Tensor],
    grad_weight: Optional[Tensor],
) -> Tensor:
    """The loss sum of one tile; writes its hidden gradient into ``grad_hidden (n, hidden)`` and adds its weight
    gradient to ``grad_weight (V, hidden)``. Its own function so the tile's vocabulary-wide buffers die on return,
    before the next tile allocates its own."""
    acc = denom.dtype
    safe_targets = targets.masked_fill(~valid, 0)[:, None]  # (n, 1): ignored rows gather class 0, then count 0
    logits = F.linear(h_tile, weight).to(acc)  # (n, V): the only vocabulary-wide buffer, one tile's worth
    lse = torch.logsumexp(logits, dim=-1)  # (n,)
    token_loss = lse - logits.gather(1, safe_targets).squeeze(1)  # (n,)
    loss_sum = torch.where(valid, token_loss, torch.zeros_like(token_loss)).sum()
    if grad_hidden is None and grad_weight is None:
        return loss_sum
    # d mean / d logits = (softmax - onehot(target)) / N_valid on valid rows, 0 on ignored ones; in place
    grad_logits = logits.sub_(lse[:, None]).exp_()
    valid_acc = valid.to(acc)[:, None]  # (n, 1)
    grad_logits.scatter_add_(1, safe_targets, -valid_acc)
    grad_logits.mul_(valid_acc / denom)
    del logits
    grad_logits = grad_logits.to(weight.dtype)  # matmuls in the weight's dtype (they accumulate in fp32 inside)
    if grad_hidden is not None:
        grad_hidden.copy_(grad_logits @ weight)  # (n, V) @ (V, hidden)
    if grad_weight is not None:
        if weight.dtype == acc:
            grad_weight.addmm_(grad_logits.T, h_tile)  # (V, n) @ (n, hidden)
        elif _accumulates_in_place(grad_weight.device, weight.dtype, acc):
            # cuBLAS adds the low-precision product to the fp32 buffer in its epilogue: no rounded temporary, no
            # separate (mixed-dtype, unvectorised) add kernel per vocabulary slice
            torch.addmm(grad_weight, grad_logits.T, h_tile, acc, out=grad_weight)
        else:
            vocab_slice = max(1, WEIGHT_GRAD_SLICE_BYTES // (weight.shape[1] * weight.element_size()))
            for v0 in range(0, weight.shape[0], vocab_slice):
                v1 = v0 + vocab_slice
                grad_weight[v0:v1].add_(grad_logits[:, v0:v1].T @ h_tile)  # fp32 sum of low-precision products
    return loss_sum


@functools.lru_cache(maxsize=None)
def _accumulates_in_place(device: torch.device, dtype: torch.dtype, acc: torch.dtype) -> bool:
    """Whether ``torch.addmm(c, a, b, acc, out=c)`` (``a, b`` in ``dtype``, ``c`` in ``acc``) runs here: CUDA builds
    of torch >= 2.8 have it; CPU builds do not."""
    if device.type != "cuda":
        return False
    a = torch.ones(8, 8, dtype=dtype, device=device)
    c = torch.ones(8, 8, dtype=acc, device=device)
    try:
        torch.addmm(c, a, a, acc, out=c)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool((c == 9).all())


def tiled_cross_entropy_forward(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    num_tiles: int,
    ignore_index: int,
    *,
    hidden_grad: bool,
    weight_grad: bool,
) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """``(mean, num_valid, grad_hidden, grad_weight)``: the mean fp32 cross-entropy over the valid tokens (0 when
    there are none) and, when asked, its gradients: ``grad_hidden (N, hidden)`` in the hidden dtype and
    ``grad_weight (V, hidden)`` in fp32 (fp64 for fp64 inputs)."""
    h = hidden.reshape(-1, hidden.shape[-1])  # (N, hidden), N = all local tokens
    t = targets.reshape(-1).to(h.device)  # (N,)
    acc = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)  # fp32 at least
    valid_all = t != ignore_index
    num_valid = valid_all.sum()
    denom = num_valid.clamp(min=1).to(acc)  # a tensor: no host sync; 1 when no token is valid (mean 0, not NaN)
    loss_sum = torch.zeros((), dtype=acc, device=h.device)
    grad_hidden = torch.empty_like(h) if hidden_grad else None
    grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if weight_grad else None
    for start, end in tile_bounds(h.shape[0], num_tiles):
        loss_sum += _cross_entropy_tile(
            h[start:end], weight, t[start:end], valid_all[start:end], denom,
            None if grad_hidden is None else grad_hidden[start:end], grad_weight,
        )
    return loss_sum / denom, num_valid, grad_hidden, grad_weight


class TiledCrossEntropyFunction(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T`` against per-token targets, one token tile at a time.

    ===============  ==================  ===========================  ============================================
    tensor           shape               sharded dim                  saved for backward?
    ===============  ==================  ===========================  ============================================
    ``hidden``       ``(B, S/P, h)``     sequence (the local shard)   no: its gradient is computed in forward
    ``weight``       ``(V, h)``          none (FSDP2 has gathered it) no: likewise
    ``targets``      ``(B, S/P)``        sequence                     no
    tile logits      ``(n, V)`` fp32     ``n`` of the local tokens    no: dropped after each tile
    ``grad_hidden``  ``(B·S/P, h)``      sequence                     saved: d mean / d hidden, scaled in backward
    ``grad_weight``  ``(V, h)`` fp32     none                         saved: d mean / d weight, scaled in backward
    ``mean``         ``()``              —                            output: mean over the valid local tokens
    ``num_valid``    ``()`` int64        —                            output, not differentiable
    ===============  ==================  ===========================  ============================================

    Backward scales the saved gradients in place and returns them, so a second backward through the same graph
    (``retain_graph=True``) raises autograd's "modified by an inplace operation" error instead of returning
    wrong gradients.
    """

    @staticmethod
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, num_tiles: int, ignore_index: int
    ) -> tuple[Tensor, Tensor]:
        mean, num_valid, grad_hidden, grad_weight = tiled_cross_entropy_forward(
            hidden, weight, targets, num_tiles, ignore_index,
            hidden_grad=ctx.needs_input_grad[0], weight_grad=ctx.needs_input_grad[1],
        )
        ctx.hidden_shape, ctx.weight_dtype = hidden.shape, weight.dtype
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.mark_non_differentiable(num_valid)
        return mean, num_valid

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_mean: Tensor, grad_num_valid: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(grad_mean).view(ctx.hidden_shape)  # in place: no second (B, S/P, h)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_mean).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None


def tiled_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    num_tiles: Union[Literal["auto"], int] = "auto",
    ignore_index: int = IGNORE_INDEX,
) -> tuple[Tensor, Tensor]:
    """``(mean, num_valid)``: the fp32 cross-entropy of ``hidden @ weight.T`` averaged over the tokens whose target is
    not ``ignore_index`` (0.0, never NaN, when there are none), and that number of tokens; the full logits never exist.

    The same function as ``F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=...)`` (the
    mean) with its gradients for ``hidden`` and ``weight``; ``mean * num_valid`` is the sum, for callers that reduce
    over several shards (``fpdt_reduce_loss(mean, num_valid)`` under the fpdt strategy).

    Args:
        hidden: ``(..., hidden)`` final hidden states (after the final norm).
        weight: ``(V, hidden)`` output projection. Under FSDP2 call this where the weight is unsharded: inside the
            forward of the module that owns it (for a causal LM, its top-level ``forward``).
        targets: ``(...)`` per-token target ids, already shifted (``targets[t]`` is the token after ``t``).
        num_tiles: token tiles; ``"auto"``: enough that one tile's fp32 logits stay under 1 GiB.
        ignore_index: target value of tokens that do not count.
    """
    check_num_tiles(num_tiles, "tiled_cross_entropy")
    if isinstance(weight, DTensor):
        raise ValueError(
            "tiled_cross_entropy got a sharded DTensor weight: call it where FSDP2 has gathered the weight, inside "
            "the forward of the module that owns it (for a causal LM, the model's own forward)"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"tiled_cross_entropy needs hidden (..., h), weight (V, h) and targets (...) with the same leading dims; "
            f"got hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, targets {tuple(targets.shape)}"
        )
    num_tokens = targets.numel()
    tiles = auto_loss_tiles(num_tokens, weight.shape[0]) if num_tiles == "auto" else num_tiles
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return TiledCrossEntropyFunction.apply(hidden, weight, targets, tiles, ignore_index)
    mean, num_valid, _, _ = tiled_cross_entropy_forward(
        hidden, weight, targets, tiles, ignore_index, hidden_grad=False, weight_grad=False
    )
    return mean, num_valid
