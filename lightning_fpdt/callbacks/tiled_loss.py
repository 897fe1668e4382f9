"""``TiledLoss``: the causal-LM loss without ever materialising the full logits (DESIGN.md §6).

The logits of a 128K vocabulary take 0.5 MB per token in fp32 (256 GiB at 512K tokens), more than any GPU. Here
the hidden states are projected and cross-entropied one token tile at a time (ALST, Liger's fused linear cross
entropy): each tile's logits are upcast to fp32, the loss and its gradient ``(softmax - onehot) / N_valid`` are taken
right away, the hidden-state gradient of the tile is written and the lm_head gradient accumulated (fp32), and the
tile's logits are dropped. Only the two gradients are kept; backward just scales them by the incoming gradient.

Three layers: :func:`tiled_cross_entropy_forward` holds the tile loop, :class:`TiledCrossEntropyFunction` only
handles ``ctx``, :func:`tiled_cross_entropy` is the public call (for models the callback does not cover).
:func:`apply_tiled_loss` switches a model in place; :class:`TiledLoss` is the Lightning callback that declares it.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor

from lightning_fpdt.callbacks.tiled_mlp import check_num_tiles, tile_bounds, transform_without_fpdt
from lightning_fpdt.sequence.layout import IGNORE_INDEX

AUTO_TILE_BYTES = 2**30
"""``num_tiles="auto"``: one tile's fp32 logits (``tokens × vocab × 4`` bytes) stay under this. Each tile reads and
writes the whole fp32 lm_head gradient once (2 GiB for Llama-3-8B): at 2,048 tokens a tile (a 128K vocabulary) that
is ~15% of the tile's matmul time on an H100/H200, at 256 MiB (512 tokens) it was ~55% (bench/peers.py
--profile-step at 64K, 4 GPUs)."""
WEIGHT_GRAD_SLICE_BYTES = 64 * 2**20
"""A low-precision lm_head gradient is accumulated into its fp32 buffer in vocabulary slices of at most this many
bytes (a whole ``(V, hidden)`` temporary would be 1 GiB for Llama-3 in bf16)."""
_TILED = "_fpdt_tiled_loss"


# ---- the tile loop --------------------------------------------------------------------------------------------------
def auto_loss_tiles(num_tokens: int, vocab_size: int) -> int:
    """Tiles such that one tile's fp32 logits (``tokens × vocab × 4`` bytes) stay under 256 MiB; at least 1."""
    return max(1, math.ceil(num_tokens * vocab_size * 4 / AUTO_TILE_BYTES))


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
        num_tiles: token tiles; ``"auto"``: enough that one tile's fp32 logits stay under 256 MiB.
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


# ---- switching models -----------------------------------------------------------------------------------------------
def _is_hf_causal_lm(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return (
        isinstance(model, PreTrainedModel)
        and model.get_output_embeddings() is not None
        and isinstance(getattr(model, model.base_model_prefix, None), nn.Module)
    )


def _tile_reference_llama(model: nn.Module, num_tiles: Union[Literal["auto"], int]) -> None:
    def local_loss(hidden: Tensor, targets: Tensor) -> Tensor:
        # output_weight: the embedding table when tied; under FSDP2 this runs inside the model's forward, where the
        # model's own (non-block) parameters are gathered
        return tiled_cross_entropy(hidden, model.output_weight, targets, num_tiles=num_tiles)[0]

    # under the strategy its installed loss reduces fpdt_local_loss (looked up at call time); alone, `loss` is it
    setattr(model, "fpdt_local_loss" if hasattr(model, "fpdt_local_loss") else "loss", local_loss)


def _tile_hf_causal_lm(model: nn.Module, num_tiles: Union[Literal["auto"], int]) -> None:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    name = type(model).__name__
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        raise ValueError(
            f"TiledLoss projects with the lm_head weight only; {name}'s lm_head has a bias: drop TiledLoss"
        )
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if softcap:
        raise ValueError(
            f"{name} soft-caps its logits (final_logit_softcapping={softcap}), which TiledLoss does not model: set it "
            f"to None in the config or drop TiledLoss"
        )
    base = getattr(model, model.base_model_prefix)
    original = model.forward
    names = list(inspect.signature(original).parameters)  # HF forwards take no *args: positions map to names

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        call = {**dict(zip(names, args)), **kwargs}
        labels, shift_labels = call.pop("labels", None), call.pop("shift_labels", None)
        if labels is None and shift_labels is None:
            return original(*args, **kwargs)  # logits wanted: the model's own forward
        call.pop("logits_to_keep", None)
        num_items = call.pop("num_items_in_batch", None)  # HF: the loss is the sum over the batch / this count
        outputs = base(**call)
        hidden = outputs[0]  # (B, S/P, hidden): last_hidden_state, also from a tuple output
        reduce = getattr(model, "fpdt_reduce_loss", None)  # set by the fpdt strategy
        if shift_labels is not None:
            targets = shift_labels
        elif reduce is not None:
            targets = labels  # the strategy shifted them on the global sequence before sharding
        else:
            targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]  # as Hugging Face shifts them
        weight = model.get_output_embeddings().weight  # read per call: FSDP2 swaps in the gathered parameter
        mean, num_valid = tiled_cross_entropy(hidden, weight, targets, num_tiles=num_tiles)
        if num_items is not None and reduce is not None:
            raise ValueError(
                "num_items_in_batch was passed to the model under the fpdt strategy, which averages the loss over "
                "the valid tokens of the sequence-parallel group itself: do not pass num_items_in_batch"
            )
        if num_items is not None:
            loss = mean * num_valid / num_items  # sum over this batch's valid tokens / the caller's count
        else:
            loss = reduce(mean, num_valid) if reduce is not None else mean
        return CausalLMOutputWithPast(
            loss=loss,
            logits=None,
            hidden_states=getattr(outputs, "hidden_states", None),
            attentions=getattr(outputs, "attentions", None),
        )

    model.forward = forward


