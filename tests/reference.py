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


def documents_separately(
    q: Tensor, k: Tensor, v: Tensor, starts: list[list[int]], scale: float | None = None
) -> Tensor:
    """Each document of each sequence through :func:`causal_attention` on its own, concatenated back.

    ``starts[b]``: ascending document start offsets of sequence ``b`` (the first 0); a document ends where the next
    starts, the last at the end of the sequence.
    """
    rows = []
    for b, row in enumerate(starts):
        ends = list(row[1:]) + [q.shape[1]]
        rows.append(torch.cat([causal_attention(q[b:b + 1, s:e], k[b:b + 1, s:e], v[b:b + 1, s:e], scale)
                               for s, e in zip(row, ends)], dim=1))
    return torch.cat(rows, dim=0)
