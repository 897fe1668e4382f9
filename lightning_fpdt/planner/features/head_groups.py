"""Head groups (``FPDTStrategy(head_chunks=G)``, docs/head_chunks.md): the attention's projections and FPDT calls run
on ``H/G`` query heads at a time, so its full-width q, k, v and output never exist at once. Their terms are the
attention phases' (:mod:`lightning_fpdt.planner.phases`), written with ``G``."""

from __future__ import annotations

from typing import Any

from lightning_fpdt.planner.cost import attention_seconds, dense_forward_seconds
from lightning_fpdt.planner.features.base import Flag, MemoryFeature, auto_or_int
from lightning_fpdt.planner.sizes import StepSizes
from lightning_fpdt.sequence.ring_rules import ring_choices
from lightning_fpdt.sequence.sizes import valid_head_chunks

GROUP_SLOWDOWN = 0.02
"""Share of the attention's time each group beyond the first adds (smaller calls: +6% at ``G = 4`` on an H100)."""


class HeadGroups(MemoryFeature):
    fields = ("head_chunks",)
    neutral = {"head_chunks": 1}
    flags = (Flag(option="head_chunks", parse=auto_or_int, default="auto",
                  help="head groups G: attention projections and FPDT calls per group of H/G query heads"),)

    def describe_cost(self, s: StepSizes) -> str:
        return f"head groups: {s.G} smaller attention calls, each group's projections run again"

    def choices(self, field: str, s: StepSizes) -> tuple[Any, ...]:
        return ring_choices("head_chunks", s.o.ring_size, tuple(valid_head_chunks(s.g.num_heads, s.g.num_kv_heads, s.P)))

    def extra_seconds(self, s: StepSizes) -> float:
        if s.G == 1:
            return 0.0
        g = s.g
        # each group's q/k/v projections run again in its backward; the smaller attention calls
        projections = s.L * g.hidden_size * (g.num_heads + 2 * g.num_kv_heads) * g.head_dim
        return dense_forward_seconds(s, projections) + attention_seconds(s) * GROUP_SLOWDOWN * (s.G - 1)

    def arguments(self, s: StepSizes) -> dict[str, dict[str, Any]]:
        return {"FPDTStrategy": {"head_chunks": s.G}}
