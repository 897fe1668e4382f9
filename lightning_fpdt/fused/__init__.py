"""The elementwise ops every model family and the tiled loss run (RMSNorm, RoPE, the SwiGLU product) and the switch
that fuses them (:data:`FUSED_OPS`). Plain PyTorch on the ground floor: nothing of the package below it, so the
models, the integrations and the memory transforms all take them from here (docs/design.md §2)."""

from lightning_fpdt.fused.ops import FUSED_OPS, FusedOps, rms_norm, rotary, swiglu

__all__ = ["FUSED_OPS", "FusedOps", "rms_norm", "rotary", "swiglu"]
