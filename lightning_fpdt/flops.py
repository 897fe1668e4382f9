"""Model FLOPs of a decoder-only transformer training step, and the peak FLOP/s of accelerators.

The count is the *model* FLOPs (what the maths of one training step needs), not the hardware FLOPs
(what was executed, recompute and padding included); MFU divides it by the time taken and the peak.

Notation: ``N`` non-embedding parameters (see ``ModelGeometry.nonembedding_parameters``), ``L``
layers, ``S`` the global sequence length, ``d_attn = num_heads * head_dim`` the width of the
attention (query heads times head dim; not ``hidden_size``, which differs when ``head_dim`` is set).

This module is plain Python + torch: no Lightning imports, so bench scripts can use it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import torch
from torch import nn


def is_count(value: object, *, least: int = 1) -> bool:
    """``value`` is an int of at least ``least`` (``True`` is not one): the one test behind the package's checks of
    sizes and counts; each check words its own message."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


Convention = Literal["causal", "megatron"]
CONVENTIONS: tuple[str, ...] = ("causal", "megatron")


def text_config(config: Any) -> Any:
    """The language model's config: a multimodal Hugging Face config keeps its sizes in a sub-config
    (``get_text_config()``); any other config is itself."""
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


@dataclass
class ModelGeometry:
    """The sizes of a dense decoder-only transformer (Llama-style: gated MLP, GQA) that FLOPs depend on."""

    num_layers: int
    """Number of decoder layers ``L``."""
    hidden_size: int
    """Width of the residual stream."""
    num_heads: int
    """Number of query heads ``H``."""
    num_kv_heads: int
    """Number of key/value heads ``Hkv`` (grouped-query attention); must divide ``num_heads``."""
    head_dim: int
    """Per-head width ``hd``."""
    intermediate_size: int
    """Width of the gated (SwiGLU) MLP."""
    vocab_size: int
    """Number of token ids: rows of the embedding table and outputs of the lm_head."""
    tie_word_embeddings: bool = False
    """Whether the lm_head shares the embedding table. It does not change the FLOPs: the lm_head matmul runs anyway."""
    num_parameters_nonembedding: Optional[int] = None
    """Override for ``N``, the parameters doing matmul work per token. ``None``: counted from the sizes."""
    num_experts: int = 1
    """Gated MLPs of ``intermediate_size`` per layer that hold parameters: a mixture of experts' experts (its router,
    ``hidden_size x num_experts``, beside them); 1 for a dense model."""
    experts_per_token: int = 1
    """Of those, the MLPs each token runs through (a router's top-k); 1 for a dense model."""
    head_norms: bool = False
    """Whether each head's q and k pass an RMSNorm before RoPE (Qwen3's ``q_norm``/``k_norm``): no FLOPs to count,
    but the norms keep their inputs for the backward, which the memory planner counts. A family file says which
    families have them (``lightning_fpdt.integrations.families``, ``Family.head_norms``);
    :func:`lightning_fpdt.planner.resolve_geometry` sets it from there."""

    def __post_init__(self) -> None:
        sizes = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")
        for name in sizes + ("vocab_size",):
            value = getattr(self, name)
            if not is_count(value):
                raise ValueError(f"ModelGeometry.{name} ({value!r}) must be a positive int")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"ModelGeometry.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        for name in ("num_experts", "experts_per_token"):
            value = getattr(self, name)
            if not is_count(value):
                raise ValueError(f"ModelGeometry.{name} ({value!r}) must be a positive int")
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"ModelGeometry.experts_per_token ({self.experts_per_token}) must not exceed "
                             f"num_experts ({self.num_experts})")
        if self.num_parameters_nonembedding is not None and self.num_parameters_nonembedding <= 0:
            raise ValueError(
                f"ModelGeometry.num_parameters_nonembedding ({self.num_parameters_nonembedding}) must be positive, "
                "or None to count it from the sizes"
            )

    @property
    def attention_width(self) -> int:
        """``d_attn = num_heads * head_dim``: attention FLOPs scale with the query heads, whatever ``num_kv_heads``."""
        return self.num_heads * self.head_dim

    @property
    def nonembedding_parameters(self) -> int:
        """``N``: the override if given, else every parameter that does matmul (or norm) work per token.

        Per layer: q, k, v, o projections, the three gated-MLP matrices (of each of the ``experts_per_token`` MLPs a
        token runs through, and a router where there are experts), two RMSNorm weights; then the final norm and the
        lm_head, which is counted even when tied to the embedding because it is a
        matmul. The input embedding is a lookup (no FLOPs) and is left out. Biases are not counted.
        """
        if self.num_parameters_nonembedding is not None:
            return self.num_parameters_nonembedding
        h, q_width, kv_width = self.hidden_size, self.attention_width, self.num_kv_heads * self.head_dim
        attention = h * q_width + 2 * h * kv_width + q_width * h  # q, k + v, o
        mlp = 3 * h * self.intermediate_size * self.experts_per_token  # gate, up, down of each MLP a token runs
        router = h * self.num_experts if self.num_experts > 1 else 0
        per_layer = attention + mlp + router + 2 * h  # + input and post-attention norms
        return self.num_layers * per_layer + h + h * self.vocab_size  # + final norm + lm_head

    @classmethod
    def from_config(cls, config: Any) -> "ModelGeometry":
        """Read the geometry from the reference ``LlamaConfig`` or a Hugging Face config (duck-typed).

        Hugging Face names (``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``) and the
        reference names (``num_layers``, ``num_heads``, ``num_kv_heads``) are both accepted. A missing or
        ``None`` ``head_dim`` means ``hidden_size // num_heads``; missing kv heads mean no GQA.
        """
        config = text_config(config)

        def read(*names: str) -> Any:
            for name in names:
                value = getattr(config, name, None)
                if value is not None:
                    return value
            return None

        heads = config_heads(config)
        values = dict(
            num_layers=read("num_layers", "num_hidden_layers"),
            hidden_size=read("hidden_size"),
            num_heads=heads[0] if heads else None,
            intermediate_size=read("intermediate_size"),
            vocab_size=read("vocab_size"),
        )
        missing = sorted(name for name, value in values.items() if value is None)
        if missing:
            raise ValueError(
                f"{type(config).__name__} lacks {missing}, which the FLOP count needs; "
                "pass geometry=ModelGeometry(...) instead"
            )
        num_kv_heads = heads[1]
        head_dim = read("head_dim")
        if head_dim is None:
            if values["hidden_size"] % values["num_heads"] != 0:
                raise ValueError(
                    f"{type(config).__name__} has no head_dim and hidden_size ({values['hidden_size']}) is not "
                    f"divisible by num_heads ({values['num_heads']}); pass geometry=ModelGeometry(...) instead"
                )
            head_dim = values["hidden_size"] // values["num_heads"]
        tied = bool(getattr(config, "tie_word_embeddings", False))
        # a mixture of experts by the common spellings (Mixtral's num_local_experts, Qwen-MoE's num_experts, whose
        # experts are moe_intermediate_size wide; top-k from num_experts_per_tok), for a geometry read without the
        # integrations; the planner reads them by the fields each family's router names (resolve_geometry)
        experts = read("num_local_experts", "num_experts")
        if isinstance(experts, int) and experts > 1:
            values["intermediate_size"] = read("moe_intermediate_size") or values["intermediate_size"]
            return cls(**values, num_kv_heads=num_kv_heads, head_dim=head_dim, tie_word_embeddings=tied,
                       num_experts=experts, experts_per_token=read("num_experts_per_tok") or 1)
        return cls(**values, num_kv_heads=num_kv_heads, head_dim=head_dim, tie_word_embeddings=tied)

    @classmethod
    def from_model(cls, module: nn.Module) -> "ModelGeometry":
        """The geometry of the first ``.config`` found on ``module`` or its submodules (outermost first)."""
        reasons = []
        for name, submodule in module.named_modules():
            config = getattr(submodule, "config", None)
            if config is None:
                continue
            try:
                return cls.from_config(config)
            except ValueError as error:
                reasons.append(f"{name or type(module).__name__}.config: {error}")
        detail = f" ({'; '.join(reasons)})" if reasons else ""
        raise ValueError(
            f"Could not read the model geometry from {type(module).__name__}: no submodule has a `.config` with "
            f"the model sizes{detail}. Pass geometry=ModelGeometry(...) to MFUMonitor."
        )


