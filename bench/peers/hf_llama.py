"""The reference Llama's geometry as a Hugging Face ``transformers.LlamaForCausalLM``, for the systems that train the
Hugging Face model (``alst``, ``fpdt-hf``). transformers is imported inside the functions: ``--help`` and the CPU
tests run without it."""

from __future__ import annotations

from typing import Any

from lightning_fpdt.models.llama import LlamaConfig
from lightning_fpdt.models.module import CausalLM


def hf_llama_config(name: str, *, num_layers: int, max_seq_len: int) -> Any:
    """``transformers.LlamaConfig`` of the named geometry (``lightning_fpdt.models.llama.NAMED_CONFIGS``) with
    ``num_layers`` decoder layers and SDPA attention. Fields the reference model does not have are those of
    Llama-3: no biases, no dropout, default RoPE (the reference Llama models no llama3 frequency scaling either)."""
    from transformers import LlamaConfig as HFLlamaConfig

    ours = LlamaConfig.from_name(name, num_layers=num_layers)
    config = HFLlamaConfig(
        vocab_size=ours.vocab_size, hidden_size=ours.hidden_size, intermediate_size=ours.intermediate_size,
        num_hidden_layers=ours.num_layers, num_attention_heads=ours.num_heads, num_key_value_heads=ours.num_kv_heads,
        head_dim=ours.head_dim, rope_theta=ours.rope_theta, rms_norm_eps=ours.rms_norm_eps,
        tie_word_embeddings=ours.tie_word_embeddings, initializer_range=ours.initializer_range,
        max_position_embeddings=max(max_seq_len, 8192), attention_bias=False, mlp_bias=False, attention_dropout=0.0,
        use_cache=False,
    )
    return config


def build_hf_llama(name: str, *, num_layers: int, max_seq_len: int, seed: int, dtype: Any = None) -> Any:
    """``transformers.LlamaForCausalLM`` of :func:`hf_llama_config`, SDPA attention, initialised by transformers'
    own init from ``seed`` (the global RNG is left alone). Under an active ``HfDeepSpeedConfig`` of ZeRO stage 3
    transformers builds it inside ``deepspeed.zero.Init``, each rank holding only its partition."""
    import torch
    from transformers import AutoModelForCausalLM

    config = hf_llama_config(name, num_layers=num_layers, max_seq_len=max_seq_len)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32, attn_implementation="sdpa")



class HFLlamaLM(CausalLM):
    """``fpdt-hf``'s LightningModule: :class:`lightning_fpdt.models.module.CausalLM` (AdamW, the model's own loss,
    which the fpdt strategy switches to the sequence group's token mean) holding :func:`build_hf_llama`'s model, as
    a user trains a Hugging Face model with ``strategy="fpdt"``."""

    def __init__(self, name: str, *, num_layers: int, max_seq_len: int, seed: int, lr: float) -> None:
        super().__init__(lr=lr)
        self.model = build_hf_llama(name, num_layers=num_layers, max_seq_len=max_seq_len, seed=seed)
