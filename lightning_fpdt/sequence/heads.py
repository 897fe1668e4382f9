"""Which query and kv heads each rank of a sequence-parallel group attends for (docs/design.md §4, "Heads").

Ulysses gives each of the ``P`` ranks a contiguous block of the ``H`` query heads: ``⌈H/P⌉`` heads on the first
``H mod P`` ranks, ``⌊H/P⌋`` on the others (``H/P`` each when ``P`` divides ``H``). Under GQA query head ``h`` reads
kv head ``h // (H/Hkv)``, so a rank receives the contiguous block of kv heads its query heads read: a kv head is sent
to every rank that needs it (when ``Hkv < P``, or when a rank's query heads straddle two kv heads), and the backward
sums the gradients of those copies back into the kv head (the sum that makes the split exact).

One definition, used by the all-to-all (``sequence/all_to_all.py``: the head ranges each rank sends and receives),
the attention (``sequence/fpdt.py``: which local kv head each local query head reads), the sizes and the planner (the
busiest rank's ``⌈H/P⌉`` heads) and the tests.

The *even* split (``P`` divides ``H``, and ``Hkv`` and ``P`` divide one another) is the one every rank's blocks have
the same shape in: it runs the equal-split all-to-all, replicating each kv head ``P/Hkv`` times before it when
``P > Hkv`` (:attr:`HeadSplit.kv_repeat`). Every other split runs the all-to-all of unequal head blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_fpdt.flops import is_count

HeadRanges = tuple[tuple[int, int], ...]
"""``[start, stop)`` of the heads of one tensor that each rank holds after the all-to-all, indexed by rank."""


@dataclass(frozen=True, kw_only=True)
class HeadSplit:
    """The heads of ``num_heads`` query and ``num_kv_heads`` kv heads over ``sp_size`` ranks.

    ``HeadSplit(num_heads=14, num_kv_heads=2, sp_size=4)``: ranks hold query heads ``0-3, 4-7, 8-10, 11-13`` and kv
    heads ``0, 0-1, 1, 1`` (query heads 0-6 read kv head 0, 7-13 kv head 1).
    """

    num_heads: int
    """``H``: query heads of the layer (or of one head group)."""
    num_kv_heads: int
    """``Hkv``: kv heads; ``H`` must be a multiple of it."""
    sp_size: int
    """``P``: ranks of the sequence-parallel (Ulysses) group."""

    def __post_init__(self) -> None:
        H, Hkv, P = self.num_heads, self.num_kv_heads, self.sp_size
        for name, value in (("num_heads", H), ("num_kv_heads", Hkv), ("sequence_parallel_size", P)):
            if not is_count(value):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if H % Hkv:
            raise ValueError(f"num_heads ({H}) must be a multiple of num_kv_heads ({Hkv})")
        if H < P:
            raise ValueError(
                f"num_heads ({H}) < sequence_parallel_size ({P}): Ulysses gives every rank at least one query head; "
                f"use a sequence_parallel_size <= {H}, or a ring (ring_size > 1: P / ring_size Ulysses ranks)"
            )

    @property
    def group_size(self) -> int:
        """Query heads per kv head (``H/Hkv``)."""
        return self.num_heads // self.num_kv_heads

    @property
    def even(self) -> bool:
        """Every rank's blocks have one shape: ``P`` divides ``H``, and ``Hkv`` and ``P`` divide one another."""
        H, Hkv, P = self.num_heads, self.num_kv_heads, self.sp_size
        return H % P == 0 and (Hkv % P == 0 or P % Hkv == 0)

    @property
    def kv_repeat(self) -> int:
        """The even split's replication of each kv head before the equal all-to-all (``P/Hkv`` when ``P > Hkv``);
        1 for an uneven split, whose all-to-all sends each rank its kv heads itself."""
        if self.even and self.num_kv_heads < self.sp_size:
            return self.sp_size // self.num_kv_heads
        return 1

    def q_range(self, rank: int) -> tuple[int, int]:
        """``[start, stop)`` of rank ``rank``'s query heads: ``⌈H/P⌉`` on the first ``H mod P`` ranks."""
        base, extra = divmod(self.num_heads, self.sp_size)
        start = rank * base + min(rank, extra)
        return start, start + base + (rank < extra)

    def kv_range(self, rank: int) -> tuple[int, int]:
        """``[start, stop)`` of the kv heads rank ``rank``'s query heads read."""
        start, stop = self.q_range(rank)
        return start // self.group_size, (stop - 1) // self.group_size + 1

    @property
    def q_ranges(self) -> HeadRanges:
        return tuple(self.q_range(r) for r in range(self.sp_size))

    @property
    def kv_ranges(self) -> HeadRanges:
        return tuple(self.kv_range(r) for r in range(self.sp_size))

    @property
    def max_heads(self) -> int:
        """``⌈H/P⌉``: query heads of the busiest rank (what the planner counts)."""
        return -(-self.num_heads // self.sp_size)

    @property
    def max_kv_heads(self) -> int:
        """kv heads of the busiest rank after the all-to-all."""
        return max(stop - start for start, stop in self.kv_ranges)

    def ranges(self, *kinds: str) -> Optional[tuple[HeadRanges, ...]]:
        """The head ranges of tensors of the given kinds (``"q"`` or ``"kv"``) for the all-to-all; ``None`` for the
        even split (the equal-split all-to-all needs none)."""
        if self.even:
            return None
        table = {"q": self.q_ranges, "kv": self.kv_ranges}
        return tuple(table[kind] for kind in kinds)

    def local_kv_index(self, rank: int) -> Optional[tuple[int, ...]]:
        """For each of rank ``rank``'s query heads, the index of the kv head it reads among the rank's kv heads;
        ``None`` when that is the kernels' own grouping (local query head ``i`` reads local kv head
        ``i // (h/hkv)``), which they compute without help."""
        q_start, q_stop = self.q_range(rank)
        kv_start, kv_stop = self.kv_range(rank)
        index = tuple(h // self.group_size - kv_start for h in range(q_start, q_stop))
        heads, kv_heads = q_stop - q_start, kv_stop - kv_start
        if heads % kv_heads == 0 and index == tuple(i // (heads // kv_heads) for i in range(heads)):
            return None
        return index
