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

from typing import Any, Literal, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor

from lightning_fpdt.fused.ops import FUSED_OPS
from lightning_fpdt.memory.tiling import accumulates_in_place, auto_loss_tiles, check_num_tiles, tile_bounds
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
    safe_targets = targets.masked_fill(~valid, 0)[:, None]  # (n, 1): ignored rows gather class 0, then count 0
    with_grad = grad_hidden is not None or grad_weight is not None
    if FUSED_OPS.applies(h_tile):
        args = (F.linear(h_tile, weight), safe_targets, valid, denom, weight.dtype)  # logits (n, V), never upcast
        fused = _tile_loss_and_grad if with_grad else _tile_loss
        loss_sum, grad_logits = FUSED_OPS.run(fused, lambda: _tile_in_place(*args, with_grad=with_grad), *args)
        del args
    else:
        # the logits upcast as they are made: one vocabulary-wide buffer, one tile's worth
        logits = F.linear(h_tile, weight).to(denom.dtype)
        loss_sum, grad_logits = _tile_in_place(logits, safe_targets, valid, denom, weight.dtype, with_grad=with_grad)
        del logits
    if grad_logits is not None:
        _tile_gradients(grad_logits, h_tile, weight, grad_hidden, grad_weight)
    return loss_sum


def _tile_in_place(logits: Tensor, safe_targets: Tensor, valid: Tensor, denom: Tensor, grad_dtype: torch.dtype, *,
                   with_grad: bool) -> tuple[Tensor, Optional[Tensor]]:
    """``(loss sum, d mean / d logits in grad_dtype or None)`` of one tile, eager: the logits in ``denom``'s dtype
    (upcast here if they are not), the gradient computed in that buffer in place."""
    logits = logits.to(denom.dtype)
    lse = torch.logsumexp(logits, dim=-1)  # (n,)
    token_loss = lse - logits.gather(1, safe_targets).squeeze(1)  # (n,)
    loss_sum = torch.where(valid, token_loss, torch.zeros_like(token_loss)).sum()
    if not with_grad:
        return loss_sum, None
    # d mean / d logits = (softmax - onehot(target)) / N_valid on valid rows, 0 on ignored ones; in place
    grad_logits = logits.sub_(lse[:, None]).exp_()
    valid_acc = valid.to(denom.dtype)[:, None]  # (n, 1)
    grad_logits.scatter_add_(1, safe_targets, -valid_acc)
    grad_logits.mul_(valid_acc / denom)
    del logits
    return loss_sum, grad_logits.to(grad_dtype)  # matmuls in the weight's dtype (they accumulate in fp32 inside)


def _tile_loss(logits: Tensor, safe_targets: Tensor, valid: Tensor, denom: Tensor,
               grad_dtype: torch.dtype) -> tuple[Tensor, None]:
    """The fused form of :func:`_tile_in_place` without the gradient: one reduction over the vocabulary."""
    wide = logits.to(denom.dtype)
    token_loss = torch.logsumexp(wide, dim=-1) - wide.gather(1, safe_targets).squeeze(1)  # (n,)
    return torch.where(valid, token_loss, torch.zeros_like(token_loss)).sum(), None


def _tile_loss_and_grad(logits: Tensor, safe_targets: Tensor, valid: Tensor, denom: Tensor,
                        grad_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The fused form of :func:`_tile_in_place`: the same formulas as plain tensor expressions (no in-place writes,
    the one-hot a comparison), which compile to one reduction over the vocabulary and one pass writing the gradient
    in ``grad_dtype``: the logits are read twice and never upcast in memory."""
    wide = logits.to(denom.dtype)  # (n, V)
    lse = torch.logsumexp(wide, dim=-1, keepdim=True)  # (n, 1)
    loss_sum = torch.where(valid[:, None], lse - wide.gather(1, safe_targets), torch.zeros_like(lse)).sum()
    classes = torch.arange(wide.shape[1], device=wide.device)[None, :]  # (1, V)
    scale = torch.where(valid[:, None], 1 / denom, torch.zeros_like(lse))  # (n, 1)
    grad = (torch.exp(wide - lse) - (classes == safe_targets).to(wide.dtype)) * scale
    return loss_sum, grad.to(grad_dtype)


def _tile_gradients(grad_logits: Tensor, h_tile: Tensor, weight: Tensor, grad_hidden: Optional[Tensor],
                    grad_weight: Optional[Tensor]) -> None:
    """Writes the tile's hidden gradient and adds its weight gradient from ``grad_logits (n, V)``."""
    acc = grad_weight.dtype if grad_weight is not None else None
    if grad_hidden is not None:
        grad_hidden.copy_(grad_logits @ weight)  # (n, V) @ (V, hidden)
    if grad_weight is not None:
        if weight.dtype == acc:
            grad_weight.addmm_(grad_logits.T, h_tile)  # (V, n) @ (n, hidden)
        elif accumulates_in_place(grad_weight.device, weight.dtype, acc):
            # cuBLAS adds the low-precision product to the fp32 buffer in its epilogue: no rounded temporary, no
            # separate (mixed-dtype, unvectorised) add kernel per vocabulary slice
            torch.addmm(grad_weight, grad_logits.T, h_tile, acc, out=grad_weight)
        else:
            vocab_slice = max(1, WEIGHT_GRAD_SLICE_BYTES // (weight.shape[1] * weight.element_size()))
            for v0 in range(0, weight.shape[0], vocab_slice):
                v1 = v0 + vocab_slice
                grad_weight[v0:v1].add_(grad_logits[:, v0:v1].T @ h_tile)  # fp32 sum of low-precision products


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
