"""The memory callbacks as the memory budget reads them (``strategy/budget.py``): what they declare to the planner,
the plan's choice they take, the host buffer pool they hold. The callbacks import nothing of the strategy; these
protocols say what the strategy expects of them."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from lightning_fpdt.offload.host_stash import StashFactory
from lightning_fpdt.planner.plan_options import MemoryFeatures


@runtime_checkable
class DeclaresMemory(Protocol):
    """A memory callback as the planner reads it: the features it asks of a run (``ActivationOffload``,
    ``TiledMLP``, ``TiledLoss``)."""

    fpdt_memory_features: MemoryFeatures


@runtime_checkable
class TakesMemoryChoice(Protocol):
    """A memory callback whose ``"auto"`` options take the plan's choice for the length that runs."""

    def apply_memory_choice(self, **choice: Any) -> None: ...


@runtime_checkable
class HoldsStashes(Protocol):
    """A memory callback with a host buffer pool: the guard, the disk tier and the trims reach it."""

    stashes: StashFactory
