"""All model-specific code: the reference Llama, Hugging Face models, plain modules calling
``F.scaled_dot_product_attention``, head groups; every attribute set on a user module is in ``attributes.py``."""

from lightning_fpdt.integrations.context import (
    SequenceParallelContext,
    installed_attentions,
    loss_reduction,
    shared_attentions,
)
from lightning_fpdt.integrations.head_groups import HeadGroupedAttention, install_head_groups
from lightning_fpdt.integrations.huggingface import check_router_loss, install_hf_model, register_hf_attention
from lightning_fpdt.integrations.install import (
    apply_tiled_loss,
    attention_geometry,
    install,
    residual_mlps,
    supports_head_groups,
)
from lightning_fpdt.integrations.reference_llama import install_reference_llama
from lightning_fpdt.integrations.sdpa import SDPAInterception, install_sdpa_interception

__all__ = [
    "HeadGroupedAttention",
    "SDPAInterception",
    "SequenceParallelContext",
    "apply_tiled_loss",
    "attention_geometry",
    "check_router_loss",
    "install",
    "install_head_groups",
    "install_hf_model",
    "install_reference_llama",
    "install_sdpa_interception",
    "installed_attentions",
    "loss_reduction",
    "register_hf_attention",
    "residual_mlps",
    "shared_attentions",
    "supports_head_groups",
]
