"""The Lightning adapter: the strategy and how it parallelizes a model (docs/design.md §5).

Importing it registers ``"fpdt"`` in Lightning's strategy registry, so ``Trainer(strategy="fpdt")`` works after
``import lightning_fpdt`` (which imports this package where Lightning is installed)."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_fpdt.strategy.fpdt import FPDTStrategy
from lightning_fpdt.strategy.noise import quiet_lightning
from lightning_fpdt.strategy.parallelize import ParallelizeConfig, apply_fpdt
from lightning_fpdt.strategy.precision import FPDTPrecision

FPDTStrategy.register_strategies(StrategyRegistry)  # guarded: a second import registers nothing
quiet_lightning()  # Lightning's tips and a deprecation it triggers say nothing about a run (strategy/noise.py)

__all__ = ["FPDTPrecision", "FPDTStrategy", "ParallelizeConfig", "apply_fpdt"]
