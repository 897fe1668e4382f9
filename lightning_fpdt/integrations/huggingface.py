"""Hugging Face ``*ForCausalLM`` models under the fpdt strategy.

``"fpdt"`` is registered in transformers' attention and mask interfaces and the model switched to it; its
``loss_function`` becomes the sequence group's token mean of pre-shifted labels; its RMSNorms run over token tiles
(the same values, one fp32 per token kept for backward instead of an fp32 copy of the input). Under TiledLoss its
``forward`` with labels runs the base model and the tiled cross-entropy. A mixture of experts' load-balancing loss
is taken over the sequence group. What each family is and cannot do is in ``families/`` (one file each); what the
attention cannot compute exactly (a mask, dropout, a sliding window, soft-capping, non-causal attention) raises a
``ValueError`` saying what to do instead.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any, Literal, Optional, Union

import torch
from torch import Tensor, nn

from lightning_fpdt.flops import text_config
from lightning_fpdt.fused.ops import rms_norm, swiglu
from lightning_fpdt.integrations.attributes import (
    ATTENTION_HANDLE,
    FUSED_MLP,
    LOSS_FUNCTION,
    REDUCE_LOSS,
    ROUTER_LOSS,
    TILED_NORM,
)
from lightning_fpdt.integrations.context import SequenceParallelContext, inject_position_ids, loss_reduction
from lightning_fpdt.integrations.families import (
    Family,
    check_model,
    family_of,
    is_attention,
    mlp_classes,
    tiled_norm_classes,
)
from lightning_fpdt.integrations.families.router_loss import load_balancing_loss
from lightning_fpdt.integrations.head_groups import install_head_groups
from lightning_fpdt.integrations.head_loss import give_head_the_loss
from lightning_fpdt.memory.forwards import replace_forward
from lightning_fpdt.memory.surgery import is_gated_mlp
from lightning_fpdt.memory.tiled_loss import tiled_cross_entropy
from lightning_fpdt.sequence.attention import LayerAttention
from lightning_fpdt.sequence.blocks import check_exact_call
from lightning_fpdt.sequence.loss import IGNORE_INDEX, shift_labels, token_cross_entropy

ATTENTION_NAME = "fpdt"
"""The name of the fpdt attention in transformers' attention interface (``attn_implementation="fpdt"``)."""


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


def train_mode_for_fit(model: nn.Module) -> bool:
    """Put a Hugging Face model whose own module is in eval mode (``from_pretrained`` returns it so, and a
    ``PeftModel`` keeps it so inside) in training mode for ``fit``, as transformers' own ``Trainer`` does; returns
    whether it did. Lightning keeps each module's mode as given, so the model would otherwise train with its dropout
    off and Lightning would warn about every one of its modules."""
    if not is_hf_model(model) or model.training:
        return False
    model.train()
    return True


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
    family = check_model(model)  # before anything changes: a refused family leaves the model as it was
    register_hf_attention()
    config = model.config
    model.set_attn_implementation(ATTENTION_NAME)
    config.use_cache = False  # a KV cache of the local shard is useless in training and costs memory
    for module in model.modules():
        if is_attention(module, family):
            if context.attention.head_chunks > 1:
                # projections and attention per head group, with the family's own RoPE
                install_head_groups(module, context.attention, rope=family_rope(family, module))
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
    fuse_hf_gated_mlps(model)
    if family is not None and family.router is not None:
        install_router_loss(model, family, context)


def family_rope(family: Optional[Family], module: nn.Module) -> Optional[Any]:
    """The family's RoPE for head groups; ``None`` (the module file's own) for a model of no known family."""
    return family.rope(module) if family is not None else None


# ---- a mixture of experts' load-balancing loss ----------------------------------------------------------------------
def check_router_loss(model: nn.Module, *, forward_without_grad: Sequence[str]) -> None:
    """At setup: a model that adds its routers' load-balancing loss (``output_router_logits``) cannot be trained with
    transforms that run the experts' first forward without gradients (``forward_without_grad``: the callbacks that
    do), since its routers would then get no gradient from that loss. ``ValueError`` naming both ways out."""
    family = family_of(model) if is_hf_model(model) else None
    if family is None or family.router is None or not forward_without_grad:
        return
    if not getattr(text_config(model.config), "output_router_logits", False):
        return
    raise ValueError(
        f"{type(model).__name__} adds its routers' load-balancing loss (output_router_logits=True), and "
        f"{' and '.join(forward_without_grad)} run the experts' first forward without gradients, so that loss "
        f"would train no router: set output_router_logits=False in the model's config, or train without "
        f"{' and '.join(forward_without_grad)}"
    )


def router_loss(model: nn.Module, family: Family, context: Optional[SequenceParallelContext]) -> Any:
    """``loss(router_logits)``: the family's load-balancing loss, over the sequence group under the strategy
    (``context``), else of the local tokens as Hugging Face computes it."""
    config = text_config(model.config)
    num_experts, top_k = getattr(config, family.router.num_experts), getattr(config, family.router.top_k)
    name = type(model).__name__

    def loss(router_logits: Any) -> Tensor:
        logits = list(router_logits)
        if model.training and torch.is_grad_enabled() and not all(t.requires_grad for t in logits):
            raise ValueError(
                f"{name}'s router logits were recorded without gradients (ActivationOffload and TiledMLP run the "
                f"experts' first forward under no_grad), so its load-balancing loss would train no router: set "
                f"output_router_logits=False, or drop ActivationOffload and TiledMLP"
            )
        if context is None:
            return load_balancing_loss(logits, num_experts, top_k)
        return load_balancing_loss(logits, num_experts, top_k, reduce=True, group=context.group,
                                   token_mask=context.token_mask)

    return loss


