"""Partial residency of block inputs (``ActivationOffload(keep_inputs=k)``, memory/block_offload.py): only ``k``
block inputs, evenly spaced, wait for their backward; the others are regenerated in the backward by a forward from
the nearest kept one. The inputs held at once, ``k + ⌈L/k⌉ - 1`` instead of ``L``, are the block inputs' own term
(:attr:`StepSizes.resident_inputs`, read by :mod:`.block_inputs`); this feature owns what the regeneration adds:
the GPU memory of a forward run inside the backward, and its time.

The option is ``keep_inputs``, as ``ActivationOffload`` takes it: ``"all"`` keeps every input (no regeneration), a
count ``1 <= k < L`` keeps that many."""

from __future__ import annotations

import math
from typing import Any, Optional

from lightning_fpdt.memory.block_schedule import largest_segment
from lightning_fpdt.planner.components import Component
from lightning_fpdt.planner.cost import (
    attention_forward_seconds,
    block_forward_seconds,
    compute_seconds,
    exposed_copy_seconds,
)
from lightning_fpdt.planner.features.base import Flag, MemoryFeature, all_or_count
from lightning_fpdt.planner.step_sizes import StepSizes


def kept_input_choices(num_layers: int) -> tuple[int, ...]:
    """Counts worth trying, most kept (cheapest) first: about ``L/2``, ``L/4`` and ``⌈√L⌉`` (where
    ``k + ⌈L/k⌉ - 1``, the inputs held, is smallest; fewer kept hold more), each raised to the largest count that
    holds no more inputs (fewer regenerated blocks for the same memory). Three at most: each multiplies the search."""
    def held(k: int) -> int:
        return k + largest_segment(num_layers, k)

    counts = set()
    for k in (num_layers // 2, num_layers // 4, math.ceil(math.sqrt(num_layers))):
        if 1 <= k < num_layers:
            while k + 1 < num_layers and held(k + 1) <= held(k):
                k += 1
            counts.add(k)
    return tuple(sorted(counts, reverse=True))


class Residency(MemoryFeature):
    fields = ("keep_inputs",)
    neutral = {"keep_inputs": "all"}
    flags = (Flag(option="keep_inputs", parse=all_or_count("block inputs"), default="auto",
                  help="ActivationOffload(keep_inputs=...): all, a number k of block inputs kept (the others "
                       "regenerated in the backward: k + ceil(L/k) - 1 held instead of L), or auto"),)

    def describe_cost(self, s: StepSizes) -> str:
        regenerated = s.L - s.o.keep_inputs
        return (f"partial residency: {regenerated} block forwards regenerated in the backward"
                + (" (their attention too)" if s.o.recompute_attention else ""))

    def choices(self, field: str, s: StepSizes) -> tuple[Any, ...]:
        given = () if s.o.keep_inputs == "all" else (s.o.keep_inputs,)
        return ("all", *sorted(set(kept_input_choices(s.L)) | set(given), reverse=True))

    def normalise(self, changes: dict[str, Any]) -> Optional[dict[str, Any]]:
        if not changes["activation_checkpointing"]:
            changes["keep_inputs"] = "all"  # no block inputs wait for a backward
        return changes

    def components(self, s: StepSizes) -> list[Component]:
        if not s.o.activation_checkpointing or s.o.keep_inputs == "all":
            return []
        # the regenerating forward runs a block forward (the attention-forward phase's terms, which stand for it)
        # inside the backward: beside it the gradient into the block in backward, the lm_head gradient, the block in
        # backward gathered (one more than the forward's two) and one block's gradients in their reduce-scatter
        d, V, h = s.dtypes, s.g.vocab_size, s.g.hidden_size
        extra = s.A + V * h * s.b + s.block_parameters * (2 * d["param"] + d["reduce"])
        return [Component("regenerating forward (in the backward)", extra, phase="attention forward",
                          formula="grad into the block + lm_head grad + a block gathered + one block's gradients")]

    def extra_seconds(self, s: StepSizes) -> float:
        o = s.o
        if not o.activation_checkpointing or o.keep_inputs == "all":
            return 0.0
        regenerated = s.L - o.keep_inputs  # each regenerated input is one block's forward run again
        seconds = regenerated * block_forward_seconds(s)
        if o.recompute_attention:
            seconds += attention_forward_seconds(s) * regenerated / s.L  # nothing recorded: computed again
        # the recorded output comes back from the host; each regenerated input goes to the host and back
        moved = regenerated * ((s.out if o.offload and not o.recompute_attention else 0)
                               + (2 * s.A if o.activation_offload else 0))
        return seconds + exposed_copy_seconds(s, moved, compute_seconds(s) * regenerated / s.L) if moved else seconds

    def arguments(self, s: StepSizes) -> dict[str, dict[str, Any]]:
        if not s.o.activation_checkpointing:
            return {}
        return {"ActivationOffload": {"keep_inputs": s.o.keep_inputs}}
