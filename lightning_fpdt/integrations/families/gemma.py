"""Gemma (1): Llama's layout (multi-query in the 2B model), embeddings scaled by sqrt(hidden), and an RMSNorm that
scales by ``1 + weight`` in fp32 before casting, which keeps its own forward (the tiled norm computes Llama's formula).

Gemma-2 and Gemma-3 are refused: they alternate sliding-window layers and soft-cap their attention logits (Gemma-2),
neither of which the fpdt attention computes."""

from lightning_fpdt.integrations.families.base import Family

FAMILY = Family(
    name="Gemma", model_type="gemma", causal_lm="GemmaForCausalLM", config="GemmaConfig",
    attention="GemmaAttention", decoder_layer="GemmaDecoderLayer", norm="GemmaRMSNorm",
    norm_formula="((x / sqrt(mean(x²) + eps)) · (1 + weight)) in fp32, cast to x's dtype after the weight",
    mlp_classes=("GemmaMLP",),
)

_GEMMA_LATER = ("alternates sliding-window and global attention layers and soft-caps its attention logits, which the "
                "fpdt attention (full causal attention, exact softmax) does not compute")
REFUSED = {
    "gemma2": (_GEMMA_LATER, "train it without the fpdt strategy (e.g. FSDP2), or use Gemma (1)"),
    "gemma3": (_GEMMA_LATER, "train it without the fpdt strategy (e.g. FSDP2), or use Gemma (1)"),
    "gemma3_text": (_GEMMA_LATER, "train it without the fpdt strategy (e.g. FSDP2), or use Gemma (1)"),
}
"""``model_type: (reason, alternative)`` of the family's later generations."""