def apply_tiled_loss(model: nn.Module, *, num_tiles: Union[Literal["auto"], int] = "auto") -> nn.Module:
    """Make ``model`` compute its loss with :func:`tiled_cross_entropy`; in place, idempotent.

    The reference Llama: its local loss (``fpdt_local_loss`` after the fpdt strategy's install, else ``loss``) is
    replaced. A Hugging Face ``*ForCausalLM``: ``forward`` with ``labels``/``shift_labels`` runs the base model and
    the tiled loss and returns ``CausalLMOutputWithPast(loss=..., logits=None)``; without labels it is unchanged.
    """
    from lightning_fpdt.models.llama import LlamaForCausalLM

    check_num_tiles(num_tiles, "TiledLoss")
    if getattr(model, _TILED, False):  # fit then validate must not wrap twice
        return model
    if isinstance(model, LlamaForCausalLM):
        _tile_reference_llama(model, num_tiles)
    elif _is_hf_causal_lm(model):
        _tile_hf_causal_lm(model, num_tiles)
    else:
        raise ValueError(
            f"TiledLoss covers the reference Llama and Hugging Face *ForCausalLM models, not {type(model).__name__}: "
            f"compute the loss with lightning_fpdt.callbacks.tiled_loss.tiled_cross_entropy(hidden, weight, targets) "
            f"in your model and drop the callback"
        )
    setattr(model, _TILED, True)
    return model


class TiledLoss(pl.Callback):
    """The model returns its loss without materialising the full logits: hidden states are projected and
    cross-entropied (fp32) tile by tile, the lm_head and hidden-state gradients accumulated on the way.

    Covers the reference Llama (tied embeddings included) and Hugging Face ``*ForCausalLM`` models, which then
    return ``logits=None`` when given labels; other models call :func:`tiled_cross_entropy` themselves. The loss and
    its gradients are the same function as the untiled loss, so the fpdt strategy's sequence-parallel reduction,
    gradient accumulation and loss scaling apply unchanged.

    With ``strategy="fpdt"`` the strategy applies this in its fixed order (after the attention swap and the tiled
    MLP, before activation checkpointing and FSDP2); the loss runs inside the model's forward, where FSDP2 has
    gathered the lm_head. With any other strategy it is applied in :meth:`setup` to the network in the
    LightningModule (which must then be built in ``__init__``, not ``configure_model``); it works on a single device
    and under DDP, where Hugging Face ``labels`` are shifted locally as Hugging Face does.

    Args:
        num_tiles: token tiles per loss call; ``"auto"``: from each call's input, enough that one tile's fp32 logits
            (tokens × vocabulary × 4 bytes) stay under 256 MiB.
    """

    fpdt_transform_order = 3
    """Tiled loss comes after the tiled MLP and before activation checkpointing (DESIGN.md §5)."""

    def __init__(self, num_tiles: Union[Literal["auto"], int] = "auto") -> None:
        super().__init__()
        check_num_tiles(num_tiles, "TiledLoss")
        self.num_tiles = num_tiles

    def fpdt_transform(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        apply_tiled_loss(model, num_tiles=self.num_tiles)

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        transform_without_fpdt(self, trainer, pl_module)
