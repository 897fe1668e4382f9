"""The model geometry a plan is made for: read from a name, a config or a config file, and counted in parameters."""

from __future__ import annotations

import dataclasses
import json
import os
from types import SimpleNamespace
from typing import Any, Optional

from lightning_fpdt.flops import ModelGeometry
from lightning_fpdt.integrations.families import family_geometry
from lightning_fpdt.models.llama import NAMED_CONFIGS, LlamaConfig
from lightning_fpdt.sequence.planning import AttentionGeometry

PRECISIONS: dict[str, dict[str, int]] = {
    # bytes of: the sharded master weights, the gathered compute weights, the sharded gradients, the reduce-scatter
    # copy, the activations (FSDP2 MixedPrecisionPolicy of lightning_fpdt.strategy.precision)
    "bf16-mixed": dict(master=4, param=2, grad=4, reduce=4, act=2),
    "bf16-true": dict(master=2, param=2, grad=2, reduce=2, act=2),
    "32-true": dict(master=4, param=4, grad=4, reduce=4, act=4),
}
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0}
"""Tensors of the master weights' size an optimizer keeps per parameter."""


def resolve_geometry(model: Any, *, num_layers: Optional[int] = None) -> ModelGeometry:
    """A :class:`ModelGeometry` from a geometry, a ``LlamaConfig`` or Hugging Face config (or a mapping of one), a
    named size (``"llama3-8b"``, ...) or the path of a Hugging Face ``config.json``; ``num_layers`` replaces the
    depth."""
    if isinstance(model, ModelGeometry):
        geometry = model
    elif isinstance(model, str):
        if model in NAMED_CONFIGS:
            geometry = ModelGeometry.from_config(LlamaConfig.from_name(model))
        elif os.path.isfile(model):
            with open(model) as f:
                try:
                    config = json.load(f)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{model} is not a JSON config file: {error}") from error
            if not isinstance(config, dict):
                raise ValueError(f"{model} holds {type(config).__name__}, not a Hugging Face config object")
            geometry = _from_config(SimpleNamespace(**_text_config(config)))
        else:
            raise ValueError(
                f"model {model!r} is neither a named size ({sorted(NAMED_CONFIGS)}) nor a Hugging Face config.json file"
            )
    elif isinstance(model, dict):
        geometry = _from_config(SimpleNamespace(**_text_config(model)))
    else:
        geometry = _from_config(model)
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers ({num_layers}) must be positive")
        geometry = dataclasses.replace(geometry, num_layers=num_layers)
    return geometry


def _from_config(config: Any) -> ModelGeometry:
    """The geometry of a Hugging Face config, with what its family's file says (per-head q/k norms, the experts by
    the config fields its router names)."""
    return dataclasses.replace(ModelGeometry.from_config(config), **family_geometry(config))


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal ``config.json`` keeps the language model's sizes under ``text_config`` (what
    ``get_text_config()`` returns for a config object)."""
    text = config.get("text_config")
    return text if isinstance(text, dict) and "hidden_size" in text else config


def geometry_name(geometry: ModelGeometry) -> str:
    """``llama3-8b (4 layers)`` for a named geometry at another depth, else the sizes."""
    for name in NAMED_CONFIGS:
        named = ModelGeometry.from_config(LlamaConfig.from_name(name))
        if dataclasses.replace(named, num_layers=geometry.num_layers) == geometry:
            return name if named.num_layers == geometry.num_layers else f"{name} ({geometry.num_layers} layers)"
    g = geometry
    return (f"{g.num_layers} layers, hidden {g.hidden_size}, heads {g.num_heads}/{g.num_kv_heads}x{g.head_dim}, "
            f"MLP {g.intermediate_size}, vocab {g.vocab_size}")


def parameter_counts(geometry: ModelGeometry) -> tuple[int, int]:
    """``(Θ_block, Θ_rest)``: the parameters of one block (q, k, v, o, gate, up, down of every expert and a router
    where there are experts, two norms) and of the rest (embedding, the lm_head unless tied, the final norm)."""
    g = geometry
    q_width, kv_width = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    block = 2 * g.hidden_size * q_width + 2 * g.hidden_size * kv_width
    block += 3 * g.hidden_size * g.intermediate_size * g.num_experts
    block += g.hidden_size * g.num_experts if g.num_experts > 1 else 0  # the router
    block += 2 * g.hidden_size
    rest = g.vocab_size * g.hidden_size * (1 if g.tie_word_embeddings else 2) + g.hidden_size
    return block, rest


def total_parameters(geometry: ModelGeometry) -> int:
    """``Θ = L·Θ_block + Θ_rest``."""
    block, rest = parameter_counts(geometry)
    return geometry.num_layers * block + rest


def attention_geometry(geometry: ModelGeometry, dtype_bytes: int = 2) -> AttentionGeometry:
    """The sizes ``lightning_fpdt.sequence.planning`` works with."""
    return AttentionGeometry(num_layers=geometry.num_layers, num_heads=geometry.num_heads,
                             num_kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim, dtype_bytes=dtype_bytes)
