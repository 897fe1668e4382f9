"""Packed documents: where each document of a packed sequence starts, and which attention blocks that leaves.

A packed sequence holds several documents back to back; token ``t`` of document ``d`` may attend only to tokens
``s <= t`` of ``d``. Documents are contiguous ranges of the global sequence, so a sequence's documents are fully
described by their start offsets. :class:`DocumentBoundaries` holds them for every sequence of a batch (computed once
per batch from the *global* sequence, before sharding) and cuts one FPDT block — q range ``[q0, q1)`` against kv
range ``[k0, k1)`` of the global sequence — into per-document segments:

- no document in both ranges: the block is skipped (it contributes nothing);
- one document covering both ranges: the plain block, one kernel call;
- otherwise one kernel call per document in both ranges, on the sub-ranges: causal where the q and kv sub-ranges
  coincide (the diagonal block), full where every key precedes every query (blocks below the diagonal).

Where the ids come from: explicit ``document_ids (B, S)`` (non-decreasing along the sequence), or ``position_ids``
that restart at 0 where a document starts (what :class:`~lightning_fpdt.data.PackedTokenDataset` emits). The padding
the layout appends is a document of its own, so no real token ever attends a pad token.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor


@dataclass(frozen=True)
class Segment:
    """One kernel call of a block: q rows ``[q_start, q_end)`` against keys ``[k_start, k_end)`` (block offsets)."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    causal: bool


@dataclass(frozen=True)
class BlockPlan:
    """The kernel calls of one block for the batch items ``batch_start … batch_end - 1`` (a slice of the batch)."""

    batch_start: int
    batch_end: int
    segments: tuple[Segment, ...]


def _check_tokens_tensor(name: str, ids: Tensor) -> None:
    if ids.dim() != 2 or ids.shape[1] < 1:
        raise ValueError(f"{name} must be (batch, sequence) like input_ids, got shape {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {ids.dtype}")


def document_starts_mask(document_ids: Optional[Tensor] = None, position_ids: Optional[Tensor] = None) -> Tensor:
    """``(B, S)`` bool: True where a document starts (always at token 0).

    From ``document_ids`` (a new document where the id changes; they must be non-decreasing), else from
    ``position_ids`` (a new document where the position is 0). Raises ``ValueError`` naming the fix.
    """
    if document_ids is not None:
        _check_tokens_tensor("document_ids", document_ids)
        step = document_ids[:, 1:] - document_ids[:, :-1]
        if bool((step < 0).any()):
            b, t = (int(x) for x in torch.nonzero(step < 0)[0])
            raise ValueError(
                f"document_ids must be non-decreasing along each sequence (documents are contiguous ranges of the "
                f"packed sequence), but sequence {b} goes from {int(document_ids[b, t])} to "
                f"{int(document_ids[b, t + 1])} at token {t + 1}: number the documents of a sequence 0, 1, 2, … in "
                f"order"
            )
        changes = step != 0
    elif position_ids is not None:
        _check_tokens_tensor("position_ids", position_ids)
        changes = position_ids[:, 1:] == 0
    else:
        raise ValueError("document_starts_mask needs document_ids or position_ids")
    first = torch.ones_like(changes[:, :1])
    return torch.cat([first, changes], dim=1)


def document_ids_from_positions(position_ids: Tensor) -> Tensor:
    """``(B, S)`` document ids numbered 0, 1, … from ``position_ids`` that restart at 0 at every document start."""
    return document_starts_mask(position_ids=position_ids).long().cumsum(dim=1) - 1


def has_position_resets(position_ids: Tensor) -> bool:
    """True when ``position_ids (B, S)`` restart at 0 after the first token anywhere (a packed batch)."""
    return position_ids.dim() == 2 and bool((position_ids[:, 1:] == 0).any())


@dataclass(frozen=True)
class PackedRows:
    """A block's segments as one packed (varlen) call: which ``(batch item, row)`` each packed q and key token is,
    and the cumulative segment lengths. Tensors on the attention's device."""

    q_items: Tensor  # (Nq,) batch item of each packed query
    q_rows: Tensor  # (Nq,) its row in the q chunk
    k_items: Tensor  # (Nk,)
    k_rows: Tensor  # (Nk,)
    cum_q: Tensor  # (num_segments + 1,) int32
    cum_k: Tensor  # (num_segments + 1,) int32
    max_q: int
    max_k: int
    causal: bool


