from lightning_fpdt.models.llama import (
    NAMED_CONFIGS,
    LlamaAttention,
    LlamaConfig,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    RMSNorm,
    apply_rotary,
    sdpa_attention,
)

__all__ = [
    "NAMED_CONFIGS",
    "LlamaAttention",
    "LlamaConfig",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaMLP",
    "LlamaModel",
    "RMSNorm",
    "apply_rotary",
    "sdpa_attention",
]
