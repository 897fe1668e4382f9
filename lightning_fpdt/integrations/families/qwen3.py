"""Qwen3: Llama's layout with RMSNorms over each head's q and k (``q_norm``/``k_norm``, run per head group too)."""

from lightning_fpdt.integrations.families.base import Family, sliding_window_check

FAMILY = Family(
    name="Qwen3", model_type="qwen3", causal_lm="Qwen3ForCausalLM", config="Qwen3Config",
    attention="Qwen3Attention", decoder_layer="Qwen3DecoderLayer", norm="Qwen3RMSNorm", head_norms=True,
    mlp_classes=("Qwen3MLP",),
    checks=(sliding_window_check("use_sliding_window", "set use_sliding_window=False"),),
)
