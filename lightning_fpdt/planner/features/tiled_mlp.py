"""The MLP over token tiles (``TiledMLP``): its backward holds one tile's intermediate buffers, not all tokens'."""

from __future__ import annotations

from typing import Any

from lightning_fpdt.planner.components import MLP_BACKWARD_BUFFERS, MLP_GRAD_SUM_BYTES, Component, mlp_tile_tokens
from lightning_fpdt.planner.cost import dense_forward_seconds
from lightning_fpdt.planner.features.base import MemoryFeature
from lightning_fpdt.planner.sizes import StepSizes


class TiledMLPFeature(MemoryFeature):
    fields = ("tiled_mlp",)
    label = "tiled MLP: each tile's forward run again in its backward"

    def choices(self, field: str, s: StepSizes) -> tuple[Any, ...]:
        return (False, True)

    def components(self, s: StepSizes) -> list[Component]:
        g, tiled = s.g, s.o.tiled_mlp
        rows = mlp_tile_tokens(s.N, g.intermediate_size, s.b) if tiled else s.N
        work = MLP_BACKWARD_BUFFERS * rows * g.intermediate_size * s.b - s.mlp_saved
        if tiled:  # the fp32 sums of the gate, up and down weight gradients over the tiles
            work += 3 * g.hidden_size * g.intermediate_size * MLP_GRAD_SUM_BYTES
        return [Component("MLP backward", 2 * s.A + work, phase="MLP backward",
                          formula=f"grads in/out + {'one tile' if tiled else 'all tokens'} x {MLP_BACKWARD_BUFFERS} x I"
                          + (" + fp32 weight-gradient sums" if tiled else ""))]

    def extra_seconds(self, s: StepSizes) -> float:
        # the backward recomputes each tile's forward; under checkpointing the recompute skips the MLP's value
        # (memory/block_offload.py), so the MLP's forward still runs twice a step
        if not s.o.tiled_mlp or s.o.activation_checkpointing:
            return 0.0
        return dense_forward_seconds(s, s.L * 3 * s.g.hidden_size * s.g.intermediate_size)

    def arguments(self, s: StepSizes) -> dict[str, dict[str, Any]]:
        return {"TiledMLP": {}} if s.o.tiled_mlp else {}
