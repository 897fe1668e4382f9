"""Mistral: Llama's layout; its sliding window is on whenever ``sliding_window`` is set (4096 by default)."""

from lightning_fpdt.integrations.families.base import Family, sliding_window_check

FAMILY = Family(
    name="Mistral", model_type="mistral", causal_lm="MistralForCausalLM", config="MistralConfig",
    attention="MistralAttention", decoder_layer="MistralDecoderLayer", norm="MistralRMSNorm",
    mlp_classes=("MistralMLP",),
    checks=(sliding_window_check(None, "set sliding_window=None"),),
)
