"""Switching models to the FPDT attention and to the sequence-parallel loss.

Three kinds of model are covered:

- the reference Llama (``lightning_fpdt.models.llama``): its attention modules call ``self.attention_fn``, which is
  replaced; its ``loss`` method is wrapped;
- Hugging Face ``*ForCausalLM`` models: ``"fpdt"`` is registered in transformers' attention interface and the model
  switched to it; its ``loss_function`` is replaced;
- plain modules calling ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``: inside their transformer blocks
  a ``TorchFunctionMode`` routes that call to the FPDT attention.

What the FPDT attention cannot compute exactly (a mask, dropout, a sliding window, non-causal attention) raises a
``ValueError`` saying what to do instead, never a silently different result.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_fpdt.models.ops import tile_hf_rms_norms
from lightning_fpdt.sequence.fpdt import FPDTAttention, LayerAttention, check_exact_call
from lightning_fpdt.sequence.head_chunks import HeadGroupedAttention, install_head_groups
from lightning_fpdt.sequence.layout import IGNORE_INDEX

HF_ATTENTION_NAME = "fpdt"


# ---- the loss ---------------------------------------------------------------------------------------------------
def sequence_parallel_loss(
    local_mean: Tensor, num_valid_local: Union[Tensor, int], *, group: Optional[dist.ProcessGroup]
) -> Tensor:
    """The group's token-mean loss from each rank's mean over its own valid tokens.

    The value returned is the mean over all valid tokens of the sequence-parallel group (the same on every rank,
    what a single process would report). Its gradient is ``P · n_local / N_group`` times the local mean's: data
    parallelism (FSDP2, DDP) averages gradients over all ``dp · P`` ranks, and the average of these over the ``P``
    ranks of a group is exactly the gradient of the group's token mean. (Scaling here rather than setting FSDP2's
    divide factor keeps to plain averaging, which every backend has; gloo lacks the pre-multiplied sum.)
    A rank without valid tokens contributes zero, never NaN (its local mean is 0/0).
    """
    acc = torch.promote_types(local_mean.dtype, torch.float32)  # token counts in bf16 would round above 256
    n_local = torch.as_tensor(num_valid_local, device=local_mean.device, dtype=acc)
    local_sum = torch.where(n_local > 0, local_mean.to(acc) * n_local, torch.zeros((), dtype=acc, device=n_local.device))
    stats = torch.stack([local_sum.detach(), n_local.to(local_sum.dtype)])  # one collective for the sum and the count
    sp_size = 1
    if dist.is_available() and dist.is_initialized():
        sp_size = dist.get_world_size(group)
        if sp_size > 1:
            dist.all_reduce(stats, group=group)
    n_group = stats[1].clamp(min=1)
    contribution = local_sum * (sp_size / n_group.to(local_sum.dtype))
    # value: the group mean; gradient: P times this rank's share of it
    return contribution + (stats[0] / n_group - contribution.detach()).to(contribution.dtype)


def token_cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """``(mean over valid tokens, number of valid tokens)`` of fp32 cross-entropy; the mean is 0 without any."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)).flatten(0, -2)  # fp32 at least
    targets = targets.flatten().to(logits.device)
    total = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
    count = (targets != ignore_index).sum()
    return total / count.clamp(min=1), count


@dataclass
class SequenceParallelContext:
    """What the installed wrappers share with the strategy for the current batch (owned by the strategy)."""

    group: Optional[dist.ProcessGroup]
    attention: FPDTAttention
    position_ids: Optional[Tensor] = None
    """Global position ids of the local tokens of the current batch; injected when a model call omits them."""
    loss_reduced: bool = False
    """Set when an installed loss produced the group mean, so the strategy does not re-weight it again."""


def installed_attentions(model: nn.Module) -> list[Union[LayerAttention, HeadGroupedAttention]]:
    """The attention handles installed in ``model``: a module's ``attention_fn`` (the reference Llama, plain SDPA
    blocks) or ``_fpdt_attention`` (Hugging Face, head groups), one per attention layer."""
    handles = (getattr(module, name, None) for module in model.modules() for name in ("attention_fn", "_fpdt_attention"))
    return [h for h in handles if isinstance(h, (LayerAttention, HeadGroupedAttention))]


