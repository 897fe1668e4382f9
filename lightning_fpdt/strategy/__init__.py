"""The Lightning adapter: the strategy and how it parallelizes a model (docs/design.md §5)."""

from lightning_fpdt.strategy.fpdt import FPDTStrategy
from lightning_fpdt.strategy.parallelize import ParallelizeConfig, apply_fpdt
from lightning_fpdt.strategy.precision import FPDTPrecision

__all__ = ["FPDTPrecision", "FPDTStrategy", "ParallelizeConfig", "apply_fpdt"]
