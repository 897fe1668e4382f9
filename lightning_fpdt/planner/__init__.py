"""The memory planner: will a long-context run fit, which limit binds, what makes it fit (``lightning-fpdt plan``,
docs/planner.md).

:func:`plan_memory` predicts, per GPU and per host, the bytes of each part of one training step and resolves the
``"auto"`` options to the fastest configuration that fits both memories (:func:`fastest_fitting`, the search the
strategy runs too); :func:`format_plan` prints them; :func:`check_host_memory` refuses a plan whose host memory a
host does not have. Each memory feature has one module in :mod:`lightning_fpdt.planner.features`. The step is timed
by :mod:`~lightning_fpdt.planner.cost` at the rates of the GPU (:mod:`~lightning_fpdt.planner.calibration`, measured
once and cached; :mod:`~lightning_fpdt.planner.rates`, the built-in table); :mod:`~lightning_fpdt.planner.trial`
tries on the training steps the configurations it cannot tell apart. No Lightning:
the attention sizes resolve as the strategy resolves them (``lightning_fpdt.sequence``), the tile sizes follow the
tiled transforms' own rules (``lightning_fpdt.memory``).
"""

from lightning_fpdt.planner.commands import CALLBACK_NAMES, format_plan, main
from lightning_fpdt.planner.components import (
    GIB,
    Component,
    MemoryPlan,
    attention_backward_bytes,
    attention_host_bytes,
    loss_op_bytes,
    loss_tile_tokens,
    mlp_op_bytes,
    mlp_tile_tokens,
)
from lightning_fpdt.planner.geometry import (
    OPTIMIZER_STATES,
    PRECISIONS,
    attention_geometry,
    geometry_name,
    parameter_counts,
    resolve_geometry,
    total_parameters,
)
from lightning_fpdt.planner.host import available_host_memory, check_host_memory
from lightning_fpdt.planner.plan import plan_memory
from lightning_fpdt.planner.plan_options import PlanOptions
from lightning_fpdt.planner.request import Machine, PlanRequest
from lightning_fpdt.planner.search import (
    SEARCHED,
    estimated_step_seconds,
    fastest_fitting,
    seconds_per_million_tokens,
    step_seconds,
)

__all__ = [
    "CALLBACK_NAMES",
    "GIB",
    "OPTIMIZER_STATES",
    "PRECISIONS",
    "SEARCHED",
    "Component",
    "Machine",
    "MemoryPlan",
    "PlanOptions",
    "PlanRequest",
    "attention_backward_bytes",
    "attention_geometry",
    "attention_host_bytes",
    "available_host_memory",
    "check_host_memory",
    "estimated_step_seconds",
    "fastest_fitting",
    "format_plan",
    "geometry_name",
    "loss_op_bytes",
    "loss_tile_tokens",
    "main",
    "mlp_op_bytes",
    "mlp_tile_tokens",
    "parameter_counts",
    "plan_memory",
    "resolve_geometry",
    "seconds_per_million_tokens",
    "step_seconds",
    "total_parameters",
]
