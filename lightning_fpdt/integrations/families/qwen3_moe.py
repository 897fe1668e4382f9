"""Qwen3-MoE: Qwen3's attention (q/k norms), a sparse mixture of experts in every block (dense ``Qwen3MoeMLP`` in
``mlp_only_layers``), and the router's load-balancing loss under ``output_router_logits``."""

from lightning_fpdt.integrations.families.base import Family, Router, sliding_window_check

FAMILY = Family(
    name="Qwen3-MoE", model_type="qwen3_moe", causal_lm="Qwen3MoeForCausalLM", config="Qwen3MoeConfig",
    attention="Qwen3MoeAttention", decoder_layer="Qwen3MoeDecoderLayer", norm="Qwen3MoeRMSNorm", head_norms=True,
    mlp="sparse MoE: top-k of fused experts (gate_up_proj, down_proj) by a linear router",
    mlp_classes=("Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP"),
    router=Router(module="Qwen3MoeTopKRouter", num_experts="num_experts", expert_width="moe_intermediate_size"),
    checks=(sliding_window_check("use_sliding_window", "set use_sliding_window=False"),),
)
