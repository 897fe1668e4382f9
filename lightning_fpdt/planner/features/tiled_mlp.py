"""The MLP over token tiles (``TiledMLP``): its backward holds one tile's intermediate buffers, not all tokens'."""

from __future__ import annotations

from typing import Any

from lightning_fpdt.planner.components import MLP_BACKWARD_BUFFERS, MLP_GRAD_SUM_BYTES, Component, mlp_tile_tokens
from lightning_fpdt.planner.cost import mlp_forward_seconds
from lightning_fpdt.planner.features.base import MemoryFeature
from lightning_fpdt.planner.step_sizes import StepSizes


def mlp_backward_work(s: StepSizes, *, tiled: bool) -> int:
    """The MLP backward's buffers beyond what its forward saved: one tile's (with the fp32 weight-gradient sums over
    the tiles) or all tokens'."""
    g = s.g
    rows = mlp_tile_tokens(s.N, g.intermediate_size, s.b) if tiled else s.N
    saved = 0 if tiled else s.with_options(tiled_mlp=False).mlp_saved
    work = MLP_BACKWARD_BUFFERS * rows * g.intermediate_size * s.b - saved
    if tiled:  # the fp32 sums of the gate, up and down weight gradients over the tiles
        work += 3 * g.hidden_size * g.intermediate_size * MLP_GRAD_SUM_BYTES
    return work


class TiledMLPFeature(MemoryFeature):
    fields = ("tiled_mlp",)
    label = "tiled MLP: each tile's forward run again in its backward"

    def choices(self, field: str, s: StepSizes) -> tuple[Any, ...]:
        return (False, True)

    def components(self, s: StepSizes) -> list[Component]:
        tiled = s.o.tiled_mlp
        return [Component("MLP backward", 2 * s.A + mlp_backward_work(s, tiled=tiled), phase="MLP backward",
                          formula=f"grads in/out + {'one tile' if tiled else 'all tokens'} x {MLP_BACKWARD_BUFFERS} x I"
                          + (" + fp32 weight-gradient sums" if tiled else ""))]

    def extra_seconds(self, s: StepSizes) -> float:
        # the backward recomputes each tile's forward; under checkpointing the recompute skips the MLP's value
        # (memory/block_offload.py), so the MLP's forward still runs twice a step
        if not s.o.tiled_mlp or s.o.activation_checkpointing:
            return 0.0
        return s.L * mlp_forward_seconds(s)

    def arguments(self, s: StepSizes) -> dict[str, dict[str, Any]]:
        return {"TiledMLP": {}} if s.o.tiled_mlp else {}