def _packed_indices(items: list[int], starts: list[int], lengths: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    # segment s covers rows starts[s] … starts[s] + lengths[s] - 1 of batch item items[s], packed back to back
    lengths_t = torch.tensor(lengths)
    offsets = torch.cumsum(lengths_t, 0) - lengths_t  # where each segment begins in the packed order
    rows = torch.arange(int(lengths_t.sum())) + (torch.tensor(starts) - offsets).repeat_interleave(lengths_t)
    cum = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(lengths_t, 0).to(torch.int32)])
    return torch.tensor(items).repeat_interleave(lengths_t), rows, cum


@dataclass(frozen=True)
class DocumentBoundaries:
    """Document start offsets of every sequence of a batch, in global token offsets of the (padded) sequence.

    Build it with :meth:`from_document_ids` / :meth:`from_position_ids` on the global sequence, then
    :meth:`padded` to the length the layout pads to; pass it to the FPDT attention (``documents=``).
    """

    starts: tuple[tuple[int, ...], ...]
    """Per sequence of the batch: ascending start offsets, the first 0."""
    seq_len: int
    """The global sequence length these offsets describe."""
    _block_plans: dict = field(default_factory=dict, init=False, compare=False, repr=False)
    """Cache of :meth:`block_plans`: the chunk loops ask for each block several times per layer (which kv chunks a
    q chunk reads, then the block itself, in forward and backward), and every layer asks for the same blocks."""
    _packed_rows: dict = field(default_factory=dict, init=False, compare=False, repr=False)
    """Cache of :meth:`packed_rows` (every layer of a batch asks for the same blocks)."""

    def __post_init__(self) -> None:
        if self.seq_len < 1 or not self.starts:
            raise ValueError(f"DocumentBoundaries needs at least one sequence of >= 1 token, got {self!r}")
        for b, row in enumerate(self.starts):
            if not row or row[0] != 0 or any(x >= y for x, y in zip(row, row[1:])) or row[-1] >= self.seq_len:
                raise ValueError(
                    f"document starts of sequence {b} must ascend strictly from 0 and stay below the sequence "
                    f"length {self.seq_len}, got {row}"
                )

    @classmethod
    def from_starts_mask(cls, starts_mask: Tensor) -> "DocumentBoundaries":
        """From a ``(B, S)`` bool mask of document starts (one host synchronisation for the offsets)."""
        rows, cols = torch.nonzero(starts_mask.cpu(), as_tuple=True)
        starts: list[list[int]] = [[] for _ in range(starts_mask.shape[0])]
        for b, t in zip(rows.tolist(), cols.tolist()):
            starts[b].append(t)
        return cls(tuple(tuple(row) for row in starts), starts_mask.shape[1])

    @classmethod
    def from_document_ids(cls, document_ids: Tensor) -> "DocumentBoundaries":
        """From ``document_ids (B, S)``, non-decreasing along each sequence."""
        return cls.from_starts_mask(document_starts_mask(document_ids=document_ids))

    @classmethod
    def from_position_ids(cls, position_ids: Tensor) -> "DocumentBoundaries":
        """From ``position_ids (B, S)`` that restart at 0 where a document starts."""
        return cls.from_starts_mask(document_starts_mask(position_ids=position_ids))

    @property
    def batch_size(self) -> int:
        return len(self.starts)

    def attention_length(self) -> float:
        """``Σ_d L_d² / S`` averaged over the sequences: the sequence length whose causal attention per token costs
        what these documents' does (``S`` for one document per sequence); what FLOP counts use for ``S``."""
        total = 0
        for row in self.starts:
            ends = row[1:] + (self.seq_len,)
            total += sum((end - start) ** 2 for start, end in zip(row, ends))
        return total / (self.batch_size * self.seq_len)

    def padded(self, padded_len: int) -> "DocumentBoundaries":
        """The boundaries of the sequence right-padded to ``padded_len``: the padding is a document of its own."""
        if padded_len < self.seq_len:
            raise ValueError(f"padded length {padded_len} is shorter than the sequence ({self.seq_len})")
        if padded_len == self.seq_len:
            return self
        return DocumentBoundaries(tuple(row + (self.seq_len,) for row in self.starts), padded_len)

    def document_ids(self, device: Optional[torch.device] = None) -> Tensor:
        """``(B, S)`` document ids 0, 1, … (the pad document included), e.g. for a single-process reference."""
        mask = torch.zeros(self.batch_size, self.seq_len, dtype=torch.long, device=device)
        for b, row in enumerate(self.starts):
            mask[b, list(row)] = 1
        return mask.cumsum(dim=1) - 1

    def _segments(self, row: tuple[int, ...], q0: int, q1: int, k0: int, k1: int) -> tuple[Segment, ...]:
        diagonal = (q0, q1) == (k0, k1)
        # documents overlapping the q range: from the one containing q0 to the one containing q1 - 1
        first, last = bisect.bisect_right(row, q0) - 1, bisect.bisect_right(row, q1 - 1) - 1
        segments = []
        for d in range(first, last + 1):
            doc_start = row[d]
            doc_end = row[d + 1] if d + 1 < len(row) else self.seq_len
            k_start, k_end = max(k0, doc_start), min(k1, doc_end)
            if k_start >= k_end:
                continue  # this document has no key in the kv range
            q_start, q_end = max(q0, doc_start), min(q1, doc_end)
            segments.append(Segment(q_start - q0, q_end - q0, k_start - k0, k_end - k0, causal=diagonal))
        return tuple(segments)

    def block_plans(self, q_range: tuple[int, int], kv_range: tuple[int, int]) -> list[BlockPlan]:
        """The kernel calls of block (q range, kv range): consecutive batch items with equal segments share calls.

        The FPDT schedule has only diagonal blocks (equal ranges) and blocks whose keys all precede their queries.
        An empty list means no item needs the block.
        """
        key = (q_range, kv_range)
        if key not in self._block_plans:
            (q0, q1), (k0, k1) = q_range, kv_range
            assert (q0, q1) == (k0, k1) or k1 <= q0, "blocks are diagonal or below the diagonal"
            assert 0 <= q0 < q1 <= self.seq_len and 0 <= k0 < k1 <= self.seq_len
            plans: list[BlockPlan] = []
            for b, row in enumerate(self.starts):
                segments = self._segments(row, q0, q1, k0, k1)
                if plans and plans[-1].segments == segments and plans[-1].batch_end == b:
                    plans[-1] = BlockPlan(plans[-1].batch_start, b + 1, segments)
                else:
                    plans.append(BlockPlan(b, b + 1, segments))
            self._block_plans[key] = [plan for plan in plans if plan.segments]
        return self._block_plans[key]

    def packed_rows(self, q_range: tuple[int, int], kv_range: tuple[int, int], device: torch.device) -> PackedRows:
        """The segments of :meth:`block_plans` as one varlen call over the whole batch (built once per block)."""
        key = (q_range, kv_range, str(device))
        if key not in self._packed_rows:
            q_items, q_starts, q_lengths, k_items, k_starts, k_lengths = [], [], [], [], [], []
            for plan in self.block_plans(q_range, kv_range):
                for b in range(plan.batch_start, plan.batch_end):
                    for seg in plan.segments:
                        q_items.append(b), q_starts.append(seg.q_start), q_lengths.append(seg.q_end - seg.q_start)
                        k_items.append(b), k_starts.append(seg.k_start), k_lengths.append(seg.k_end - seg.k_start)
            assert q_items, "a skipped block has no packed rows"
            q_b, q_r, cum_q = _packed_indices(q_items, q_starts, q_lengths)
            k_b, k_r, cum_k = _packed_indices(k_items, k_starts, k_lengths)
            self._packed_rows[key] = PackedRows(
                *(x.to(device) for x in (q_b, q_r, k_b, k_r, cum_q, cum_k)), max(q_lengths), max(k_lengths),
                causal=q_range == kv_range,
            )
        return self._packed_rows[key]

    def __repr__(self) -> str:
        shown = [row if len(row) <= 8 else row[:8] + ("…",) for row in self.starts[:4]]
        return f"DocumentBoundaries(seq_len={self.seq_len}, starts={shown}{'…' if len(self.starts) > 4 else ''})"
