"""The Hugging Face model families the fpdt strategy knows, one file each, in one registry keyed by
``config.model_type``.

Adding a family is one file (a :class:`~lightning_fpdt.integrations.families.base.Family`, ``FAMILY``) and one row in
:data:`FAMILIES`. A ``model_type`` that is neither here nor in :data:`REFUSED` runs the generic way (what worked before
families were named): the fpdt attention through transformers' attention interface in every module with
``is_causal`` and a ``config``, head groups where the projections are separate, the common refusals of
:func:`~lightning_fpdt.integrations.families.base.check_config`, and no norm tiling or MLP knowledge.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from lightning_fpdt.flops import text_config
from lightning_fpdt.integrations.families import (
    deepseek,
    gemma,
    llama,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
)
from lightning_fpdt.integrations.families.base import Family, Router, check_config

FAMILIES: dict[str, Family] = {family.model_type: family for family in (
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    qwen3_moe.FAMILY,
    mistral.FAMILY,
    mixtral.FAMILY,
    phi3.FAMILY,
    gemma.FAMILY,
)}
"""``model_type -> Family``: every family the strategy knows."""
REFUSED: dict[str, tuple[str, str]] = {**gemma.REFUSED, **deepseek.REFUSED}
"""``model_type -> (reason, alternative)``: families the fpdt attention cannot run exactly."""


def family_of(model: nn.Module) -> Optional[Family]:
    """The family of a transformers model (its text config's ``model_type``), ``None`` for one not in the registry."""
    config = getattr(model, "config", None)
    return family_of_config(config) if config is not None else None


def family_of_config(config: Any) -> Optional[Family]:
    """The family of a Hugging Face config (or a namespace of one) by its text config's ``model_type``; ``None`` for
    one not in the registry."""
    return FAMILIES.get(getattr(text_config(config), "model_type", None))


def family_geometry(config: Any) -> dict[str, Any]:
    """What the family of ``config`` (a Hugging Face config or a namespace of one; its text config's ``model_type``)
    says of its geometry, as :class:`~lightning_fpdt.flops.ModelGeometry` fields: ``head_norms`` (each head's q and k
    normalised) and, for a mixture of experts, ``num_experts``, ``experts_per_token`` and the experts' width, read
    from the config fields its router names. Empty for a family not known."""
    text, family = text_config(config), family_of_config(config)
    if family is None:
        return {}
    fields: dict[str, Any] = {"head_norms": family.head_norms}
    router = family.router
    experts = getattr(text, router.num_experts, None) if router is not None else None
    if isinstance(experts, int) and experts > 1:
        fields.update(num_experts=experts, experts_per_token=getattr(text, router.top_k, None) or 1)
        width = getattr(text, router.expert_width, None) if router.expert_width else None
        if width:
            fields["intermediate_size"] = width
    return fields


def check_model(model: nn.Module) -> Optional[Family]:
    """``ValueError`` for a family or a setting the fpdt attention cannot compute exactly; returns the family."""
    name = type(model).__name__
    config = text_config(model.config)
    model_type = getattr(config, "model_type", None)
    if model_type in REFUSED:
        reason, alternative = REFUSED[model_type]
        raise ValueError(f"{name} ({model_type}) {reason}: {alternative}")
    family = FAMILIES.get(model_type)
    if family is None:
        check_config(config, name)
    else:
        family.check(config, name)
    return family


def is_attention(module: nn.Module, family: Optional[Family]) -> bool:
    """An attention module of the family (by class), or of an unknown family (``is_causal`` and a ``config``)."""
    if family is not None:
        return type(module).__name__ == family.attention
    return hasattr(module, "is_causal") and hasattr(module, "config")


def tiled_norm_classes() -> frozenset[str]:
    """The RMSNorm classes that compute Llama's formula (:data:`~.base.LLAMA_NORM`): the tiled norm's."""
    return frozenset(f.norm for f in FAMILIES.values() if f.tiles_norm)


def residual_mlp_blocks() -> frozenset[str]:
    """The block classes whose ``mlp`` output only feeds the residual add that ends the block."""
    return frozenset(f.decoder_layer for f in FAMILIES.values() if f.mlp_feeds_residual)


def mlp_classes(root: nn.Module) -> Optional[list[str]]:
    """The MLP classes of the family of the first model of a known family in ``root`` (what TiledMLP tiles there),
    ``None`` where there is none (TiledMLP then detects gated and Linear-act-Linear MLPs)."""
    for module in root.modules():
        family = family_of(module)
        if family is not None and family.mlp_classes:
            return list(family.mlp_classes)
    return None


__all__ = ["FAMILIES", "REFUSED", "Family", "Router", "check_model", "family_of", "is_attention", "mlp_classes",
           "residual_mlp_blocks", "tiled_norm_classes"]
