"""Tile rules of the tiled MLP and the tiled loss: how many token tiles, where each tile starts and ends, and whether
a tile's weight-gradient matmul can add into the fp32 sum itself."""

from __future__ import annotations

import functools
import math
from typing import Literal, Union

import torch

from lightning_fpdt.flops import is_count

MLP_TILE_BYTES = 256 * 2**20
"""``TiledMLP(num_tiles="auto")``: one tile's intermediate activations (``tokens × intermediate × 3 × dtype bytes``)
stay under this."""
INTERMEDIATE_BUFFERS = 3
"""Buffers of ``intermediate_size`` width per token in a gated MLP: gate, up, and act(gate) · up."""
LOSS_TILE_BYTES = 2**30
"""``TiledLoss(num_tiles="auto")``: one tile's fp32 logits (``tokens × vocab × 4`` bytes) stay under this. Each tile
reads and writes the whole fp32 lm_head gradient once (2 GiB for Llama-3-8B): at 2,048 tokens a tile (a 128K
vocabulary) that is ~15% of the tile's matmul time on an H100/H200, at 256 MiB (512 tokens) it was ~55% (profiled at
64K tokens on 4 GPUs)."""


def check_num_tiles(num_tiles: Union[Literal["auto"], int], owner: str) -> None:
    """``ValueError`` unless ``num_tiles`` is ``"auto"`` or a positive int."""
    if num_tiles == "auto":
        return
    if not is_count(num_tiles):
        raise ValueError(f"{owner}(num_tiles={num_tiles!r}): give 'auto' or a positive int (1 = untiled)")


def tile_bounds(num_tokens: int, num_tiles: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of ``num_tiles`` contiguous tiles covering ``num_tokens`` (``tensor_split`` sizes:
    the first ``num_tokens % num_tiles`` tiles one longer); fewer tiles when there are fewer tokens, one if none."""
    num_tiles = max(1, min(num_tiles, num_tokens))
    base, longer = divmod(num_tokens, num_tiles)
    bounds, start = [], 0
    for i in range(num_tiles):
        end = start + base + (1 if i < longer else 0)
        bounds.append((start, end))
        start = end
    return bounds


MLP_UNTILED_BYTES = 2**30
"""``TiledMLP(num_tiles="auto")``: up to this much of intermediate activations, the MLP runs as one tile. Each tile
beyond one costs a pass over the fp32 sums of the weight gradients (three ``hidden × intermediate`` buffers: 0.7 GB
for Llama-3-8B); one tile needs no sum at all."""


def auto_mlp_tiles(num_tokens: int, intermediate_size: int, element_size: int) -> int:
    """One tile while all the ``tokens × intermediate_size × 3`` activations stay under 1 GiB, else tiles such that
    one tile's stay under 256 MiB; at least 1."""
    tile_bytes = num_tokens * intermediate_size * INTERMEDIATE_BUFFERS * element_size
    if tile_bytes <= MLP_UNTILED_BYTES:
        return 1
    return max(1, math.ceil(tile_bytes / MLP_TILE_BYTES))


def auto_loss_tiles(num_tokens: int, vocab_size: int) -> int:
    """Tiles such that one tile's fp32 logits (``tokens × vocab × 4`` bytes) stay under 1 GiB; at least 1."""
    return max(1, math.ceil(num_tokens * vocab_size * 4 / LOSS_TILE_BYTES))


@functools.lru_cache(maxsize=None)
def accumulates_in_place(device: torch.device, dtype: torch.dtype, acc: torch.dtype) -> bool:
    """Whether ``torch.addmm(c, a, b, acc, out=c)`` (``a, b`` in ``dtype``, ``c`` in ``acc``) runs here: CUDA builds
    of torch >= 2.8 have it; CPU builds do not. Both tiled ops sum their tiles' weight gradients this way."""
    if device.type != "cuda":
        return False
    a = torch.ones(8, 8, dtype=dtype, device=device)
    c = torch.ones(8, 8, dtype=acc, device=device)
    try:
        torch.addmm(c, a, a, acc, out=c)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool((c == 9).all())
