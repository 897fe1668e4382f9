"""Head groups (``FPDTStrategy(head_chunks=G)``, docs/head_chunks.md): the attention's projections and FPDT calls run
on ``H/G`` query heads at a time, so its full-width q, k, v and output never exist at once. Their terms are the
attention phases' (:mod:`lightning_fpdt.planner.phases`), written with ``G``."""

from __future__ import annotations

from typing import Any

from lightning_fpdt.planner.cost import FORWARD, attention_gemms, attention_seconds, gemm_seconds
from lightning_fpdt.planner.features.base import Flag, MemoryFeature, auto_or_int
from lightning_fpdt.planner.rates import GROUP_SLOWDOWN
from lightning_fpdt.planner.step_sizes import StepSizes
from lightning_fpdt.sequence.ring_rules import ring_choices
from lightning_fpdt.sequence.sizes import valid_head_chunks


class HeadGroups(MemoryFeature):
    fields = ("head_chunks",)
    neutral = {"head_chunks": 1}
    flags = (Flag(option="head_chunks", parse=auto_or_int, default="auto",
                  help="head groups G: attention projections and FPDT calls per group of H/G query heads"),)

    def describe_cost(self, s: StepSizes) -> str:
        return f"head groups: {s.G} smaller attention calls, each group's projections run again"

    def choices(self, field: str, s: StepSizes) -> tuple[Any, ...]:
        valid = tuple(valid_head_chunks(s.g.num_heads, s.g.num_kv_heads, s.P))
        return ring_choices("head_chunks", s.o.ring_size, valid)

    def extra_seconds(self, s: StepSizes) -> float:
        if s.G == 1:
            return 0.0
        # each group's q/k/v projections run again in its backward (narrower GEMMs, at their own rates); the
        # attention in G calls of H/G heads against all heads at once (measured where the GPU was calibrated)
        projections = s.L * gemm_seconds(s, attention_gemms(s)[:3], FORWARD)
        calls = 0.0 if s.rates.calibrated else GROUP_SLOWDOWN * (s.G - 1) * attention_seconds(s)  # the table's rule
        return projections + attention_seconds(s) - attention_seconds(s, groups=1) + calls

    def arguments(self, s: StepSizes) -> dict[str, dict[str, Any]]:
        return {"FPDTStrategy": {"head_chunks": s.G}}
