"""Hugging Face ``*ForCausalLM`` models under the fpdt strategy.

``"fpdt"`` is registered in transformers' attention and mask interfaces and the model switched to it; its
``loss_function`` becomes the sequence group's token mean of pre-shifted labels; its RMSNorms run over token tiles
(the same values, one fp32 per token kept for backward instead of an fp32 copy of the input). Under TiledLoss its
``forward`` with labels runs the base model and the tiled cross-entropy. What the attention cannot compute exactly
(a mask, dropout, a sliding window, non-causal attention) raises a ``ValueError`` saying what to do instead.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Literal, Optional, Union

import torch
from torch import Tensor, nn

from lightning_fpdt.integrations.attributes import (
    ATTENTION_HANDLE,
    FORWARD,
    LOSS_FUNCTION,
    REDUCE_LOSS,
    TILED_NORM,
)
from lightning_fpdt.integrations.context import SequenceParallelContext, inject_position_ids, loss_reduction
from lightning_fpdt.integrations.head_groups import install_head_groups
from lightning_fpdt.integrations.head_loss import give_head_the_loss
from lightning_fpdt.memory.tiled_loss import tiled_cross_entropy
from lightning_fpdt.models.ops import rms_norm
from lightning_fpdt.sequence.attention import LayerAttention
from lightning_fpdt.sequence.blocks import check_exact_call
from lightning_fpdt.sequence.loss import IGNORE_INDEX, shift_labels, token_cross_entropy

ATTENTION_NAME = "fpdt"
"""The name of the fpdt attention in transformers' attention interface (``attn_implementation="fpdt"``)."""
RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
"""Norm classes whose forward is ``weight * (x.float() * rsqrt(mean(x²) + eps)).to(x.dtype)``."""


def is_hf_model(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def is_hf_causal_lm(model: nn.Module) -> bool:
    """A transformers model with an output embedding and a base model under ``base_model_prefix``."""
    return (
        is_hf_model(model)
        and model.get_output_embeddings() is not None
        and isinstance(getattr(model, model.base_model_prefix, None), nn.Module)
    )


# ---- attention ----------------------------------------------------------------------------------------------------
def hf_attention(
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
    attention: Optional[LayerAttention] = getattr(module, ATTENTION_HANDLE, None)
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
    # causality is the attention's own; a user mask is refused in batch sharding and in hf_attention
    return None


def register_hf_attention() -> None:
    """Register ``"fpdt"`` in transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, hf_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


def install_hf_model(model: nn.Module, context: SequenceParallelContext) -> None:
    """Switch a transformers model to ``attn_implementation="fpdt"`` and to the sequence-parallel loss."""
    register_hf_attention()
    config = model.config
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        raise ValueError(
            f"{type(model).__name__} is configured with sliding_window={config.sliding_window}; the fpdt attention "
            f"is full causal attention: set use_sliding_window=False"
        )
    model.set_attn_implementation(ATTENTION_NAME)
    config.use_cache = False  # a KV cache of the local shard is useless in training and costs memory
    for module in model.modules():
        if hasattr(module, "is_causal") and hasattr(module, "config"):
            if context.attention.head_chunks > 1:
                install_head_groups(module, context.attention)  # projections and attention per head group
            else:
                setattr(module, ATTENTION_HANDLE, context.attention.for_layer())

    def loss_function(logits: Tensor, labels: Optional[Tensor] = None, vocab_size: Optional[int] = None,
                      num_items_in_batch: Any = None, ignore_index: int = IGNORE_INDEX,
                      shift_labels: Optional[Tensor] = None, **kwargs: Any) -> Tensor:
        # under the strategy `labels` are already shifted on the global sequence (no local shift may happen here)
        targets = shift_labels if shift_labels is not None else labels
        return getattr(model, REDUCE_LOSS)(*token_cross_entropy(logits, targets, ignore_index))

    setattr(model, REDUCE_LOSS, loss_reduction(context))
    setattr(model, LOSS_FUNCTION, loss_function)
    inject_position_ids(model, context)
    tile_hf_rms_norms(model)


# ---- RMSNorm over token tiles ---------------------------------------------------------------------------------------
def tile_hf_rms_norms(model: nn.Module) -> int:
    """Give the model's RMSNorms of :data:`RMS_NORMS` the tiled forward (the same values: fp32 math as theirs);
    returns how many. Their own forward keeps an fp32 copy of the input for backward."""
    count = 0
    for module in model.modules():
        if type(module).__name__ in RMS_NORMS and not getattr(module, TILED_NORM, False):
            def forward(hidden_states: Tensor, _norm: nn.Module = module, _own=module.forward) -> Tensor:
                if hidden_states.dtype == torch.float64:
                    # fp64 runs are references (tests): HF's own arithmetic, to the last bit of its fp32 backward
                    return _own(hidden_states)
                return rms_norm(hidden_states, _norm.weight, _norm.variance_epsilon, torch.float32)

            setattr(module, FORWARD, forward)
            setattr(module, TILED_NORM, True)
            count += 1
    return count


# ---- the tiled loss -----------------------------------------------------------------------------------------------
def tile_hf_causal_lm_loss(model: nn.Module, num_tiles: Union[Literal["auto"], int]) -> None:
    """``forward`` with ``labels``/``shift_labels`` runs the base model and ``tiled_cross_entropy`` and returns
    ``CausalLMOutputWithPast(loss=..., logits=None)``; without labels it is the model's own."""
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
    head = model.get_output_embeddings()
    tied = getattr(model.config, "tie_word_embeddings", False) or head.weight is model.get_input_embeddings().weight
    head_has_loss = not tied and give_head_the_loss(head, num_tiles)
    base = getattr(model, model.base_model_prefix)
    original = model.forward
    names = list(inspect.signature(original).parameters)  # HF forwards take no *args: positions map to names

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        call = {**dict(zip(names, args)), **kwargs}
        labels, given_targets = call.pop("labels", None), call.pop("shift_labels", None)
        if labels is None and given_targets is None:
            return original(*args, **kwargs)  # logits wanted: the model's own forward
        call.pop("logits_to_keep", None)
        num_items = call.pop("num_items_in_batch", None)  # HF: the loss is the sum over the batch / this count
        outputs = base(**call)
        hidden = outputs[0]  # (B, S/P, hidden): last_hidden_state, also from a tuple output
        reduce = getattr(model, REDUCE_LOSS, None)  # set by the fpdt strategy
        if given_targets is not None:
            targets = given_targets
        elif reduce is not None:
            targets = labels  # the strategy shifted them on the global sequence before sharding
        else:
            targets = shift_labels(labels, dim=-1)  # as Hugging Face shifts them
        if head_has_loss:
            mean, num_valid = head(hidden, targets)  # FSDP2 gathers the head for its forward
        else:
            weight = head.weight  # read per call: FSDP2 swaps in the gathered parameter
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

    setattr(model, FORWARD, forward)
