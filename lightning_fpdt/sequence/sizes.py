"""The sizes of a sequence-parallel run: data-parallel, sequence-parallel and ring ranks, and head groups.

Pure arithmetic on the head counts and the world, with no process group and no Lightning: the strategy resolves its
mesh with it, and the planner plans the same sizes. Ulysses (FPDT) splits the heads over up to ``H`` ranks, evenly or
not (:class:`~lightning_fpdt.sequence.heads.HeadSplit`: ``⌈H/P⌉`` or ``⌊H/P⌋`` query heads a rank), so
``sequence_parallel_size="auto"`` takes every GPU of a node up to ``H`` (the all-to-all wants NVLink); an explicit
size beyond ``H`` turns on the Ulysses × ring hybrid (``ring_size="auto"``: the smallest ring whose Ulysses size
splits the heads evenly, which the ring's Ulysses level needs; for a group spanning hosts the smallest whose Ulysses
groups stay inside a host), and an explicit ``ring_size`` keeps the ring at any size. Head groups (``G``) split each
group's ``H/G`` query and ``Hkv/G`` kv heads over the ranks (docs/design.md §5, docs/ring.md, docs/head_chunks.md).
"""

from __future__ import annotations

from typing import Optional, Union

from lightning_fpdt.sequence.blocks import check_heads, heads_allow
from lightning_fpdt.sequence.heads import HeadSplit
from lightning_fpdt.sequence.options import check_auto_or_positive_int, check_positive_int
from lightning_fpdt.sequence.ring_rules import check_ring


