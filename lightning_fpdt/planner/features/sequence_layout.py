"""The layout of a sequence-parallel group (``FPDTStrategy(ring_size=...)``): how its ``P`` ranks split into ``R``
ring ranks of ``U = P/R`` Ulysses ranks. No memory of its own (the attention's terms count ``U`` and ``R``); what it
owns is the time the traffic between GPUs adds where a group spans hosts (:func:`~..cost.network_seconds`).

Inside one host the layout is the one the heads need (:func:`~lightning_fpdt.sequence.sizes.resolve_ring_size`), and
the search keeps it. A group spanning hosts may run any ring the heads allow
(:func:`~lightning_fpdt.sequence.sizes.ring_sizes`): the search compares them by the step-time estimate among those
that fit (:func:`~lightning_fpdt.planner.search.fastest_fitting`).
"""

from __future__ import annotations

from typing import Any

from lightning_fpdt.planner.cost import network_seconds, ring_network_seconds, ulysses_leaving_bytes
from lightning_fpdt.planner.features.base import MemoryFeature
from lightning_fpdt.planner.step_sizes import StepSizes
from lightning_fpdt.sequence.sizes import ring_sizes


def spans_hosts(s: StepSizes) -> bool:
    """Whether a sequence-parallel group of the run is larger than a host."""
    return s.P > s.gpus_per_node


class SequenceLayoutFeature(MemoryFeature):
    fields = ("ring_size",)
    label = "the network between hosts"

    def choices(self, field: str, s: StepSizes) -> tuple[Any, ...]:
        if spans_hosts(s):
            return tuple(ring_sizes(s.P, (s.g.num_heads, s.g.num_kv_heads)))
        return (s.o.ring_size,)

    def extra_seconds(self, s: StepSizes) -> float:
        return network_seconds(s)

    def describe_cost(self, s: StepSizes) -> str:
        parts = []
        ulysses = s.P // s.o.ring_size
        if ulysses_leaving_bytes(s):
            parts.append(f"Ulysses all-to-alls across hosts ({ulysses - s.gpus_per_node} of {ulysses - 1} peers on "
                         f"other hosts, {s.inter_host_rate / 1e9:g} GB/s)")
        if ring_network_seconds(s):
            where = f"across hosts, {s.inter_host_rate / 1e9:g} GB/s" if spans_hosts(s) else "over NVLink"
            parts.append(f"ring K/V passes not hidden by its blocks ({where})")
        return "the network: " + " and ".join(parts)

    def arguments(self, s: StepSizes) -> dict[str, dict[str, Any]]:
        # a group spanning hosts: the strategy's "auto" does not know the length or the network, so the plan says
        return {"FPDTStrategy": {"ring_size": s.o.ring_size}} if spans_hosts(s) else {}
