"""The memory features the planner counts, one module each: its options (the
:class:`~lightning_fpdt.planner.plan_options.PlanOptions` fields it owns), the values the ``"auto"`` search tries, its
memory terms, its cost in step time, the arguments a user writes for it, the values its ``"auto"`` options take before
the search resolves them and its command-line flags (:class:`~.base.MemoryFeature`).

A new feature is a module here and a line in :data:`FEATURES` (and its fields in ``PlanOptions``, under the names and
types its user writes).
"""

from lightning_fpdt.planner.features.accumulation import GradientAccumulation
from lightning_fpdt.planner.features.attention_stash import AttentionStash
from lightning_fpdt.planner.features.base import MemoryFeature
from lightning_fpdt.planner.features.block_inputs import BlockInputs
from lightning_fpdt.planner.features.chunks import Chunks
from lightning_fpdt.planner.features.disk_tier import DiskTier
from lightning_fpdt.planner.features.head_groups import HeadGroups
from lightning_fpdt.planner.features.host_states import HostStates
from lightning_fpdt.planner.features.residency import Residency
from lightning_fpdt.planner.features.sequence_layout import SequenceLayoutFeature
from lightning_fpdt.planner.features.tiled_loss import TiledLossFeature
from lightning_fpdt.planner.features.tiled_mlp import TiledMLPFeature

FEATURES: tuple[MemoryFeature, ...] = (
    HostStates(),
    GradientAccumulation(),
    BlockInputs(),
    DiskTier(),
    Residency(),
    AttentionStash(),
    Chunks(),
    HeadGroups(),
    TiledMLPFeature(),
    TiledLossFeature(),
    SequenceLayoutFeature(),
)
"""Every memory feature, in the order their terms are listed."""

__all__ = ["FEATURES", "MemoryFeature"]
