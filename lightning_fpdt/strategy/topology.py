"""The mesh's sizes and where the sequence-parallel groups fall on the hosts (docs/design.md §5: sequence-parallel
ranks inside one host).

The mesh is ``(data_parallel, sequence_parallel)``, row-major: sequence group ``g`` is the consecutive ranks
``g·sp … g·sp + sp − 1``, and launchers number ranks host by host (host ``n`` holds ranks
``n·d … n·d + d − 1`` for ``d`` devices per host). A group stays inside one host exactly when ``sp`` divides
``d``. Otherwise its FPDT all-to-alls (several per layer and chunk, forward and backward) cross the inter-host
network, several times slower than NVLink inside a host.
"""

from __future__ import annotations

import math
from typing import Literal, Optional, Union

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_fpdt.sequence.heads import HeadSplit
from lightning_fpdt.sequence.options import FPDTOptions
from lightning_fpdt.sequence.sizes import resolve_sequence_sizes

Size = Union[Literal["auto"], int]


def hosts_per_sequence_group(sequence_parallel_size: int, devices_per_node: int) -> int:
    """The most hosts one sequence-parallel group touches (1 when every group stays inside a host)."""
    if sequence_parallel_size < 1 or devices_per_node < 1:
        raise ValueError(
            f"sequence_parallel_size ({sequence_parallel_size}) and devices_per_node ({devices_per_node}) must be >= 1"
        )
    sp, d = sequence_parallel_size, devices_per_node
    # groups start at multiples of sp; the one starting at rank s spans hosts s // d … (s + sp - 1) // d, and the
    # pattern repeats every lcm(sp, d) ranks
    period = math.lcm(sp, d)
    return max((start + sp - 1) // d - start // d + 1 for start in range(0, period, sp))


def sequence_group_layout_warning(
    *, sequence_parallel_size: int, devices_per_node: int, world_size: int
) -> Optional[str]:
    """``None`` when every sequence-parallel group stays inside a host, else the warning naming a faster layout."""
    hosts = hosts_per_sequence_group(sequence_parallel_size, devices_per_node)
    if hosts == 1:
        return None
    sp, d = sequence_parallel_size, devices_per_node
    inside = [p for p in range(min(sp, d), 0, -1) if d % p == 0 and world_size % p == 0]
    faster = inside[0] if inside else 1
    devices = f"{d} device{'s' if d > 1 else ''}"
    return (
        f"fpdt: sequence_parallel_size ({sp}) with {devices} per node puts a sequence-parallel group on {hosts} "
        f"hosts, so its all-to-alls cross the inter-host network (several times slower than NVLink). Faster: "
        f"sequence_parallel_size={faster}, data_parallel_size={world_size // faster} (each group inside one host), "
        f"if a sequence of the length you train fits on {faster} device{'s' if faster > 1 else ''} (more FPDT chunks, "
        f"activation offload); otherwise keep this layout and expect slower steps"
    )


def warn_if_sequence_groups_span_hosts(
    *, sequence_parallel_size: int, devices_per_node: int, world_size: int
) -> Optional[str]:
    """Warn (once, from rank 0) when a sequence-parallel group spans hosts; returns the message or ``None``."""
    message = sequence_group_layout_warning(
        sequence_parallel_size=sequence_parallel_size, devices_per_node=devices_per_node, world_size=world_size
    )
    if message is not None:
        rank_zero_warn(message)
    return message


def resolve_topology(
    *, world_size: int, devices_per_node: int, data_parallel_size: Size, sequence_parallel_size: Size,
    options: FPDTOptions, heads: Optional[tuple[int, int]],
) -> tuple[int, int, int]:
    """``(data_parallel_size, sequence_parallel_size, ring_size)`` of the mesh (:mod:`lightning_fpdt.sequence.sizes`)
    for a model of ``heads = (query, kv)`` heads (``None``: not known), each head group's heads split over the ranks
    when the heads are chunked. Checks the ring against the options, warns when a sequence group would span hosts and
    logs the layout."""
    head_chunks = options.fixed_head_chunks  # "auto" is chosen later, among the values this mesh allows
    dp, sp, ring = resolve_sequence_sizes(
        world_size=world_size, devices_per_node=devices_per_node, data_parallel_size=data_parallel_size,
        sequence_parallel_size=sequence_parallel_size, ring_size=options.ring_size, heads=heads,
        head_chunks=head_chunks, allow_ring=options.allows_ring,
    )
    if heads is not None and head_chunks > 1:
        rank_zero_info(f"fpdt: {heads[0]} query / {heads[1]} kv heads in {head_chunks} head groups")
        heads = (heads[0] // head_chunks, heads[1] // head_chunks)
    options.check_ring(ring)
    # with a ring only the Ulysses groups (U consecutive ranks) all-to-all; the ring's P2P may cross hosts
    warn_if_sequence_groups_span_hosts(
        sequence_parallel_size=sp // ring, devices_per_node=devices_per_node, world_size=world_size
    )
    axes = {"data_parallel": dp, "sequence_parallel": sp}
    if ring > 1:
        axes.update(ring=ring, ulysses=sp // ring)
    rank_zero_info(f"fpdt: mesh {axes}, heads {heads}")
    if heads is not None and ring == 1:
        split = HeadSplit(num_heads=heads[0], num_kv_heads=heads[1], sp_size=sp)
        if not split.even:
            counts = [stop - start for start, stop in split.q_ranges]
            rank_zero_info(f"fpdt: the heads split unevenly over {sp} ranks: {counts} query heads a rank, each with "
                           f"the kv heads they read (the busiest rank's {split.max_heads} set the attention's pace)")
    return dp, sp, ring
