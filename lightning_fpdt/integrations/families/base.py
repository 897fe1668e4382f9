"""What the fpdt strategy knows of one Hugging Face model family, and the checks every config goes through.

A family (one file beside this one) names its modules by class: the attention (``is_causal``, run through
transformers' attention interface, or in head groups where the projections are separate), the RMSNorm and the
formula it computes (those of Llama's formula run over token tiles), the MLP (gated, fused gate-up, or a sparse
mixture of experts), the router whose auxiliary loss is made exact over the sequence-parallel group, and what the
family can set that the fpdt attention cannot compute exactly, as a ``ValueError`` at setup naming what to do instead.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from torch import Tensor, nn

from lightning_fpdt.flops import text_config

ConfigCheck = Callable[[Any, str], None]
"""``check(text_config, model_name)``: raises ``ValueError`` for a setting the fpdt attention cannot compute."""

LLAMA_NORM = "weight · (x / sqrt(mean(x²) + eps)) in fp32, cast to x's dtype before the weight"
"""The RMSNorm formula of Llama, Mistral, Qwen and Phi-3: the one the tiled RMSNorm computes."""


@dataclass(frozen=True)
class Router:
    """A sparse mixture-of-experts router whose load-balancing loss the model adds under ``output_router_logits``."""

    module: str
    """The router's class (its output ``[0]`` are the logits transformers records as ``router_logits``)."""
    num_experts: str
    """The config field with the number of experts."""
    top_k: str = "num_experts_per_tok"
    """The config field with the experts per token."""
    coefficient: str = "router_aux_loss_coef"
    """The config field with the loss's weight in the model's loss."""
    expert_width: Optional[str] = None
    """The config field with one expert's MLP width where it is not ``intermediate_size`` (Qwen-MoE's
    ``moe_intermediate_size``); ``None``: ``intermediate_size``."""


@dataclass(frozen=True)
class Family:
    """How the fpdt strategy reaches one family's attention, norms, rotary embedding, MLP and loss."""

    name: str
    """The family as the README's table names it."""
    model_type: str
    """``config.model_type``: the registry key."""
    causal_lm: str
    """The transformers ``*ForCausalLM`` class (and ``config`` its config class)."""
    config: str
    attention: str
    """The attention module's class: what gets the fpdt attention handle (or head groups)."""
    decoder_layer: str
    """The transformer block's class."""
    norm: str
    """The RMSNorm class."""
    norm_formula: str = LLAMA_NORM
    """What the norm computes; only :data:`LLAMA_NORM` norms run over token tiles (the others keep their forward)."""
    head_norms: bool = False
    """Whether each head's q and k pass an RMSNorm before RoPE (``q_norm``/``k_norm``): no FLOPs to count, but their
    inputs are kept for the backward, which the memory planner counts (``ModelGeometry.head_norms``)."""
    separate_projections: bool = True
    """``q_proj``/``k_proj``/``v_proj``/``o_proj`` (head groups can slice them); ``False``: a fused ``qkv_proj``."""
    mlp: str = "gated: down(act(gate_proj(x)) · up_proj(x))"
    """What the block's ``mlp`` is (for the README and error messages)."""
    mlp_classes: tuple[str, ...] = ()
    """The MLP classes TiledMLP tiles in this family (besides the gated ones it detects by their submodules)."""
    mlp_feeds_residual: bool = True
    """Whether the block's ``mlp`` output only feeds the residual add that ends the block (a checkpoint's recompute
    then need not compute its value: ``lightning_fpdt.integrations.install.residual_mlps``)."""
    router: Optional[Router] = None
    """The MoE router, for families with a load-balancing loss."""
    checks: tuple[ConfigCheck, ...] = field(default=())
    """Family-specific refusals, run after :func:`check_config`'s common ones."""

    @property
    def tiles_norm(self) -> bool:
        return self.norm_formula == LLAMA_NORM

    def check(self, config: Any, model_name: str) -> None:
        """``ValueError`` for anything of ``config`` the fpdt attention cannot compute exactly."""
        text = text_config(config)
        check_config(text, model_name)
        for check in self.checks:
            check(text, model_name)

    def rope(self, module: nn.Module) -> Callable[[Tensor, Tensor, Sequence[Tensor]], tuple[Tensor, Tensor]]:
        """RoPE of q and k ``(B, S/P, heads, D)`` from the attention call's ``(cos, sin)``: the family's own
        ``apply_rotary_pos_emb``, from the module's file."""
        return module_rope(module)


def module_rope(module: nn.Module) -> Callable[[Tensor, Tensor, Sequence[Tensor]], tuple[Tensor, Tensor]]:
    """The ``apply_rotary_pos_emb`` of the file that defines ``module``'s class, applied to ``(B, S/P, heads, D)``."""
    rotate = sys.modules[type(module).__module__].apply_rotary_pos_emb

    def rope(q: Tensor, k: Tensor, aux: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        cos, sin = aux  # (B, S/P, D) each
        return rotate(q, k, cos, sin, unsqueeze_dim=2)  # (B, S/P, heads, D)

    return rope


def check_config(config: Any, model_name: str) -> None:
    """The refusals that hold for every family (known or not): attention logit soft-capping, MLA attention, and
    sliding windows (each family says how its config turns its window on, see :func:`sliding_window_check`)."""
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap:
        raise ValueError(
            f"{model_name} soft-caps its attention logits (attn_logit_softcapping={softcap}), which the fpdt attention "
            f"(exact softmax over chunks) does not compute: set attn_logit_softcapping=None (a different model) or "
            f"train it without the fpdt strategy (e.g. FSDP2 with eager attention)"
        )
    if getattr(config, "kv_lora_rank", None) or getattr(config, "q_lora_rank", None):
        raise ValueError(
            f"{model_name} uses multi-head latent attention (kv_lora_rank={getattr(config, 'kv_lora_rank', None)}), "
            f"whose compressed keys and values the fpdt attention does not shard: train it without the fpdt strategy "
            f"(e.g. FSDP2), or use a model with grouped-query attention"
        )
    windowed = [t for t in getattr(config, "layer_types", None) or () if t == "sliding_attention"]
    if windowed and getattr(config, "sliding_window", None):
        raise ValueError(
            f"{model_name} runs {len(windowed)} layers with sliding_window={config.sliding_window}; the fpdt attention "
            f"is full causal attention: set use_sliding_window=False (or layer_types to full_attention), or train "
            f"without the fpdt strategy"
        )


def sliding_window_check(switch: Optional[str], fix: str) -> ConfigCheck:
    """A window that is active when ``config.sliding_window`` is set and (if ``switch`` names one) the config's
    ``switch`` is true: Mistral's is on whenever set, Qwen2's only with ``use_sliding_window``."""

    def check(config: Any, model_name: str) -> None:
        window = getattr(config, "sliding_window", None)
        if window and (switch is None or getattr(config, switch, False)):
            raise ValueError(
                f"{model_name} is configured with sliding_window={window}; the fpdt attention is full causal "
                f"attention: {fix}"
            )

    return check


def refused(model_type: str, reason: str, alternative: str) -> ConfigCheck:
    """A check that refuses every config of a family the fpdt attention cannot run exactly (Gemma-2, DeepSeek MLA)."""

    def check(config: Any, model_name: str) -> None:
        raise ValueError(f"{model_name} ({model_type}) {reason}: {alternative}")

    return check
