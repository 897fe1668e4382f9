"""The Lightning adapter: the strategies and how they parallelize a model (docs/design.md §5).

Importing it registers ``"fpdt"`` in Lightning's strategy registries, the Trainer's and Fabric's, so
``Trainer(strategy="fpdt")`` and ``Fabric(strategy="fpdt")`` work after ``import lightning_fpdt`` (which imports this
package where Lightning is installed)."""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_fpdt.strategy.fabric import FPDTFabricStrategy
from lightning_fpdt.strategy.parallelize import ParallelizeConfig, apply_fpdt
from lightning_fpdt.strategy.precision import FPDTPrecision
from lightning_fpdt.strategy.trainer import FPDTStrategy

FPDTStrategy.register_strategies(StrategyRegistry)  # guarded: a second import registers nothing
FPDTFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)  # Fabric(strategy="fpdt")

__all__ = ["FPDTFabricStrategy", "FPDTPrecision", "FPDTStrategy", "ParallelizeConfig", "apply_fpdt"]
