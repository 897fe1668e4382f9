"""Llama (1-3): separate q/k/v/o projections with GQA, RMSNorm, RoPE, a gated MLP; nothing to refuse."""

from lightning_fpdt.integrations.families.base import Family

FAMILY = Family(
    name="Llama", model_type="llama", causal_lm="LlamaForCausalLM", config="LlamaConfig",
    attention="LlamaAttention", decoder_layer="LlamaDecoderLayer", norm="LlamaRMSNorm", mlp_classes=("LlamaMLP",),
)
