"""Where the sequence-parallel groups fall on the hosts (docs/design.md §5: sequence-parallel ranks inside one host).

The mesh is ``(data_parallel, sequence_parallel)``, row-major: sequence group ``g`` is the consecutive ranks
``g·sp … g·sp + sp − 1``, and launchers number ranks host by host (host ``n`` holds ranks
``n·d … n·d + d − 1`` for ``d`` devices per host). A group stays inside one host exactly when ``sp`` divides
``d``. Otherwise its FPDT all-to-alls (several per layer and chunk, forward and backward) cross the inter-host
network, several times slower than NVLink inside a host.
"""

from __future__ import annotations

import math
from typing import Optional

from lightning.pytorch.utilities import rank_zero_warn


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

