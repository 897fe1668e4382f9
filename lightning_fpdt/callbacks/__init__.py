"""Lightning callbacks that declare memory transforms and measure (docs/design.md §6)."""

from lightning_fpdt.callbacks.activation_offload import ActivationOffload
from lightning_fpdt.callbacks.curriculum import SequenceLengthCurriculum
from lightning_fpdt.callbacks.gradient_check import GradientCheck
from lightning_fpdt.callbacks.long_context_eval import LongContextEval, LongContextScores
from lightning_fpdt.callbacks.mfu import MFUMonitor, StepRecord
from lightning_fpdt.callbacks.step_progress import StepProgress
from lightning_fpdt.callbacks.tiled_loss import TiledLoss, tiled_cross_entropy
from lightning_fpdt.callbacks.tiled_mlp import TiledMLP

__all__ = [
    "ActivationOffload",
    "GradientCheck",
    "LongContextEval",
    "LongContextScores",
    "MFUMonitor",
    "SequenceLengthCurriculum",
    "StepProgress",
    "StepRecord",
    "TiledLoss",
    "TiledMLP",
    "tiled_cross_entropy",
]
