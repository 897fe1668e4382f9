"""``chunks="auto"`` and ``offload="auto"``: sized from the sequence, the head geometry and free GPU memory.

Bytes the FPDT attention holds (per rank; ``B`` batch, ``S`` global length, ``P`` sequence-parallel size, ``u``
chunks, ``C = S/u`` global tokens per chunk, ``h = H/P`` query heads and ``hk = max(Hkv, P)/P`` kv heads per rank
after the all-to-all; when ``P`` does not divide the heads, those of the busiest rank, ``h = ⌈H/P⌉`` and the kv heads
they read (:func:`rank_heads`), and ``H``, ``max(Hkv, P)`` below are ``P·h``, ``P·hk``):

- between forward and backward, per layer (the stash): q ``B·(S/P)·H·D·b``, k and v ``2·B·(S/P)·max(Hkv, P)·D·b``,
  lse ``B·(S/P)·H·4`` (the output is not stashed: the layer keeps it, and the backward rebuilds its chunks);
- while one chunk computes (the working set): its q, k, v and the prefetched kv chunk ``B·C·(h + 4·hk)·D·b``, the
  fp32 running output and block output ``2·B·C·h·D·4``, the lse ``B·C·h·4·2``.

``offload="auto"`` offloads when the stash of all layers would take more than a quarter of the free memory, and
``offload_dq="auto"`` moves the backward's fp32 partial dQ sums (``4·B·(S/P)·H·D``) to the host as well when they
would take more than an eighth;
``chunks="auto"`` takes the fewest chunks whose working set stays under a sixteenth of it, and at most 65,536 global
tokens per chunk (FPDT's chunk size; longer chunks gain no kernel efficiency).

With a ring (``ring_size = R > 1``, ``U = P/R`` Ulysses ranks, ``sequence/ring.py``) the same formulas hold with the
Ulysses group in place of ``P`` for the heads (``h = H/U``, kv heads replicated up to ``U``) and the ring rank's
share ``S/R`` in place of a chunk (``u = 1``): the working set is the q share, the own and the in-flight kv share, the
fp32 running and block output. ``offload`` moves the shares to the host like chunks; the chunks are 1 (not composed
with the ring yet) and there are no partial dQ sums to offload.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from lightning_fpdt.sequence.heads import HeadSplit

MAX_CHUNK_TOKENS = 65536
STASH_FRACTION = 4  # offload when the stash of all layers exceeds free / 4
WORKING_SET_FRACTION = 16  # one chunk's working set stays under free / 16


@dataclass(frozen=True)
class AttentionGeometry:
    """What the sizes depend on."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2


def rank_heads(geometry: AttentionGeometry, ulysses_size: int) -> tuple[int, int]:
    """``(h, hk)``: query and kv heads of the busiest of ``ulysses_size`` ranks after the all-to-all
    (:class:`HeadSplit`: ``H/U`` and ``max(Hkv, U)/U`` for an even split, ``⌈H/U⌉`` and the kv heads they read
    otherwise)."""
    return _busiest_rank_heads(geometry.num_heads, geometry.num_kv_heads, ulysses_size)


@functools.lru_cache(maxsize=1024)
def _busiest_rank_heads(num_heads: int, num_kv_heads: int, ulysses_size: int) -> tuple[int, int]:
    split = HeadSplit(num_heads=num_heads, num_kv_heads=num_kv_heads, sp_size=ulysses_size)
    return split.max_heads, split.max_kv_heads


def stash_bytes(
    geometry: AttentionGeometry, *, batch_size: int, seq_len: int, sp_size: int, ring_size: int = 1
) -> int:
    """Bytes one layer's chunks (or, with a ring, its head-sharded shares) occupy between its forward and its
    backward, on one rank."""
    g = geometry
    local = batch_size * seq_len // sp_size
    ulysses = sp_size // ring_size
    heads, kv_heads = (n * ulysses for n in rank_heads(g, ulysses))  # H and max(Hkv, U) for an even split
    q_like = heads if ring_size == 1 else 2 * heads  # q (FPDT rebuilds out in backward); the ring keeps out
    return local * (q_like + 2 * kv_heads) * g.head_dim * g.dtype_bytes + local * heads * 4


def working_set_bytes(
    geometry: AttentionGeometry, *, batch_size: int, seq_len: int, sp_size: int, num_chunks: int, ring_size: int = 1
) -> int:
    """Bytes live on the device while one chunk of one layer computes (with a ring: one ring step on the share)."""
    g = geometry
    ulysses = sp_size // ring_size
    chunk = batch_size * math.ceil(seq_len / (num_chunks * ring_size))
    heads, kv_heads = rank_heads(g, ulysses)
    return int(chunk * (heads + 4 * kv_heads) * g.head_dim * g.dtype_bytes + chunk * heads * (2 * g.head_dim + 2) * 4)


def choose_offload(
    geometry: AttentionGeometry, *, batch_size: int, seq_len: int, sp_size: int, free_bytes: int, ring_size: int = 1
) -> bool:
    total = geometry.num_layers * stash_bytes(geometry, batch_size=batch_size, seq_len=seq_len, sp_size=sp_size,
                                              ring_size=ring_size)
    return total > free_bytes / STASH_FRACTION


def choose_chunks(geometry: AttentionGeometry, *, batch_size: int, seq_len: int, sp_size: int, free_bytes: int) -> int:
    num_chunks = max(1, math.ceil(seq_len / MAX_CHUNK_TOKENS))
    while (
        working_set_bytes(geometry, batch_size=batch_size, seq_len=seq_len, sp_size=sp_size, num_chunks=num_chunks)
        > free_bytes / WORKING_SET_FRACTION
        and seq_len / (num_chunks * 2) >= sp_size
    ):
        num_chunks *= 2
    return num_chunks


def choose_offload_dq(
    geometry: AttentionGeometry, *, batch_size: int, seq_len: int, sp_size: int, free_bytes: int
) -> bool:
    heads = rank_heads(geometry, sp_size)[0] * sp_size  # H for an even split
    partial_dq = 4 * batch_size * seq_len // sp_size * heads * geometry.head_dim
    return partial_dq > free_bytes / (2 * STASH_FRACTION)


def grouped_geometry(geometry: AttentionGeometry, head_chunks: int) -> AttentionGeometry:
    """The attention as the planner sees it under ``head_chunks`` groups: ``L·G`` attention calls of ``H/G`` query and
    ``Hkv/G`` kv heads each (stash, kept outputs and host bytes add up over the calls; a working set, a partial dQ and
    one backward's chunks are those of one group)."""
    if head_chunks == 1:
        return geometry
    return dataclasses.replace(
        geometry, num_layers=geometry.num_layers * head_chunks, num_heads=geometry.num_heads // head_chunks,
        num_kv_heads=geometry.num_kv_heads // head_chunks,
    )
