"""The reference Llama's geometry as a Hugging Face ``transformers.LlamaForCausalLM``, for the systems that train the
Hugging Face model (``alst``, ``fpdt-hf``). transformers is imported inside the functions: ``--help`` and the CPU
tests run without it."""

from __future__ import annotations

from typing import Any

from lightning_fpdt.flops import ModelGeometry
from lightning_fpdt.models.llama import NAMED_CONFIGS, LlamaConfig
from lightning_fpdt.models.module import CausalLM
from lightning_fpdt.planner.geometry import resolve_geometry

HF_GEOMETRIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-4b": ("qwen3", dict(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, rope_theta=1e6, tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "mixtral-8x7b": ("mixtral", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, rope_theta=1e6, sliding_window=None,
        rms_norm_eps=1e-5)),
    # Qwen2.5-0.5B: 14 query heads, which 4 GPUs split unevenly (4, 4, 3, 3 per rank); Qwen2 has q/k/v biases
    "qwen2.5-0.5b": ("qwen2", dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        head_dim=64, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
        use_sliding_window=False)),
    # the even-split reference of the same size at sequence-parallel size 4: 16 query heads of 56 (16 x 56 = 896: the
    # same q and o projections and attention FLOPs; k and v are 2 x 56 = 112 wide instead of 128, 0.7 M parameters
    # fewer of 494 M), 4 heads on each of 4 GPUs, so its step time beside qwen2.5-0.5b's at sp 4 prices the uneven
    # head split
    "qwen2.5-0.5b-16h": ("qwen2", dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=2,
        head_dim=56, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
        use_sliding_window=False)),
    # SmolLM2-360M: 15 query heads (and 5 kv heads), which 2 GPUs split unevenly (8 and 7 per rank, each with the kv
    # heads its query heads read)
    "smollm2-360m": ("llama", dict(
        hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
        head_dim=64, vocab_size=49152, rope_theta=1e5, rms_norm_eps=1e-5, tie_word_embeddings=True)),
    # its even-split reference of the same size at sequence-parallel size 2: 12 query heads of 80 and 4 kv heads (12 x
    # 80 = 960 and 4 x 80 = 5 x 64: the same projections and parameters), 6 heads a rank; the busiest rank of
    # smollm2-360m attends over 8 x 64 = 512 dimensions, this model's over 6 x 80 = 480
    "smollm2-360m-12h": ("llama", dict(
        hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=12, num_key_value_heads=4,
        head_dim=80, vocab_size=49152, rope_theta=1e5, rms_norm_eps=1e-5, tie_word_embeddings=True)),
    # Llama-3-8B with 4 kv heads: one kv head a rank on 4 GPUs, as Llama-3-8B's 8 have on 8 GPUs (the one-chunk path's
    # head pieces then share the kv head); k and v are half as wide: 134 M parameters fewer of 8.0 B
    "llama3-8b-4kv": ("llama", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
}
"""Named geometries of other Hugging Face families (``fpdt-hf`` only): ``name -> (model_type, config fields)``;
the family's config class comes from ``lightning_fpdt.integrations.families``."""
GEOMETRY_NAMES = sorted(NAMED_CONFIGS) + sorted(HF_GEOMETRIES)
"""Every ``--model`` name: the reference Llama's sizes (every system) and :data:`HF_GEOMETRIES` (``fpdt-hf``)."""


def hf_family_config(name: str, *, num_layers: int, max_seq_len: int) -> Any:
    """The family's transformers config of a geometry of :data:`HF_GEOMETRIES` with ``num_layers`` decoder layers,
    SDPA attention, no dropout, no KV cache."""
    import transformers

    from lightning_fpdt.integrations.families import FAMILIES

    model_type, fields = HF_GEOMETRIES[name]
    config_class = getattr(transformers, FAMILIES[model_type].config)
    return config_class(**{**fields, "num_hidden_layers": num_layers}, max_position_embeddings=max(max_seq_len, 8192),
                        attention_dropout=0.0, use_cache=False)


def named_depth(name: str) -> int:
    """The full depth of a ``--model`` geometry."""
    if name in HF_GEOMETRIES:
        return HF_GEOMETRIES[name][1]["num_hidden_layers"]
    return LlamaConfig.from_name(name).num_layers


def named_vocab(name: str) -> int:
    """The vocabulary of a ``--model`` geometry."""
    if name in HF_GEOMETRIES:
        return HF_GEOMETRIES[name][1]["vocab_size"]
    return LlamaConfig.from_name(name).vocab_size


def named_geometry(name: str) -> ModelGeometry:
    """The :class:`ModelGeometry` of a ``--model`` geometry at full depth (a mixture of experts with its experts:
    :meth:`ModelGeometry.from_config` reads them)."""
    if name not in HF_GEOMETRIES:
        return ModelGeometry.from_config(LlamaConfig.from_name(name))
    model_type, fields = HF_GEOMETRIES[name]
    return resolve_geometry(dict(model_type=model_type, **fields))  # with what the family's file adds


def hf_llama_config(name: str, *, num_layers: int, max_seq_len: int) -> Any:
    """``transformers.LlamaConfig`` of the named geometry (``lightning_fpdt.models.llama.NAMED_CONFIGS``) with
    ``num_layers`` decoder layers and SDPA attention. Fields the reference model does not have are those of
    Llama-3: no biases, no dropout, default RoPE (the reference Llama models no llama3 frequency scaling either).
    A geometry of :data:`HF_GEOMETRIES` is its own family's config (:func:`hf_family_config`)."""
    if name in HF_GEOMETRIES:
        return hf_family_config(name, num_layers=num_layers, max_seq_len=max_seq_len)
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
