"""DeepSeek-V2/V3: multi-head latent attention (compressed keys and values, a decoupled rotary part), refused: the
fpdt attention shards ordinary query/key/value heads."""

_MLA = ("uses multi-head latent attention, whose compressed keys and values and decoupled rotary part the fpdt "
        "attention does not shard")
_ALTERNATIVE = "train it without the fpdt strategy (e.g. FSDP2), or use a grouped-query model (Llama, Qwen3, Mixtral)"
REFUSED = {"deepseek_v2": (_MLA, _ALTERNATIVE), "deepseek_v3": (_MLA, _ALTERNATIVE)}
"""``model_type: (reason, alternative)``."""
