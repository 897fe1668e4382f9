"""Ulysses sequence parallelism: FPDT attention with one chunk per rank (docs/design.md §4).

Not a second implementation: ``u = 1`` of :func:`~lightning_fpdt.sequence.attention.fpdt_attention` is exactly
all-to-all (sequence -> heads), local exact attention, all-to-all back.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch import Tensor

from lightning_fpdt.sequence.attention import fpdt_attention


def ulysses_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    causal: bool = True,
    scale: Optional[float] = None,
    group: Optional[dist.ProcessGroup] = None,
    backend: str = "auto",
) -> Tensor:
    """Causal attention of ``(B, S/P, H, D)`` shards over ``group``: :func:`fpdt_attention` with ``num_chunks=1``."""
    return fpdt_attention(query, key, value, causal=causal, scale=scale, group=group, num_chunks=1, backend=backend)
