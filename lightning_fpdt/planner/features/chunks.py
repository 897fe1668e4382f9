"""FPDT chunks per rank (``FPDTStrategy(chunks=...)``): more chunks, a smaller working set of the attention's forward
and backward, and smaller attention blocks, more of them (slower where the rates say so)."""

from __future__ import annotations

import math
from typing import Any

from lightning_fpdt.planner.cost import attention_seconds, fewest_chunks
from lightning_fpdt.planner.features.base import Flag, MemoryFeature, auto_or_int
from lightning_fpdt.planner.step_sizes import StepSizes
from lightning_fpdt.sequence.planning import MAX_CHUNK_TOKENS
from lightning_fpdt.sequence.ring_rules import ring_choices

MIN_CHUNK_TOKENS = 8192
"""The search halves chunks down to this many global tokens per chunk, not further (a choice: smaller attention
blocks were not measured; the benchmarks use 32K and 64K)."""


class Chunks(MemoryFeature):
    fields = ("chunks",)
    label = "chunks smaller than the kernels' full speed"
    flags = (Flag(option="chunks", parse=auto_or_int, default="auto", help="FPDT chunks per rank"),)

    def choices(self, field: str, s: StepSizes) -> tuple[Any, ...]:
        if s.o.ring_size > 1:
            return ring_choices("chunks", s.o.ring_size, ())
        chunks = max(1, math.ceil(s.seq_len / MAX_CHUNK_TOKENS))
        values = [chunks]
        while s.seq_len / (2 * chunks) >= max(MIN_CHUNK_TOKENS, s.P):
            chunks *= 2
            values.append(chunks)
        return tuple(sorted(set(values) | {s.o.chunks}))

    def extra_seconds(self, s: StepSizes) -> float:
        # the attention's schedule with these chunks against the fewest (smaller blocks, more of them, more merges):
        # measured block by block where the GPU was calibrated (the built-in table slows smaller blocks down)
        fewest = fewest_chunks(s)
        return attention_seconds(s, groups=1) - attention_seconds(s, chunks=fewest, groups=1)

    def arguments(self, s: StepSizes) -> dict[str, dict[str, Any]]:
        return {"FPDTStrategy": {"chunks": s.o.chunks}}