def install_router_loss(model: nn.Module, family: Family, context: SequenceParallelContext) -> None:
    """The model's load-balancing loss (under ``output_router_logits``) becomes the sequence group's: its ``forward``
    swaps the local one it added for the group's."""
    setattr(model, ROUTER_LOSS, router_loss(model, family, context))
    coefficient = getattr(text_config(model.config), family.router.coefficient)
    original = model.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        outputs = original(*args, **kwargs)
        local, logits = getattr(outputs, "aux_loss", None), getattr(outputs, "router_logits", None)
        if not isinstance(local, Tensor) or not logits:
            return outputs  # no router logits asked for, a tuple output, or TiledLoss's forward (its own)
        exact = getattr(model, ROUTER_LOSS)(logits)
        if outputs.loss is not None:
            outputs.loss = outputs.loss + coefficient * (exact - local)  # the model added coefficient · local
        outputs.aux_loss = exact
        return outputs

    replace_forward(model, forward)


# ---- RMSNorm over token tiles ---------------------------------------------------------------------------------------
def tile_hf_rms_norms(model: nn.Module) -> int:
    """Give the model's RMSNorms that compute Llama's formula (the families' ``norm`` where ``tiles_norm``) the tiled
    forward (the same values: fp32 math as theirs); returns how many. Their own forward keeps an fp32 copy of the
    input for backward."""
    count = 0
    norms = tiled_norm_classes()
    for module in model.modules():
        if type(module).__name__ in norms and not getattr(module, TILED_NORM, False):
            def forward(hidden_states: Tensor, _norm: nn.Module = module, _own=module.forward) -> Tensor:
                if hidden_states.dtype == torch.float64:
                    # fp64 runs are references (tests): HF's own arithmetic, to the last bit of its fp32 backward
                    return _own(hidden_states)
                return rms_norm(hidden_states, _norm.weight, _norm.variance_epsilon, torch.float32)

            replace_forward(module, forward)
            setattr(module, TILED_NORM, True)
            count += 1
    return count


# ---- the gated MLP's product ----------------------------------------------------------------------------------------
SILU_ACTIVATIONS = ("SiLU", "SiLUActivation")
"""Class names of the SiLU activation modules (torch's; transformers' ``ACT2FN["silu"]``)."""


def fuse_hf_gated_mlps(model: nn.Module) -> int:
    """Give the SiLU-gated MLPs of the model's family (``down(act(gate(x)) · up(x))``) a forward that computes the
    product with ``lightning_fpdt.fused.ops.swiglu`` (one fused kernel per pass on a GPU, the same formula);
    returns how many."""
    classes = set(mlp_classes(model) or ())
    count = 0
    for module in model.modules():
        if (type(module).__name__ in classes and is_gated_mlp(module) and not getattr(module, FUSED_MLP, False)
                and type(getattr(module, "act_fn", None)).__name__ in SILU_ACTIVATIONS):
            def forward(x: Tensor, _mlp: nn.Module = module) -> Tensor:
                return _mlp.down_proj(swiglu(_mlp.gate_proj(x), _mlp.up_proj(x)))

            replace_forward(module, forward)
            setattr(module, FUSED_MLP, True)
            count += 1
    return count


# ---- the tiled loss -----------------------------------------------------------------------------------------------
def tile_hf_causal_lm_loss(model: nn.Module, num_tiles: Union[Literal["auto"], int]) -> None:
    """``forward`` with ``labels``/``shift_labels`` runs the base model and ``tiled_cross_entropy`` and returns
    ``CausalLMOutputWithPast(loss=..., logits=None)``; without labels it is the model's own."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

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
    family = family_of(model)
    router = family.router if family is not None else None

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        call = {**dict(zip(names, args)), **kwargs}
        labels, given_targets = call.pop("labels", None), call.pop("shift_labels", None)
        if labels is None and given_targets is None:
            return original(*args, **kwargs)  # logits wanted: the model's own forward
        call.pop("logits_to_keep", None)
        num_items = call.pop("num_items_in_batch", None)  # HF: the loss is the sum over the batch / this count
        if router is not None and call.get("output_router_logits") is None:
            call["output_router_logits"] = getattr(text_config(model.config), "output_router_logits", False)
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
        router_logits = getattr(outputs, "router_logits", None) if router is not None else None
        if router_logits:  # the load-balancing loss the model's own forward adds (the group's under the strategy)
            aux = (getattr(model, ROUTER_LOSS, None) or router_loss(model, family, None))(router_logits)
            loss = loss + getattr(text_config(model.config), router.coefficient) * aux
            return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux, logits=None, router_logits=router_logits,
                                             hidden_states=getattr(outputs, "hidden_states", None),
                                             attentions=getattr(outputs, "attentions", None))
        return CausalLMOutputWithPast(
            loss=loss,
            logits=None,
            hidden_states=getattr(outputs, "hidden_states", None),
            attentions=getattr(outputs, "attentions", None),
        )

    replace_forward(model, forward)
