"""Precision for the fpdt strategies: FSDP2's MixedPrecisionPolicy instead of autocast (docs/design.md §5).

:class:`FPDTFabricPrecision` holds the whole behaviour on Fabric's plugin interface (``Fabric(strategy="fpdt")``);
:class:`FPDTPrecision` is the same on the Trainer's, whose plugin class extends Fabric's."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from typing_extensions import override

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true")


class FPDTFabricPrecision(FabricPrecision):
    """``bf16-mixed``: fp32 master weights, bf16 compute, fp32 gradient reduction; ``bf16-true``: bf16 everywhere;
    ``32-true``: fp32 (the CPU tests)."""

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in SUPPORTED_PRECISION:
            fix = "bf16-mixed" if "16" in str(precision) else "32-true"
            raise ValueError(
                f"the fpdt strategy supports precision {SUPPORTED_PRECISION}, got {precision!r}: use "
                f"precision={fix!r}"
            )
        self.precision = precision

    def mixed_precision_policy(self) -> Optional[MixedPrecisionPolicy]:
        if self.precision == "bf16-mixed":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if self.precision == "bf16-true":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        return None

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(torch.bfloat16) if self.precision == "bf16-true" else module

    @contextmanager
    @override
    def tensor_init_context(self) -> Generator[None, None, None]:
        if self.precision != "bf16-true":
            yield
            return
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            yield
        finally:
            torch.set_default_dtype(default)

    @contextmanager
    @override
    def module_init_context(self) -> Generator[None, None, None]:
        with self.tensor_init_context():
            yield

    @override
    def convert_input(self, data: Any) -> Any:
        return data  # FSDP2 casts floating inputs to param_dtype itself (cast_forward_inputs)


class FPDTPrecision(FPDTFabricPrecision, Precision):
    """:class:`FPDTFabricPrecision` as a Trainer plugin (the Trainer's backward and optimizer step)."""


def to_fpdt_precision(
    plugin: Optional[FabricPrecision], kind: type[FPDTFabricPrecision] = FPDTPrecision
) -> Optional[FPDTFabricPrecision]:
    """Map the plugin Lightning chose from ``Trainer(precision=...)`` or ``Fabric(precision=...)`` to ``kind``
    (:class:`FPDTPrecision` for the Trainer, :class:`FPDTFabricPrecision` for Fabric), or refuse it."""
    if plugin is None or isinstance(plugin, kind):
        return plugin
    return kind(getattr(plugin, "precision", "32-true"))
