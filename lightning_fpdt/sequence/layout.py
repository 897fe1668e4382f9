"""The one definition of which tokens a sequence-parallel rank holds (DESIGN.md §3).

The global sequence of ``S`` tokens (after right-padding to a multiple of ``P·u``) is cut into ``P·u`` pieces of
``c = S / (P·u)`` tokens. Rank ``r`` holds pieces ``r, P + r, 2P + r, …, (u − 1)P + r`` in that order, so its local
chunk ``i`` is global piece ``i·P + r``. When every rank all-to-alls its local chunk ``i``, each receives the
contiguous global range ``[i·C, (i + 1)·C)`` with ``C = P·c``: chunk-level causality is then "q chunk ``i`` sees kv
chunks ``j <= i``". With ``u = 1`` this is plain contiguous sharding.

Every slicing of the sequence in this package (the strategy's batch sharding, the attention's chunk loop, the tests'
references) goes through :class:`SequenceLayout`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

IGNORE_INDEX = -100


@dataclass(frozen=True)
class SequenceLayout:
    """Which tokens of a global sequence one sequence-parallel rank holds."""

    sp_size: int
    """Number of sequence-parallel ranks ``P``."""
    sp_rank: int
    """This rank's index ``r`` in the sequence-parallel group, ``0 <= r < P``."""
    num_chunks: int = 1
    """FPDT chunks per rank ``u``; the global sequence is cut into ``P·u`` pieces."""

    def __post_init__(self) -> None:
        if self.sp_size < 1:
            raise ValueError(f"sp_size must be >= 1, got {self.sp_size}")
        if not 0 <= self.sp_rank < self.sp_size:
            raise ValueError(f"sp_rank must be in [0, sp_size={self.sp_size}), got {self.sp_rank}")
        if self.num_chunks < 1:
            raise ValueError(f"num_chunks must be >= 1, got {self.num_chunks}")

    @property
    def num_pieces(self) -> int:
        """``P·u``: the global sequence length must be a multiple of this."""
        return self.sp_size * self.num_chunks

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
            raise ValueError(
                f"sequence length {seq_len} is not divisible by sequence_parallel_size ({self.sp_size}) * chunks "
                f"({self.num_chunks}) = {self.num_pieces}: pad it to {self.padded_length(seq_len)} with "
                f"SequenceLayout.pad (the strategy does this unless pad_to_multiple=False)"
            )

    # ---- indices --------------------------------------------------------------------------------------------------
    def local_indices(self, seq_len: int, device: Optional[torch.device] = None) -> Tensor:
        """Global indices of this rank's tokens, in local order; ``seq_len`` must be padded already."""
        self.check_divisible(seq_len)
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
        """Targets on the global sequence: ``out[t] = labels[t + 1]``, the last one ``ignore_index``.

        Shifting happens before sharding so no label is lost at shard boundaries.
        """
        dim = dim % labels.dim()
        seq_len = labels.shape[dim]
        tail_shape = list(labels.shape)
        tail_shape[dim] = 1
        return torch.cat([labels.narrow(dim, 1, seq_len - 1), labels.new_full(tail_shape, ignore_index)], dim=dim)