# ---- the reference Llama ----------------------------------------------------------------------------------------
def _is_reference_llama(model: nn.Module) -> bool:
    from lightning_fpdt.models.llama import LlamaForCausalLM

    return isinstance(model, LlamaForCausalLM)


def install_reference_llama(model: nn.Module, context: SequenceParallelContext) -> None:
    """Point every attention of a reference Llama at the FPDT attention; make its loss the group mean."""
    from lightning_fpdt.models.llama import LlamaAttention

    for module in model.modules():
        if isinstance(module, LlamaAttention):
            if context.attention.head_chunks > 1:
                install_head_groups(module, context.attention)  # projections and attention per head group
            else:
                module.attention_fn = context.attention.for_layer()
    model.labels_are_shifted = True  # the strategy shifts labels on the global sequence before sharding
    model.documents_from_positions = False  # the strategy finds packed documents on the global batch
    model.fpdt_reduce_loss = loss_reduction(context)
    # the local loss is looked up at call time, so a later transform (TiledLoss) can replace it
    model.fpdt_local_loss = model.loss

    def loss(hidden: Tensor, targets: Tensor) -> Tensor:
        return model.fpdt_reduce_loss(model.fpdt_local_loss(hidden, targets), (targets != IGNORE_INDEX).sum())

    model.loss = loss
    _inject_position_ids(model, context)


def loss_reduction(context: SequenceParallelContext) -> Callable[[Tensor, Union[Tensor, int]], Tensor]:
    """``fpdt_reduce_loss(local_mean, num_valid)``: what an installed model calls to turn its local token-mean loss
    into the sequence group's (set on the model as ``model.fpdt_reduce_loss``; loss replacements call it too)."""

    def reduce(local_mean: Tensor, num_valid: Union[Tensor, int]) -> Tensor:
        context.loss_reduced = True
        return sequence_parallel_loss(local_mean, num_valid, group=context.group)

    return reduce


# ---- Hugging Face transformers ------------------------------------------------------------------------------------
def _is_hf_model(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def _hf_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention-interface function: ``(B, H, S/P, D)`` in, ``(B, S/P, H, D)`` out."""
    attention: Optional[LayerAttention] = getattr(module, "_fpdt_attention", None)
    if attention is None:
        raise ValueError(
            f"{type(module).__name__} uses attn_implementation='fpdt' but was not prepared by the fpdt strategy; "
            f"train it with Trainer(strategy='fpdt')"
        )
    check_exact_call(attention_mask=attention_mask, dropout=dropout,
                     sliding_window=kwargs.get("sliding_window") or getattr(module, "sliding_window", None))
    if getattr(module, "is_causal", True) is False:
        raise ValueError(f"{type(module).__name__} is not causal; the fpdt attention is causal only")
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=True, scale=scaling)
    return out, None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    # causality is the attention's own; a user mask is refused in batch sharding and in _hf_attention
    return None


def register_hf_attention() -> None:
    """Register ``"fpdt"`` in transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(HF_ATTENTION_NAME, _hf_attention)
    AttentionMaskInterface.register(HF_ATTENTION_NAME, _no_mask)


def install_hf_model(model: nn.Module, context: SequenceParallelContext) -> None:
    """Switch a transformers model to ``attn_implementation="fpdt"`` and to the sequence-parallel loss."""
    register_hf_attention()
    config = model.config
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        raise ValueError(
            f"{type(model).__name__} is configured with sliding_window={config.sliding_window}; the fpdt attention "
            f"is full causal attention: set use_sliding_window=False"
        )
    model.set_attn_implementation(HF_ATTENTION_NAME)
    config.use_cache = False  # a KV cache of the local shard is useless in training and costs memory
    for module in model.modules():
        if hasattr(module, "is_causal") and hasattr(module, "config"):
            if context.attention.head_chunks > 1:
                install_head_groups(module, context.attention)  # projections and attention per head group
            else:
                module._fpdt_attention = context.attention.for_layer()

    def loss_function(logits: Tensor, labels: Optional[Tensor] = None, vocab_size: Optional[int] = None,
                      num_items_in_batch: Any = None, ignore_index: int = IGNORE_INDEX,
                      shift_labels: Optional[Tensor] = None, **kwargs: Any) -> Tensor:
        # under the strategy `labels` are already shifted on the global sequence (no local shift may happen here)
        targets = shift_labels if shift_labels is not None else labels
        return model.fpdt_reduce_loss(*token_cross_entropy(logits, targets, ignore_index))

    model.fpdt_reduce_loss = loss_reduction(context)
    model.loss_function = loss_function
    _inject_position_ids(model, context)
    # same values, but one fp32 per token kept for backward instead of an fp32 copy of the input (models/ops.py)
    tile_hf_rms_norms(model)


def _inject_position_ids(model: nn.Module, context: SequenceParallelContext) -> None:
    """A call without ``position_ids`` gets the global ones of the current batch (local ``arange`` would be wrong)."""

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("position_ids") is None and context.position_ids is not None:
            kwargs["position_ids"] = context.position_ids
        return args, kwargs

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)


