"""The one definition of which tokens a sequence-parallel rank holds (docs/design.md §3).

The global sequence of ``S`` tokens (after right-padding to a multiple of ``P·u``) is cut into ``P·u`` pieces of
``c = S / (P·u)`` tokens. Rank ``r`` holds pieces ``r, P + r, 2P + r, …, (u − 1)P + r`` in that order, so its local
chunk ``i`` is global piece ``i·P + r``. When every rank all-to-alls its local chunk ``i``, each receives the
contiguous global range ``[i·C, (i + 1)·C)`` with ``C = P·c``: chunk-level causality is then "q chunk ``i`` sees kv
chunks ``j <= i``". With ``u = 1`` this is plain contiguous sharding.

**Ring dimension** (``ring_size = R > 1``, sequence parallelism beyond the head count; ``sequence/ring.py``): the
``P = U·R`` ranks form ``R`` ring ranks of ``U`` Ulysses ranks each, numbered ring-major (``sp_rank = ring_rank·U +
ulysses_rank``) so that each Ulysses group, whose all-to-all carries the most bytes, is ``U`` consecutive ranks
(inside one host). The global sequence (padded to a multiple of ``2P``) is cut into ``2R`` ring pieces of ``S/(2R)``
tokens; ring rank ``ρ`` holds pieces ``ρ`` and ``2R − 1 − ρ`` (head-tail, so every ring rank has the same causal
work), concatenated in that order: its *share*. Inside the share the ``U`` Ulysses ranks hold contiguous parts of
``S/P`` tokens, so the Ulysses all-to-all gives each rank its ring rank's whole share for ``H/U`` heads. FPDT chunks
(``num_chunks > 1``) are not composed with the ring dimension yet.

Every slicing of the sequence in this package (the strategy's batch sharding, the attention's chunk loop, the tests'
references) goes through :class:`SequenceLayout`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fpdt.sequence import loss
from lightning_fpdt.sequence.loss import IGNORE_INDEX
from lightning_fpdt.sequence.ring_rules import check_ring


class RingBlock(NamedTuple):
    """Which rows of a q share attend which columns of a kv share, and whether the block is causal (diagonal)."""

    q: slice
    """Rows of the q share (positions in the share, not global)."""
    kv: slice
    """Columns of the kv share."""
    causal: bool
    """``True``: the square diagonal block (q share == kv share, increasing global order); else every row sees every
    column."""


@dataclass(frozen=True)
class SequenceLayout:
    """Which tokens of a global sequence one sequence-parallel rank holds."""

    sp_size: int
    """Number of sequence-parallel ranks ``P``."""
    sp_rank: int
    """This rank's index ``r`` in the sequence-parallel group, ``0 <= r < P``."""
    num_chunks: int = 1
    """FPDT chunks per rank ``u``; the global sequence is cut into ``P·u`` pieces."""
    ring_size: int = 1
    """Ring ranks ``R`` (``P = U·R``); ``1``: plain Ulysses/FPDT over all ``P`` ranks."""

    def __post_init__(self) -> None:
        if self.sp_size < 1:
            raise ValueError(f"sp_size must be >= 1, got {self.sp_size}")
        if not 0 <= self.sp_rank < self.sp_size:
            raise ValueError(f"sp_rank must be in [0, sp_size={self.sp_size}), got {self.sp_rank}")
        if self.num_chunks < 1:
            raise ValueError(f"num_chunks must be >= 1, got {self.num_chunks}")
        if self.ring_size < 1 or self.sp_size % self.ring_size:
            raise ValueError(
                f"ring_size ({self.ring_size}) must be a positive divisor of sequence_parallel_size ({self.sp_size})"
            )
        check_ring(self.ring_size, chunks=self.num_chunks)

    # ---- the ring dimension ---------------------------------------------------------------------------------------
    @property
    def ulysses_size(self) -> int:
        """``U = P / R``: ranks of one Ulysses (all-to-all) group."""
        return self.sp_size // self.ring_size

    @property
    def ring_rank(self) -> int:
        """``ρ``: this rank's index in its ring (ring-major numbering: ``sp_rank = ρ·U + ulysses_rank``)."""
        return self.sp_rank // self.ulysses_size

    @property
    def ulysses_rank(self) -> int:
        """This rank's index in its Ulysses group (consecutive ranks)."""
        return self.sp_rank % self.ulysses_size

    def ring_pieces(self, ring_rank: Optional[int] = None) -> tuple[int, int]:
        """The two ring pieces (of ``2R``) a ring rank holds: head ``ρ`` and tail ``2R − 1 − ρ``."""
        rho = self.ring_rank if ring_rank is None else ring_rank
        return rho, 2 * self.ring_size - 1 - rho

    def share_indices(
        self, seq_len: int, ring_rank: Optional[int] = None, device: Optional[torch.device] = None
    ) -> Tensor:
        """Global indices of a ring rank's share (``S/R`` tokens, increasing): what each of its ranks holds, for its
        heads, after the Ulysses all-to-all. With ``R = 1`` the whole sequence."""
        self.check_divisible(seq_len)
        piece = seq_len // (2 * self.ring_size)
        if self.ring_size == 1:
            return torch.arange(seq_len, device=device)
        head, tail = self.ring_pieces(ring_rank)
        return torch.cat([torch.arange(head * piece, (head + 1) * piece, device=device),
                          torch.arange(tail * piece, (tail + 1) * piece, device=device)])

    def ring_block(self, kv_ring_rank: int, share_len: int) -> RingBlock:
        """The causal block of this ring rank's q share against ring rank ``kv_ring_rank``'s kv share.

        With head-tail pieces (q share: pieces ``ρ < 2R−1−ρ``; kv share: ``κ < 2R−1−κ``):
        ``κ == ρ``: the diagonal, causal on the whole share; ``κ < ρ``: every q row sees the kv head piece
        (``κ < ρ``) and none sees its tail (``2R−1−κ > 2R−1−ρ``); ``κ > ρ``: the q head piece sees nothing
        (both kv pieces lie after it) and the q tail sees the whole kv share. So every step but the first is one full
        block of ``(S/R)·(S/2R)`` scores: equal work on every ring rank.
        """
        if not 0 <= kv_ring_rank < self.ring_size:
            raise IndexError(f"kv_ring_rank {kv_ring_rank} out of range for ring_size {self.ring_size}")
        half = share_len // 2
        everything = slice(0, share_len)
        if kv_ring_rank == self.ring_rank:
            return RingBlock(q=everything, kv=everything, causal=True)
        if kv_ring_rank < self.ring_rank:
            return RingBlock(q=everything, kv=slice(0, half), causal=False)
        return RingBlock(q=slice(half, share_len), kv=everything, causal=False)

    @property
    def num_pieces(self) -> int:
        """``P·u`` (``2P`` with a ring: ``2R`` ring pieces, each share split into ``U`` parts): the global sequence
        length must be a multiple of this."""
        return self.sp_size * self.num_chunks * (2 if self.ring_size > 1 else 1)

    # ---- lengths --------------------------------------------------------------------------------------------------
    def padded_length(self, seq_len: int) -> int:
        """The global length after right-padding ``seq_len`` to a multiple of ``P·u``."""
        return math.ceil(seq_len / self.num_pieces) * self.num_pieces

    def local_length(self, seq_len: int) -> int:
        """Tokens this rank holds of a (padded) global sequence of ``seq_len``."""
        return self.padded_length(seq_len) // self.sp_size

    def chunk_length(self, seq_len: int) -> int:
        """``c``: tokens per rank per chunk."""
        return self.padded_length(seq_len) // self.num_pieces

    def check_divisible(self, seq_len: int) -> None:
        if seq_len % self.num_pieces:
            factors = (f"2 * sequence_parallel_size ({self.sp_size}) with ring_size {self.ring_size}"
                       if self.ring_size > 1 else
                       f"sequence_parallel_size ({self.sp_size}) * chunks ({self.num_chunks})")
            raise ValueError(
                f"sequence length {seq_len} is not divisible by {factors} = {self.num_pieces}: pad it to "
                f"{self.padded_length(seq_len)} with SequenceLayout.pad (the strategy does this unless "
                f"pad_to_multiple=False)"
            )

    # ---- indices --------------------------------------------------------------------------------------------------
    def local_indices(self, seq_len: int, device: Optional[torch.device] = None) -> Tensor:
        """Global indices of this rank's tokens, in local order; ``seq_len`` must be padded already."""
        self.check_divisible(seq_len)
        if self.ring_size > 1:
            part = seq_len // self.sp_size  # this rank's contiguous part of its ring rank's share
            share = self.share_indices(seq_len, device=device)
            return share[self.ulysses_rank * part:(self.ulysses_rank + 1) * part]
        c = seq_len // self.num_pieces
        piece_starts = (torch.arange(self.num_chunks, device=device) * self.sp_size + self.sp_rank) * c  # (u,)
        return (piece_starts[:, None] + torch.arange(c, device=device)[None, :]).flatten()  # (u·c,)

    def position_ids(self, seq_len: int, batch_size: int = 1, device: Optional[torch.device] = None) -> Tensor:
        """Global position ids of the local tokens, ``(batch_size, S/P)``; RoPE must use these."""
        return self.local_indices(seq_len, device).unsqueeze(0).expand(batch_size, -1).contiguous()

    # ---- shard / unshard ------------------------------------------------------------------------------------------
    def shard(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's tokens of a padded global tensor: ``(…, S, …) -> (…, S/P, …)`` along ``dim``."""
        dim = dim % x.dim()
        seq_len = x.shape[dim]
        self.check_divisible(seq_len)
        if self.ring_size > 1:
            return x.index_select(dim, self.local_indices(seq_len, device=x.device))
        c = seq_len // self.num_pieces
        # (…, S, …) -> (…, u, P, c, …) -select rank-> (…, u, c, …) -> (…, u·c, …)
        pieces = x.unflatten(dim, (self.num_chunks, self.sp_size, c))
        return pieces.select(dim + 1, self.sp_rank).flatten(dim, dim + 1).contiguous()

    def unshard(self, shards: Sequence[Tensor], dim: int = 1) -> Tensor:
        """The global tensor from every rank's shard, given in sequence-parallel rank order."""
        if len(shards) != self.sp_size:
            raise ValueError(f"unshard needs one shard per rank ({self.sp_size}), got {len(shards)}")
        dim = dim % shards[0].dim()
        local_len = shards[0].shape[dim]
        if self.ring_size > 1:
            # the shards in rank order hold the global tokens in this order; invert that permutation
            seq_len = local_len * self.sp_size
            order = torch.cat([SequenceLayout(self.sp_size, r, 1, self.ring_size).local_indices(seq_len)
                               for r in range(self.sp_size)]).to(shards[0].device)
            return torch.cat(list(shards), dim=dim).index_select(dim, torch.argsort(order))
        if local_len % self.num_chunks:
            raise ValueError(f"local length {local_len} is not divisible by num_chunks ({self.num_chunks})")
        c = local_len // self.num_chunks
        # each (…, u·c, …) -> (…, u, c, …); stacked -> (…, u, P, c, …) -> (…, S, …)
        stacked = torch.stack([s.unflatten(dim, (self.num_chunks, c)) for s in shards], dim=dim + 1)
        return stacked.flatten(dim, dim + 2)

    def gather(self, x: Tensor, group: Optional[dist.ProcessGroup], dim: int = 1) -> Tensor:
        """All-gather the local shards of the group and return the global tensor (not differentiable)."""
        if self.sp_size == 1:
            return x
        shards = [torch.empty_like(x) for _ in range(self.sp_size)]
        dist.all_gather(shards, x.contiguous(), group=group)
        return self.unshard(shards, dim=dim)

    def local_chunk(self, x: Tensor, index: int, dim: int = 1) -> Tensor:
        """Local chunk ``index`` (global piece ``index·P + r``) of a local tensor, as a view."""
        local_len = x.shape[dim]
        if local_len % self.num_chunks:
            raise ValueError(
                f"local sequence length {local_len} is not divisible by num_chunks ({self.num_chunks}); "
                f"pad the global sequence to a multiple of sequence_parallel_size * num_chunks"
            )
        if not 0 <= index < self.num_chunks:
            raise IndexError(f"chunk index {index} out of range for {self.num_chunks} chunks")
        c = local_len // self.num_chunks
        return x.narrow(dim, index * c, c)

    # ---- padding and labels ---------------------------------------------------------------------------------------
    def pad(self, x: Tensor, dim: int = 1, value: float = 0) -> Tensor:
        """Right-pad ``x`` along ``dim`` to a multiple of ``P·u`` with ``value``."""
        dim = dim % x.dim()
        seq_len = x.shape[dim]
        extra = self.padded_length(seq_len) - seq_len
        if extra == 0:
            return x
        pad_shape = list(x.shape)
        pad_shape[dim] = extra
        return torch.cat([x, x.new_full(pad_shape, value)], dim=dim)

    def pad_position_ids(self, position_ids: Tensor, dim: int = 1) -> Tensor:
        """Right-pad position ids by continuing them (last + 1, last + 2, …)."""
        dim = dim % position_ids.dim()
        seq_len = position_ids.shape[dim]
        extra = self.padded_length(seq_len) - seq_len
        if extra == 0:
            return position_ids
        last = position_ids.narrow(dim, seq_len - 1, 1)
        steps = torch.arange(1, extra + 1, device=position_ids.device, dtype=position_ids.dtype)
        view = [1] * position_ids.dim()
        view[dim] = extra
        return torch.cat([position_ids, last + steps.view(view)], dim=dim)

    @staticmethod
    def shift_labels(labels: Tensor, dim: int = 1, ignore_index: int = IGNORE_INDEX) -> Tensor:
        """Targets on the global sequence: ``out[t] = labels[t + 1]``, the last one ``ignore_index``
        (:func:`lightning_fpdt.sequence.loss.shift_labels`). Shifting happens before sharding so no label is lost at
        shard boundaries."""
        return loss.shift_labels(labels, dim=dim, ignore_index=ignore_index)