def resolve_sizes(
    *,
    world_size: int,
    devices_per_node: int,
    data_parallel_size: Union[str, int],
    sequence_parallel_size: Union[str, int],
    heads: Optional[tuple[int, int]] = None,
    ring_size: Union[str, int] = "auto",
) -> tuple[int, int]:
    """``(dp, sp)`` from the options; ``"auto"`` sequence parallelism is the largest size within one node that the
    heads allow (the all-to-all wants NVLink; up to ``H`` ranks, the split uneven where it must) with ``ring_size``
    ring ranks (``"auto"``: without a ring, so "auto" never turns the ring on by itself), ``"auto"`` data
    parallelism takes the rest. An explicit size is checked against the heads by :func:`resolve_ring_size`."""
    check_auto_or_positive_int("data_parallel_size", data_parallel_size)
    check_auto_or_positive_int("sequence_parallel_size", sequence_parallel_size)
    if sequence_parallel_size == "auto":
        if data_parallel_size != "auto":
            if world_size % data_parallel_size:
                raise ValueError(
                    f"data_parallel_size ({data_parallel_size}) does not divide the world size {world_size}"
                )
            sequence_parallel_size = world_size // data_parallel_size
        else:
            ring = ring_size if isinstance(ring_size, int) else 1
            candidates = [p for p in range(devices_per_node, 0, -1)
                          if world_size % p == 0 and devices_per_node % p == 0 and p % ring == 0]
            if not candidates:
                raise ValueError(
                    f"ring_size ({ring}) divides no sequence_parallel_size that divides both the world size "
                    f"{world_size} and the devices per node {devices_per_node}: give sequence_parallel_size "
                    f"explicitly (a ring may span hosts) or another ring_size"
                )
            sequence_parallel_size = next(
                (p for p in candidates if heads is None or ulysses_allows(*heads, p // ring, ring_size=ring)),
                candidates[-1]
            )
    if data_parallel_size == "auto":
        if world_size % sequence_parallel_size:
            raise ValueError(
                f"sequence_parallel_size ({sequence_parallel_size}) does not divide the world size {world_size}"
            )
        data_parallel_size = world_size // sequence_parallel_size
    if data_parallel_size * sequence_parallel_size != world_size:
        raise ValueError(
            f"sequence_parallel_size ({sequence_parallel_size}) * data_parallel_size ({data_parallel_size}) = "
            f"{sequence_parallel_size * data_parallel_size} != world size {world_size}"
        )
    resolve_ring_size(sequence_parallel_size=sequence_parallel_size, ring_size=ring_size, heads=heads)
    return data_parallel_size, sequence_parallel_size


def resolve_sequence_sizes(
    *,
    world_size: int,
    devices_per_node: int,
    data_parallel_size: Union[str, int],
    sequence_parallel_size: Union[str, int],
    ring_size: Union[str, int],
    heads: Optional[tuple[int, int]],
    head_chunks: int = 1,
    allow_ring: bool = True,
) -> tuple[int, int, int]:
    """``(dp, sp, R)`` as the strategy runs them, and as the planner plans them: with ``head_chunks`` G > 1 each head
    group's ``H/G`` query and ``Hkv/G`` kv heads split over the ranks, so the sizes are resolved for one group's
    heads (:func:`check_head_groups` names the valid G first), and G is refused with a ring (not composed yet)."""
    if heads is not None and head_chunks > 1:
        explicit = sequence_parallel_size if isinstance(sequence_parallel_size, int) else 1
        check_head_groups(*heads, head_chunks, explicit)
        heads = (heads[0] // head_chunks, heads[1] // head_chunks)
    dp, sp = resolve_sizes(world_size=world_size, devices_per_node=devices_per_node,
                           data_parallel_size=data_parallel_size, sequence_parallel_size=sequence_parallel_size,
                           heads=heads, ring_size=ring_size)
    ring = resolve_ring_size(sequence_parallel_size=sp, ring_size=ring_size, heads=heads,
                             devices_per_node=devices_per_node, allow_ring=allow_ring and head_chunks == 1)
    check_ring(ring, head_chunks=head_chunks)
    return dp, sp, ring


def resolve_ring_size(
    *, sequence_parallel_size: int, ring_size: Union[str, int], heads: Optional[tuple[int, int]] = None,
    devices_per_node: Optional[int] = None, allow_ring: bool = True,
) -> int:
    """``R``: ring ranks of the 2-D sequence mesh (``P = U·R``, docs/ring.md).

    ``"auto"``: ``1`` (plain Ulysses/FPDT, the heads split unevenly where ``P`` does not divide them) when
    ``P <= H``, else the smallest ``R`` whose ``U = P/R`` splits the heads evenly (``H % U == 0`` and ``Hkv``, ``U``
    dividing one another, as :func:`check_heads` says: the ring's Ulysses level is even). A group larger than
    ``devices_per_node`` (it spans hosts) takes :func:`spanning_ring_size`, the layout the planner's step-time
    estimate picks for it at long sequences on a network slower than NVLink (the planner, which knows the length,
    the memory and the network, compares every :func:`ring_sizes` by that estimate). ``allow_ring=False`` (options
    that do not compose with a ring were given: FPDT chunks, head groups) keeps an ``"auto"`` ring off where the heads
    allow that. An int is checked: it must divide ``P`` and leave a ``U`` the heads allow (any ``U <= H`` for
    ``R = 1``, an even one for ``R > 1``).
    """
    P = sequence_parallel_size
    if ring_size == "auto":
        if heads is None:
            return 1
        allowed = ring_sizes(P, heads)
        if not allowed:  # only when num_heads % num_kv_heads != 0: let check_heads say so
            check_heads(*heads, 1)
        if not allow_ring and allowed[0] == 1:
            return 1
        if devices_per_node is not None and P > devices_per_node:
            return spanning_ring_size(P, heads, devices_per_node)
        return allowed[0]
    check_auto_or_positive_int("ring_size", ring_size)
    if P % ring_size:
        raise ValueError(
            f"ring_size ({ring_size}) does not divide sequence_parallel_size ({P}): the sequence-parallel ranks are "
            f"ring_size x ulysses ranks; use a ring_size in {[r for r in range(1, P + 1) if P % r == 0]}"
        )
    if heads is not None:
        try:
            if ring_size == 1:
                HeadSplit(num_heads=heads[0], num_kv_heads=heads[1], sp_size=P)
            else:
                check_heads(*heads, P // ring_size)
        except ValueError as error:
            allowed = ring_sizes(P, heads)
            raise ValueError(
                f"sequence_parallel_size ({P}) / ring_size ({ring_size}) = {P // ring_size} Ulysses ranks: {error}; "
                f"ring sizes the heads allow: {allowed} (or ring_size='auto')"
            ) from error
    return ring_size


def ring_sizes(sequence_parallel_size: int, heads: tuple[int, int]) -> list[int]:
    """Every ``R`` a group of ``P`` ranks may run with these heads, smallest first: ``R`` divides ``P`` and the heads
    split over ``U = P/R`` (any split without a ring, an even one with one): the layouts "auto" chooses among."""
    P = sequence_parallel_size
    return [r for r in range(1, P + 1) if P % r == 0 and ulysses_allows(*heads, P // r, ring_size=r)]


def spanning_ring_size(sequence_parallel_size: int, heads: tuple[int, int], devices_per_node: int) -> int:
    """``R`` of a group spanning hosts when nothing but the sizes is known (the strategy's mesh): the smallest ring
    whose Ulysses groups stay inside a host (``U`` divides ``devices_per_node``) and split the heads evenly. Then the
    all-to-alls run over NVLink and only the ring's K/V passes cross the network, where they hide behind the ring's
    blocks at long sequences; a Ulysses group spanning hosts puts a share of every all-to-all on the network instead.
    The planner's step-time estimate (``lightning_fpdt.planner.cost.network_seconds``) ranks the layouts so at long
    sequences on a network slower than NVLink; at other lengths and networks ``lightning-fpdt plan`` may pick
    another ring, which ``ring_size`` then fixes (docs/multi_node.md)."""
    P = sequence_parallel_size
    inside = [r for r in ring_sizes(P, heads) if devices_per_node % (P // r) == 0]
    return inside[0] if inside else ring_sizes(P, heads)[0]


def ulysses_allows(num_heads: int, num_kv_heads: int, ulysses_size: int, *, ring_size: int = 1) -> bool:
    """Whether the heads split over ``ulysses_size`` ranks: any split of ``H >= U`` heads without a ring
    (:class:`HeadSplit`), an even one (:func:`heads_allow`) under a ring of ``ring_size > 1``."""
    if ring_size > 1:
        return heads_allow(num_heads, num_kv_heads, ulysses_size)
    return num_heads % num_kv_heads == 0 and num_heads >= ulysses_size


def valid_head_chunks(num_heads: int, num_kv_heads: int, sp_size: int) -> list[int]:
    """The head group counts ``G`` the heads allow on ``sp_size`` ranks (each group's heads split like a layer's,
    unevenly where ``P`` does not divide them: ``G`` divides ``Hkv`` and leaves ``H/G >= P``)."""
    return [groups for groups in range(1, num_kv_heads + 1)
            if num_kv_heads % groups == 0 and ulysses_allows(num_heads // groups, num_kv_heads // groups, sp_size)]


def check_head_groups(num_heads: int, num_kv_heads: int, head_chunks: int, sp_size: int) -> int:
    """Validate ``head_chunks`` for the head geometry on ``sp_size`` ranks; returns the even split's kv replication
    of each group (1 for an uneven split: :class:`HeadSplit` applies per group, ``H/G`` query and ``Hkv/G`` kv heads
    against ``P`` ranks)."""
    check_positive_int("head_chunks", head_chunks)
    check_heads(num_heads, num_kv_heads, 1)  # H a multiple of Hkv
    valid = valid_head_chunks(num_heads, num_kv_heads, sp_size)
    if num_kv_heads % head_chunks:
        raise ValueError(
            f"head_chunks ({head_chunks}) must divide num_kv_heads ({num_kv_heads}): each head group holds whole kv "
            f"heads together with the query heads that read them; with sequence_parallel_size {sp_size} use "
            f"head_chunks in {valid}"
        )
    heads, kv_heads = num_heads // head_chunks, num_kv_heads // head_chunks
    if heads < sp_size:
        raise ValueError(
            f"num_heads ({num_heads}) / head_chunks ({head_chunks}) = {heads} query heads per group is fewer than "
            f"sequence_parallel_size ({sp_size}): Ulysses gives every rank at least one head of each group; use "
            f"head_chunks in {valid} (or a smaller sequence_parallel_size)"
        )
    return HeadSplit(num_heads=heads, num_kv_heads=kv_heads, sp_size=sp_size).kv_repeat
