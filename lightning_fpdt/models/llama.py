"""A reference Llama in plain PyTorch whose attention is a swappable function.

Every ``LlamaAttention`` calls ``self.attention_fn(q, k, v, causal=True, scale=...)`` on
sequence-major tensors ``(B, S, H, D)``. A sequence-parallel strategy replaces that attribute
with a distributed implementation of the same function; it then receives the local shard of
the sequence, with RoPE already applied from global ``position_ids``.

Packed documents: given ``document_ids (B, S)``, or ``position_ids`` that restart at 0 where a document starts,
a token attends only to earlier tokens of its own document, and the last token of a document is no target; the
attention function then also gets ``document_ids=`` (the strategy's attention takes the boundaries of the global
batch instead).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_fpdt.fused.ops import rms_norm, rotary, swiglu
from lightning_fpdt.sequence import loss as token_loss
from lightning_fpdt.sequence.documents import document_ids_from_positions, document_starts_mask, has_position_resets

# Named geometries; `LlamaConfig.from_name(name, **overrides)` builds a config from one.
NAMED_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2
    ),
    # Llama-3.2-1B geometry (its llama3 RoPE frequency scaling is not modelled here).
    "llama3-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, rope_theta=500000.0, tie_word_embeddings=True,
    ),
    # Llama-3.2-3B geometry (as llama3-1b: no llama3 RoPE frequency scaling).
    "llama3-3b": dict(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_layers=28, num_heads=24,
        num_kv_heads=8, head_dim=128, rope_theta=500000.0, tie_word_embeddings=True,
    ),
    "llama3-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, rope_theta=500000.0, tie_word_embeddings=False,
    ),
}


@dataclass(kw_only=True)
class LlamaConfig:
    vocab_size: int
    """Number of token ids (rows of the embedding table)."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the gated MLP."""
    num_layers: int
    """Number of decoder layers."""
    num_heads: int
    """Number of query heads."""
    num_kv_heads: int
    """Number of key/value heads (grouped-query attention); must divide ``num_heads``."""
    head_dim: Optional[int] = None
    """Per-head width; ``None`` means ``hidden_size // num_heads``. Must be even for RoPE."""
    rope_theta: float = 500000.0
    """RoPE base frequency."""
    rms_norm_eps: float = 1e-5
    """Epsilon added to the mean square in RMSNorm."""
    tie_word_embeddings: bool = False
    """Share the input embedding table with the output projection."""
    initializer_range: float = 0.02
    """Standard deviation of the normal init of Linear and Embedding weights."""

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")
        for name in positive + ("rope_theta", "rms_norm_eps", "initializer_range"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be positive")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}); "
                f"pick num_kv_heads among the divisors of {self.num_heads}"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_heads ({self.num_heads}); "
                    "change one of them or set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_heads
        if self.head_dim <= 0 or self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be a positive even number: RoPE rotates pairs")

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "LlamaConfig":
        """Build one of ``NAMED_CONFIGS``, with fields replaced by ``overrides``."""
        if name not in NAMED_CONFIGS:
            raise ValueError(f"Unknown Llama config {name!r}; known names: {sorted(NAMED_CONFIGS)}")
        return cls(**{**NAMED_CONFIGS[name], **overrides})

    def num_parameters(self, *, include_embedding: bool = True) -> int:
        """Parameter count of ``LlamaForCausalLM(self)``, from the geometry alone.

        ``include_embedding=False`` drops the input embedding table (a lookup, no FLOPs) but keeps the
        output projection (a matmul), also when it is tied to the embedding.
        """
        h, d = self.hidden_size, self.head_dim
        attention = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o + k, v
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        per_layer = attention + mlp + 2 * h  # + input and post-attention norms
        embedding = self.vocab_size * h
        body = self.num_layers * per_layer + h + embedding  # + final norm + lm_head
        if include_embedding and not self.tie_word_embeddings:
            body += embedding
        return body


class RMSNorm(nn.Module):
    def __init__(self, dim: int, *, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        # The mean square is taken in fp32 so bf16 activations do not lose the normalisation; over token tiles,
        # keeping one fp32 per token for backward instead of an fp32 copy of x (lightning_fpdt/fused/ops.py).
        return rms_norm(x, self.weight, self.eps)


def apply_rotary(x: Tensor, position_ids: Tensor, theta: float) -> Tensor:
    """Rotate ``x (B, S, H, D)`` by RoPE angles of ``position_ids (B, S)`` (rotate-half convention), in fp32 over
    token tiles, keeping nothing of ``x`` for backward (lightning_fpdt/fused/ops.py)."""
    return rotary(x, position_ids, theta)


def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, scale: Optional[float] = None,
    document_ids: Optional[Tensor] = None,
) -> Tensor:
    """Single-device attention: ``q (B, S, H, D)``, ``k, v (B, S, Hkv, D)`` -> ``(B, S, H, D)``.

    With ``document_ids (B, S)`` a token attends only to (earlier, if causal) tokens of its own document: an
    ``S × S`` mask, fine for a single device, not for long sequences (the fpdt strategy never builds it).
    """
    mask = None
    if document_ids is not None:
        mask = (document_ids[:, :, None] == document_ids[:, None, :])[:, None]  # (B, 1, S, S)
        if causal:
            s = q.shape[1]
            mask = mask & torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        is_causal=causal and mask is None, scale=scale, enable_gqa=True,
    )  # (B, H, S, D)
    return out.transpose(1, 2)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.rope_theta = config.rope_theta
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        # The hook a sequence-parallel strategy replaces; see the module docstring.
        self.attention_fn: Callable[..., Tensor] = sdpa_attention

    def forward(self, x: Tensor, position_ids: Tensor, document_ids: Optional[Tensor] = None) -> Tensor:
        b, s, _ = x.shape  # (B, S, hidden)
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)  # (B, S, H, D)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)  # (B, S, Hkv, D)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)  # (B, S, Hkv, D)
        q = apply_rotary(q, position_ids, self.rope_theta)
        k = apply_rotary(k, position_ids, self.rope_theta)
        # document_ids only when packed: an attention_fn without that argument keeps working for plain batches
        packed = {} if document_ids is None else {"document_ids": document_ids}
        out = self.attention_fn(q, k, v, causal=True, scale=self.head_dim**-0.5, **packed)  # (B, S, H, D)
        return self.o_proj(out.reshape(b, s, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: Tensor, position_ids: Tensor, document_ids: Optional[Tensor] = None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), position_ids, document_ids)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: Tensor, position_ids: Tensor, document_ids: Optional[Tensor] = None) -> Tensor:
        """Final-normed hidden states ``(B, S, hidden)``."""
        x = self.embed_tokens(input_ids)  # (B, S, hidden)
        for layer in self.layers:
            x = layer(x, position_ids, document_ids)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # A strategy that shifts labels itself (before sharding the sequence) sets this to True.
        self.labels_are_shifted = False
        # Packed documents from position-id resets (a host sync per forward on a GPU); the fpdt strategy turns it off:
        # it finds the documents on the global batch and hands them to its attention itself.
        self.documents_from_positions = True
        self.reset_parameters()

    def tie_weights(self) -> None:
        """Share the embedding Parameter with ``lm_head``; ``to_empty`` unties, so call it after."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def reset_parameters(self) -> None:
        """Linear/Embedding weights ~ N(0, initializer_range), norm weights 1; works after ``to_empty``."""
        self.tie_weights()
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()

    @property
    def output_weight(self) -> Tensor:
        """The ``(V, hidden)`` output projection; the embedding table when tied, even if ``to_empty`` untied it."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def loss(self, hidden: Tensor, targets: Tensor) -> Tensor:
        """Cross-entropy of ``hidden (B, S, hidden)`` against per-token ``targets (B, S)``, in fp32 at least.

        ``sum / max(n_valid, 1)``: the mean over valid tokens, and 0.0 (not NaN) for a shard with none.
        """
        return token_loss.token_cross_entropy(F.linear(hidden, self.output_weight), targets)[0]  # (B, S, V) logits

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Optional[Tensor] = None,
        labels: Optional[Tensor] = None,
        shift_labels: Optional[Tensor] = None,
        document_ids: Optional[Tensor] = None,
        **ignored_kwargs: Any,
    ) -> Tensor:
        """Logits ``(B, S, V)`` without labels, else the scalar loss.

        ``shift_labels`` are per-token targets used as is; ``labels`` are shifted left by one unless
        ``self.labels_are_shifted`` (then the last token of every document gets no target).
        ``document_ids (B, S)``, or ``position_ids`` restarting at 0: packed documents (see the module docstring).
        """
        ignored = sorted(name for name, value in ignored_kwargs.items() if value is not None)
        if ignored:
            warnings.warn(f"LlamaForCausalLM ignores {ignored}: attention is always causal over position_ids")
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).expand(b, s)  # (B, S)
        if document_ids is None and self.documents_from_positions and has_position_resets(position_ids):
            document_ids = document_ids_from_positions(position_ids)
        if document_ids is not None and document_ids.shape != input_ids.shape:
            raise ValueError(
                f"document_ids must be shaped like input_ids {tuple(input_ids.shape)}, got {tuple(document_ids.shape)}"
            )
        hidden = self.model(input_ids, position_ids, document_ids)  # (B, S, hidden)
        if shift_labels is not None:
            targets = shift_labels
        elif labels is not None:
            if self.labels_are_shifted:
                targets = labels
            else:
                targets = token_loss.shift_labels(labels)  # token t predicts token t + 1; the last one nothing
                if document_ids is not None:  # nothing follows a document's last token in its document
                    targets = token_loss.ignore_document_ends(targets, document_starts_mask(document_ids=document_ids))
        else:
            return F.linear(hidden, self.output_weight)  # (B, S, V)
        return self.loss(hidden, targets)