def config_heads(config: Any) -> Optional[tuple[int, int]]:
    """``(num_heads, num_kv_heads)`` of a reference ``LlamaConfig`` or a Hugging Face config (either naming), kv heads
    defaulting to the query heads (no GQA); ``None`` when the config names no heads. A multimodal config is read
    through its text config."""
    config = text_config(config)
    heads = getattr(config, "num_heads", None) or getattr(config, "num_attention_heads", None)
    if not heads:
        return None
    kv_heads = getattr(config, "num_kv_heads", None) or getattr(config, "num_key_value_heads", None) or heads
    return int(heads), int(kv_heads)


def attention_heads(module: nn.Module) -> Optional[tuple[int, int]]:
    """:func:`config_heads` of the first ``.config`` on ``module`` or its submodules that names heads, or ``None``."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        heads = config_heads(config) if config is not None else None
        if heads is not None:
            return heads
    return None


def flops_per_token(
    geometry: ModelGeometry, seq_len: int, convention: Convention = "causal", *, attention_len: Optional[float] = None
) -> int:
    """Training FLOPs (forward + backward) per token of sequences ``seq_len`` long.

    ``"causal"`` (the default; what actually has to be computed)::

        6·N + 6·L·S·d_attn

    ``"megatron"`` (for comparison with Megatron-LM's activation-recomputation MFU, Narayanan et al. 2021,
    ``96·B·s·l·h²·(1 + s/6h + V/16lh)``, and ALST/ArcticTraining's ``8·N·S + 16·L·S²·h`` per sequence)::

        8·N + 16·L·S·d_attn

    i.e. attention counted as non-causal (full S×S scores) and the forward counted twice, as if recomputed
    under activation checkpointing: 4 passes (forward, recomputed forward, backward = 2 forwards) instead of
    3. Differences from those sources: N here excludes the input embedding (ArcticTraining counts all
    parameters), and Megatron's formula counts the lm_head ×6, not ×8. Both conventions use ``S/2`` keys
    per query for causal attention, not the exact ``(S+1)/2``.

    ``attention_len`` replaces ``S`` in the attention term: for documents packed into one sequence, each token
    attends only within its document, so the attention work per token is that of ``Σ_d L_d² / S`` (the mean of
    ``L_d`` weighted by the tokens of each document), not ``S``. ``None``: one document, ``S``.
    """
    _check_convention(convention)
    if seq_len <= 0:
        raise ValueError(f"seq_len ({seq_len}) must be positive")
    n, layers, d_attn = geometry.nonembedding_parameters, geometry.num_layers, geometry.attention_width
    if attention_len is not None and not 0 < attention_len <= seq_len:
        raise ValueError(f"attention_len ({attention_len}) must be in (0, seq_len = {seq_len}]")
    window = seq_len if attention_len is None else attention_len
    # Dense: every parameter is one multiply-add (2 FLOPs) per token in the forward and two in the backward
    # (gradients of inputs and of weights): 2·N + 4·N = 6·N.
    # Attention, forward, per token per layer: QKᵀ is 2·S·d_attn (S keys, d_attn wide) and AV another
    # 2·S·d_attn, so 4·S·d_attn with full attention; a causal query sees S/2 keys on average, so
    # 2·S·d_attn. The backward costs twice the forward, so ×3: 6·S·d_attn. GQA does not change this: the
    # scores and the weighted sum are computed per query head, whatever the number of key/value heads.
    if convention == "causal":
        return 6 * n + round(6 * layers * window * d_attn)
    # Megatron: non-causal (4·S·d_attn forward) and 4 passes: 8·N + 16·L·S·d_attn.
    return 8 * n + round(16 * layers * window * d_attn)


def flops_per_step(
    geometry: ModelGeometry, seq_len: int, tokens: int, convention: Convention = "causal", *,
    attention_len: Optional[float] = None,
) -> int:
    """Training FLOPs of ``tokens`` tokens, all in sequences ``seq_len`` long (e.g. ``batch · seq_len · dp``);
    ``attention_len`` as in :func:`flops_per_token` (packed documents)."""
    if tokens < 0:
        raise ValueError(f"tokens ({tokens}) must be non-negative")
    return tokens * flops_per_token(geometry, seq_len, convention, attention_len=attention_len)


def _check_convention(convention: str) -> None:
    if convention not in CONVENTIONS:
        raise ValueError(f"Unknown FLOP convention {convention!r}; choose one of {list(CONVENTIONS)}")


# Dense (not with-sparsity) peak FLOP/s per device, from the vendors' datasheets; where a datasheet lists only
# the with-sparsity figure, this is half of it rounded down to a whole TFLOP/s (H100 SXM: 1979 / 2 -> 989).
# "fp32" is the non-tensor-core rate, "tf32" the tensor-core rate for fp32 matmuls.
# Keys are matched as whole words against the lower-cased device name, in this order: specific names first.
# The SXM H100 reports itself as "NVIDIA H100 80GB HBM3", so the bare "h100" entry is the SXM part.
# Lightning's table (lightning.fabric.utilities.throughput) has no dense H200 figures and sparse H100 NVL ones.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "h100 nvl": {"bf16": 835e12, "fp16": 835e12, "tf32": 417e12, "fp32": 60e12},
    "h100 pcie": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12},
    "h100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "h200 nvl": {"bf16": 835e12, "fp16": 835e12, "tf32": 417e12, "fp32": 60e12},
    "h200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "gh200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "a100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "l40s": {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12},
    "b200": {"bf16": 2250e12, "fp16": 2250e12},
}

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def peak_flops(device_name: str, dtype: Union[str, torch.dtype]) -> Optional[float]:
    """Dense peak FLOP/s of one device for ``dtype`` ("bf16", "fp16", "tf32", "fp32" or a torch dtype).

    ``device_name`` is what ``torch.cuda.get_device_name()`` returns, matched case-insensitively against
    ``PEAK_FLOPS``. ``None`` when the device or the dtype has no entry.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES:
            return None
        dtype = _DTYPE_NAMES[dtype]
    known_dtypes = ("bf16", "fp16", "tf32", "fp32")
    if dtype not in known_dtypes:
        raise ValueError(f"Unknown dtype {dtype!r} for peak_flops; use one of {list(known_dtypes)} or a torch dtype")
    name = device_name.lower()
    for key, figures in PEAK_FLOPS.items():
        if re.search(rf"\b{re.escape(key)}\b", name):
            return figures.get(dtype)
    return None
