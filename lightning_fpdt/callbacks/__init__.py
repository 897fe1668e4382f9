"""Lightning callbacks that declare memory transforms and measure (DESIGN.md §6)."""

from lightning_fpdt.callbacks.mfu import MFUMonitor, StepRecord

__all__ = ["MFUMonitor", "StepRecord"]
