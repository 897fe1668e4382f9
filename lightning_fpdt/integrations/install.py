"""Installing the FPDT attention and the sequence-parallel loss in a model, by its kind, and the model knowledge the
memory transforms and the strategy need (which loss to tile, which MLP values a recompute does not read, the
attention geometry of the installed layers)."""

from __future__ import annotations

from typing import Literal, Optional, Union

from torch import nn

from lightning_fpdt.flops import attention_heads, text_config
from lightning_fpdt.integrations.attributes import TILED_LOSS
from lightning_fpdt.integrations.context import SequenceParallelContext, installed_attentions
from lightning_fpdt.integrations.families import FAMILIES, check_model, family_of, is_attention, residual_mlp_blocks
from lightning_fpdt.integrations.head_groups import HeadGroupedAttention
from lightning_fpdt.integrations.huggingface import (
    install_hf_model,
    is_hf_causal_lm,
    is_hf_model,
    tile_hf_causal_lm_loss,
)
from lightning_fpdt.integrations.reference_llama import (
    install_reference_llama,
    is_reference_llama,
    tile_reference_llama_loss,
)
from lightning_fpdt.integrations.sdpa import install_sdpa_interception
from lightning_fpdt.memory.tiling import check_num_tiles
from lightning_fpdt.sequence.planning import AttentionGeometry, grouped_geometry

RESIDUAL_MLP_BLOCKS = ("LlamaDecoderLayer", *sorted(residual_mlp_blocks() - {"LlamaDecoderLayer"}))
"""Blocks whose ``mlp`` output only feeds the residual add that ends the block (the reference Llama's, and the
Hugging Face families' that say so, ``Family.mlp_feeds_residual``): in a checkpoint's recompute nothing reads that
value, so a tiled MLP there skips computing it and its backward recomputes the tiles as always: the MLP forward runs
twice per step, not three times."""
HEAD_GROUP_FAMILIES = ", ".join(f.name for f in FAMILIES.values() if f.separate_projections)
"""The Hugging Face families whose attention head groups can run (separate q/k/v/o projections)."""


def supports_head_groups(model: nn.Module) -> bool:
    """Whether head groups can run ``model``'s attention: the reference Llama, or a Hugging Face model whose attention
    modules all have separate ``q_proj``/``k_proj``/``v_proj``/``o_proj`` and a ``head_dim`` (the families of
    :data:`HEAD_GROUP_FAMILIES`, or a model of no known family laid out alike); what ``head_chunks="auto"`` may
    choose from."""
    if is_reference_llama(model):
        return True
    if not is_hf_model(model):
        return False
    family = family_of(model)
    if family is not None and not family.separate_projections:
        return False
    attentions = [m for m in model.modules() if is_attention(m, family)]
    return bool(attentions) and all(
        all(isinstance(getattr(m, name, None), nn.Linear) for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
        and isinstance(getattr(m, "head_dim", None), int) for m in attentions
    )


POOLING_HEADS = ("ForSequenceClassification", "ForQuestionAnswering")
"""Hugging Face heads that pick tokens of the whole sequence (the last non-pad token, a span's ends): under sequence
parallelism those tokens sit on one rank, and each rank would pick from its own shard."""


def check_family(model: nn.Module) -> None:
    """Before any model changes: ``ValueError`` for a Hugging Face model the fpdt attention cannot compute exactly
    (its family's refusals, ``families/``) or whose head pools over the sequence (:data:`POOLING_HEADS`)."""
    if not is_hf_model(model):
        return
    name = type(model).__name__
    if name.endswith(POOLING_HEADS):
        raise ValueError(
            f"{name} picks tokens of the whole sequence in its head (a classifier's last token, a span's ends), which "
            f"under sequence parallelism sit on one rank: hold the base model (AutoModel) instead, apply the head to "
            f"every token's hidden state, and pool with lightning_fpdt.sequence_sum(self, values, mask) (the mask "
            f"selecting the token to pool), which sums over the sequence group"
        )
    check_model(model)


def install(model: nn.Module, blocks: list[nn.Module], context: SequenceParallelContext) -> str:
    """Install the FPDT attention and loss in ``model`` by its kind; returns the kind's name."""
    if is_reference_llama(model):
        install_reference_llama(model, context)
        return "reference-llama"
    if is_hf_model(model):
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
            f"needs an attention module the strategy knows (the reference Llama, Hugging Face "
            f"{HEAD_GROUP_FAMILIES}); {type(model).__name__} calls scaled_dot_product_attention itself: set "
            f"head_chunks=1"
        )
    install_sdpa_interception(blocks, context.attention)
    return "sdpa-interception"


