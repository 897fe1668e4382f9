"""lightning_fpdt: ultra-long-context training for PyTorch Lightning (``Trainer(strategy="fpdt")``)."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_fpdt.callbacks import (
    ActivationOffload,
    MFUMonitor,
    SequenceLengthCurriculum,
    TiledLoss,
    TiledMLP,
    tiled_cross_entropy,
)
from lightning_fpdt.flops import PEAK_FLOPS, ModelGeometry, flops_per_step, flops_per_token, peak_flops
from lightning_fpdt.sequence import FPDTAttention, SequenceLayout, fpdt_attention, ulysses_attention
from lightning_fpdt.strategy import FPDTStrategy, apply_fpdt
from lightning_fpdt.strategy.loss import sequence_loss
from lightning_fpdt.strategy.noise import quiet_lightning

__version__ = "0.1.0"

# importing the package makes Trainer(strategy="fpdt") work; guarded so a second import registers nothing
FPDTStrategy.register_strategies(StrategyRegistry)
quiet_lightning()  # Lightning's tips and a deprecation it triggers say nothing about a run (strategy/noise.py)

__all__ = [
    "PEAK_FLOPS",
    "ActivationOffload",
    "TiledLoss",
    "TiledMLP",
    "tiled_cross_entropy",
    "FPDTAttention",
    "FPDTStrategy",
    "MFUMonitor",
    "ModelGeometry",
    "SequenceLengthCurriculum",
    "SequenceLayout",
    "apply_fpdt",
    "flops_per_step",
    "flops_per_token",
    "fpdt_attention",
    "peak_flops",
    "sequence_loss",
    "ulysses_attention",
]
