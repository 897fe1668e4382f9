"""The loss over token tiles (``TiledLoss``): the logits of one tile at a time, never all ``N × V``."""

from __future__ import annotations

from typing import Any

from lightning_fpdt.planner.components import (
    LOSS_TILE_BYTES_PER_LOGIT,
    UNTILED_LOSS_BYTES_PER_LOGIT,
    Component,
    loss_tile_tokens,
)
from lightning_fpdt.planner.features.base import MemoryFeature
from lightning_fpdt.planner.step_sizes import StepSizes


class TiledLossFeature(MemoryFeature):
    fields = ("tiled_loss",)
    label = "tiled loss"

    def choices(self, field: str, s: StepSizes) -> tuple[Any, ...]:
        return (False, True)

    def components(self, s: StepSizes) -> list[Component]:
        V, h = s.g.vocab_size, s.g.hidden_size
        if s.o.tiled_loss:
            loss = s.A + V * h * 4 + LOSS_TILE_BYTES_PER_LOGIT * loss_tile_tokens(s.N, V) * V
            formula = "hidden grad + fp32 lm_head grad + one tile"
        else:
            loss = UNTILED_LOSS_BYTES_PER_LOGIT * s.N * V
            formula = "fp32 logits, log-softmax, grad"
        return [Component("logits / loss", s.norm + loss, phase="loss", formula=formula)]

    def arguments(self, s: StepSizes) -> dict[str, dict[str, Any]]:
        return {"TiledLoss": {}} if s.o.tiled_loss else {}