def can_tile_loss(model: nn.Module) -> bool:
    """Whether :func:`apply_tiled_loss` covers ``model``: the reference Llama or a Hugging Face ``*ForCausalLM``."""
    return is_reference_llama(model) or is_hf_causal_lm(model)


def apply_tiled_loss(model: nn.Module, *, num_tiles: Union[Literal["auto"], int] = "auto") -> nn.Module:
    """Make ``model`` compute its loss with ``tiled_cross_entropy``; in place, idempotent.

    The reference Llama: its local loss (``fpdt_local_loss`` after the fpdt strategy's install, else ``loss``) is
    replaced. A Hugging Face ``*ForCausalLM``: ``forward`` with ``labels``/``shift_labels`` runs the base model and
    the tiled loss and returns ``CausalLMOutputWithPast(loss=..., logits=None)``; without labels it is unchanged.
    """
    check_num_tiles(num_tiles, "TiledLoss")
    if getattr(model, TILED_LOSS, False):  # fit then validate must not wrap twice
        return model
    if is_reference_llama(model):
        tile_reference_llama_loss(model, num_tiles)
    elif is_hf_causal_lm(model):
        tile_hf_causal_lm_loss(model, num_tiles)
    else:
        raise ValueError(
            f"TiledLoss covers the reference Llama and Hugging Face *ForCausalLM models, not {type(model).__name__}: "
            f"compute the loss with lightning_fpdt.callbacks.tiled_loss.tiled_cross_entropy(hidden, weight, targets) "
            f"in your model and drop the callback"
        )
    setattr(model, TILED_LOSS, True)
    return model


def residual_mlps(blocks: list[nn.Module]) -> dict[nn.Module, nn.Module]:
    """``{block: block.mlp}`` for the blocks of :data:`RESIDUAL_MLP_BLOCKS` (see there)."""
    return {block: block.mlp for block in blocks
            if type(block).__name__ in RESIDUAL_MLP_BLOCKS and isinstance(getattr(block, "mlp", None), nn.Module)}


def attention_geometry(model: nn.Module, precision: str) -> Optional[AttentionGeometry]:
    """The attention sizes the "auto" options are planned with: heads from the model's config, the installed
    attention layers, their head groups; ``None`` when the model says too little."""
    heads = attention_heads(model)
    config = getattr(model, "config", None)
    if heads is None or config is None:
        return None
    config = text_config(config)  # a multimodal config keeps the language model's sizes in a sub-config
    hidden = getattr(config, "hidden_size", None)
    head_dim = getattr(config, "head_dim", None) or (hidden // heads[0] if hidden else None)
    handles = installed_attentions(model)
    head_chunks = max((h.layout.num_groups for h in handles if isinstance(h, HeadGroupedAttention)), default=1)
    if not head_dim or not handles:
        return None
    geometry = AttentionGeometry(num_layers=len(handles), num_heads=heads[0], num_kv_heads=heads[1],
                                 head_dim=int(head_dim), dtype_bytes=4 if precision == "32-true" else 2)
    return grouped_geometry(geometry, head_chunks)  # what chunks/offload "auto" size: one group's attention calls
