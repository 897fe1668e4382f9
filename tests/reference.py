"""Single-process references the parallel code is checked against: written out, sharing no code with the package."""

from __future__ import annotations

import torch
from torch import Tensor


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """softmax(q kᵀ·scale + causal mask) v over ``(B, S, H, D)`` / ``(B, S, Hkv, D)``, in the inputs' dtype."""
    groups = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(groups, dim=2)
    v = v.repeat_interleave(groups, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bshd,bthd->bhst", q, k) * scale
    s = q.shape[1]
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v)