# ---- plain modules calling F.scaled_dot_product_attention -------------------------------------------------------
class SDPAInterception(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` to the FPDT attention.

    The intercepted call receives ``(B, H, S/P, D)`` tensors of the local shard and returns the same layout.
    """

    def __init__(self, attention: Union[FPDTAttention, LayerAttention]) -> None:
        super().__init__()
        self.attention = attention

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        call = dict(zip(names, args), **kwargs)
        if call.get("attn_mask") is not None:
            raise ValueError(
                "scaled_dot_product_attention with attn_mask cannot be sequence-parallelized exactly: use "
                "is_causal=True without a mask (right-pad, and set padded labels to -100)"
            )
        if call.get("dropout_p", 0.0):
            raise ValueError("scaled_dot_product_attention with dropout_p > 0 is not supported under fpdt: use 0")
        if not call.get("is_causal", False):
            raise ValueError(
                "scaled_dot_product_attention(is_causal=False) is bidirectional; the fpdt attention is causal only: "
                "call it with is_causal=True"
            )
        q, k, v = (call[n].transpose(1, 2) for n in ("query", "key", "value"))  # (B, H, S/P, D) -> (B, S/P, H, D)
        return self.attention(q, k, v, causal=True, scale=call.get("scale")).transpose(1, 2)


def install_sdpa_interception(blocks: list[nn.Module], context: SequenceParallelContext) -> None:
    """Run each block's forward under :class:`SDPAInterception` (also when a checkpoint recomputes it)."""
    for block in blocks:
        forward = block.forward
        interception = SDPAInterception(context.attention.for_layer())

        @functools.wraps(forward)
        def intercepted(*args: Any, __forward: Callable = forward, __mode: SDPAInterception = interception,
                        **kwargs: Any) -> Any:
            with __mode:
                return __forward(*args, **kwargs)

        block.forward = intercepted
        block._fpdt_attention = interception.attention  # found by ActivationOffload (no attention recompute)


def install(model: nn.Module, blocks: list[nn.Module], context: SequenceParallelContext) -> str:
    """Install the FPDT attention and loss in ``model`` by its kind; returns the kind's name."""
    if _is_reference_llama(model):
        install_reference_llama(model, context)
        return "reference-llama"
    if _is_hf_model(model):
        install_hf_model(model, context)
        return "huggingface"
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no transformer blocks to run the SDPA interception in: give "
            f"layer_classes=[...] naming the block class"
        )
    if context.attention.head_chunks > 1:
        raise ValueError(
            f"head_chunks={context.attention.head_chunks} runs the q/k/v and output projections per head group, so it "
            f"needs an attention module the strategy knows (the reference Llama, Hugging Face Llama/Qwen2/Qwen3/"
            f"Mistral); {type(model).__name__} calls scaled_dot_product_attention itself: set head_chunks=1"
        )
    install_sdpa_interception(blocks, context)
    return "sdpa-interception"
