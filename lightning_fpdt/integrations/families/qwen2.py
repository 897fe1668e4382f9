"""Qwen2 and Qwen2.5: Llama's layout with q/k/v biases; a sliding window when ``use_sliding_window`` is set."""

from lightning_fpdt.integrations.families.base import Family, sliding_window_check

FAMILY = Family(
    name="Qwen2 / Qwen2.5", model_type="qwen2", causal_lm="Qwen2ForCausalLM", config="Qwen2Config",
    attention="Qwen2Attention", decoder_layer="Qwen2DecoderLayer", norm="Qwen2RMSNorm", mlp_classes=("Qwen2MLP",),
    checks=(sliding_window_check("use_sliding_window", "set use_sliding_window=False"),),
)
