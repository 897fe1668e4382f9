"""Phi-3: one fused ``qkv_proj`` (so no head groups: they slice separate projections) and a fused ``gate_up_proj``
MLP; partial rotary embedding through its own ``apply_rotary_pos_emb``; a sliding window whenever set."""

from lightning_fpdt.integrations.families.base import Family, sliding_window_check

FAMILY = Family(
    name="Phi-3", model_type="phi3", causal_lm="Phi3ForCausalLM", config="Phi3Config",
    attention="Phi3Attention", decoder_layer="Phi3DecoderLayer", norm="Phi3RMSNorm", separate_projections=False,
    mlp="fused gate-up: down(up · act(gate)), gate and up halves of gate_up_proj", mlp_classes=("Phi3MLP",),
    checks=(sliding_window_check(None, "set sliding_window=None"),),
)
