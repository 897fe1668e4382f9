"""lightning_fpdt: ultra-long-context training for PyTorch Lightning (``Trainer(strategy="fpdt")``,
``Fabric(strategy="fpdt")``).

The plain-PyTorch layers (``lightning_fpdt.sequence``, ``.memory``, ``.planner``, ``.flops``) import without
Lightning. Where Lightning is installed, importing this package also imports the strategy, which registers
``"fpdt"`` in Lightning's strategy registry (``strategy/__init__.py``).
"""

from lightning_fpdt.flops import PEAK_FLOPS, ModelGeometry, flops_per_step, flops_per_token, peak_flops
from lightning_fpdt.integrations.audit import allow_local_attention
from lightning_fpdt.sequence import FPDTAttention, SequenceLayout, fpdt_attention, ulysses_attention

__version__ = "0.1.0"

LIGHTNING_NAMES = ("ActivationOffload", "FPDTFabricStrategy", "FPDTStrategy", "GradientCheck", "LongContextEval",
                   "MFUMonitor", "SequenceLengthCurriculum", "StepProgress", "TiledLoss", "TiledMLP", "apply_fpdt",
                   "sequence_loss", "sequence_mean", "sequence_sum", "tiled_cross_entropy")
"""The public names that need Lightning."""

try:
    import lightning.pytorch  # noqa: F401
except ModuleNotFoundError as error:
    if error.name not in ("lightning", "lightning.pytorch"):
        raise  # a module Lightning needs is missing: say so, rather than hide Lightning
    LIGHTNING_AVAILABLE = False
else:
    LIGHTNING_AVAILABLE = True

if LIGHTNING_AVAILABLE:
    from lightning_fpdt.callbacks import (
        ActivationOffload,
        GradientCheck,
        LongContextEval,
        MFUMonitor,
        SequenceLengthCurriculum,
        StepProgress,
        TiledLoss,
        TiledMLP,
        tiled_cross_entropy,
    )
    from lightning_fpdt.strategy import FPDTFabricStrategy, FPDTStrategy, apply_fpdt  # registers "fpdt" with Lightning
    from lightning_fpdt.strategy.step_loss import sequence_loss, sequence_mean, sequence_sum
else:
    def __getattr__(name: str) -> object:
        if name in LIGHTNING_NAMES:
            raise ModuleNotFoundError(
                f"lightning_fpdt.{name} needs Lightning, which is not installed (pip install lightning); without it "
                f"lightning_fpdt.sequence, lightning_fpdt.memory and lightning_fpdt.planner work", name="lightning")
        raise AttributeError(f"module 'lightning_fpdt' has no attribute {name!r}")

__all__ = [
    "PEAK_FLOPS",
    "ActivationOffload",
    "TiledLoss",
    "TiledMLP",
    "tiled_cross_entropy",
    "FPDTAttention",
    "FPDTFabricStrategy",
    "FPDTStrategy",
    "GradientCheck",
    "LongContextEval",
    "MFUMonitor",
    "ModelGeometry",
    "SequenceLengthCurriculum",
    "SequenceLayout",
    "StepProgress",
    "allow_local_attention",
    "apply_fpdt",
    "flops_per_step",
    "flops_per_token",
    "fpdt_attention",
    "peak_flops",
    "sequence_loss",
    "sequence_mean",
    "sequence_sum",
    "ulysses_attention",
]
