"""Mixtral: Mistral's attention, a sparse mixture of experts in every block, the router's load-balancing loss under
``output_router_logits``; a sliding window whenever ``sliding_window`` is set."""

from lightning_fpdt.integrations.families.base import Family, Router, sliding_window_check

FAMILY = Family(
    name="Mixtral", model_type="mixtral", causal_lm="MixtralForCausalLM", config="MixtralConfig",
    attention="MixtralAttention", decoder_layer="MixtralDecoderLayer", norm="MixtralRMSNorm",
    mlp="sparse MoE: top-k of fused experts (gate_up_proj, down_proj) by a linear router",
    mlp_classes=("MixtralSparseMoeBlock",),
    router=Router(module="MixtralTopKRouter", num_experts="num_local_experts"),
    checks=(sliding_window_check(None, "set sliding_window=None"),),
)
