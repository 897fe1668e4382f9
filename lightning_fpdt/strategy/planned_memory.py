"""What both strategies answer from their memory budget (``strategy/budget.py``): the plan the run is on, the host
memory it holds page-locked, the attention options of a length."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from lightning_fpdt.planner.components import MemoryPlan
from lightning_fpdt.sequence.options import ResolvedOptions

if TYPE_CHECKING:
    from lightning_fpdt.strategy.budget import MemoryBudget


class PlannedMemory:
    """What both strategies answer from their memory budget (``self.memory``): the plan the run is on, the host
    memory it holds page-locked, the attention options of a length."""

    memory: MemoryBudget

    @property
    def memory_plan(self) -> Optional[MemoryPlan]:
        """The plan the last sequence length runs on (options, predicted GPU and host peaks); ``None`` where nothing
        plans (no GPU, no model config the planner reads)."""
        return self.memory.plan

    @property
    def pinned_host_bytes(self) -> int:
        """Host memory this process holds page-locked: the attention's and the callbacks' buffers, the states."""
        return self.memory.pinned_bytes()

    def resolved_options(self, seq_len: int, batch_size: int = 1) -> ResolvedOptions:
        """Chunks and offload for global sequences of ``seq_len`` tokens: the plan's (the search's choice for
        ``"auto"``), or where nothing plans the options, ``"auto"`` sized from the free GPU memory at the first batch
        (:meth:`MemoryBudget.resolved`)."""
        return self.memory.resolved(seq_len, batch_size)

    def num_chunks_for(self, seq_len: int, batch_size: int = 1) -> int:
        """FPDT chunks for a global sequence of ``seq_len`` tokens (the option, or the plan for ``"auto"``)."""
        return self.resolved_options(seq_len, batch_size).chunks
