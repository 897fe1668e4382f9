"""What the multi-process attention tests share: the same full inputs on every rank, the single-process reference's
output and gradients, and the comparison of the gathered result with it (pad tokens included)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from lightning_fpdt.sequence import SequenceLayout


def draw_inputs(gen: torch.Generator, batch: int, seq_len: int, heads: tuple[int, int],
                head_dim: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """fp64 ``q (B, S, H, D)``, ``k, v (B, S, Hkv, D)`` and the output gradient, drawn in that order from ``gen``
    (seeded alike on every rank, so every rank holds the same full inputs)."""
    num_heads, num_kv_heads = heads
    q = torch.randn(batch, seq_len, num_heads, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, seq_len, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, seq_len, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(batch, seq_len, num_heads, head_dim, generator=gen, dtype=torch.float64)
    return q, k, v, grad_out


def reference(attention: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor,
              *args) -> tuple[Tensor, tuple[Tensor, ...]]:
    """The reference ``attention(q, k, v, *args)``'s output and its q/k/v gradients for ``grad_out``."""
    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attention(*inputs, *args)
    return out.detach(), torch.autograd.grad(out, inputs, grad_out)


def assert_matches_reference(layout: SequenceLayout, seq_len: int, out: Tensor, grads: tuple[Tensor, ...],
                             ref_out: Tensor, ref_grads: tuple[Tensor, ...], tol: dict, case: str) -> None:
    """Gather this rank's output and q/k/v gradients over the layout; the real tokens equal the reference's within
    ``tol``, and the pad tokens get no gradient (no real query attends a pad key; pad queries get no gradient)."""
    full_out = layout.gather(out.detach(), None)
    assert full_out.shape[1] == layout.padded_length(seq_len), case
    torch.testing.assert_close(full_out[:, :seq_len].double(), ref_out, **tol, msg=lambda m: f"{case} out: {m}")
    for name, grad, ref_grad in zip("qkv", grads, ref_grads):
        full = layout.gather(grad, None)
        torch.testing.assert_close(full[:, :seq_len].double(), ref_grad, **tol, msg=lambda m: f"{case} d{name}: {m}")
        assert torch.count_nonzero(full[:, seq_len:]) == 0, f"{case} d{name} nonzero on pad tokens"
