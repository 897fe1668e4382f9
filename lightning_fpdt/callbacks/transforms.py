"""How the memory callbacks declare their transforms (docs/design.md §6).

A callback that changes the model declares it; it never imports the strategy:

- ``fpdt_transform(model, blocks)`` changes the network in place (idempotent), and ``fpdt_transform_slot`` names the
  slot of ``apply_fpdt`` it fills (``"tiled_mlp"``, ``"tiled_loss"``, ``"activation_checkpointing"``: the order of
  the slots is ``apply_fpdt``'s);
- ``fpdt_memory_features`` says what the memory planner counts for it (a ``MemoryFeatures`` value; an option left
  ``"auto"`` is the strategy's to choose, which it hands back through ``apply_memory_choice``).

A strategy whose ``applies_memory_transforms`` is true (the fpdt strategy) collects the declarations and applies the
transforms in their order before FSDP2; under any other strategy each callback applies its own at ``setup``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_fpdt.callbacks.gradient_check import add_gradient_check
from lightning_fpdt.integrations.discovery import language_models, transform_targets
from lightning_fpdt.memory.surgery import find_blocks, has_parameters


def strategy_applies_transforms(trainer: "pl.Trainer") -> bool:
    """Whether the trainer's strategy applies declared transforms itself (in its fixed order, before sharding)."""
    return bool(getattr(trainer.strategy, "applies_memory_transforms", False))


def transform_without_fpdt(callback: Any, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           layer_classes: Any = None, *, require_parameters: bool = True) -> None:
    """Apply ``callback.fpdt_transform`` to the network in ``pl_module`` when the strategy does not (the blocks of
    ``layer_classes``, else of the largest ``nn.ModuleList``), and check that every trainable parameter trains
    (:class:`~lightning_fpdt.callbacks.gradient_check.GradientCheck`, as the fpdt strategy does)."""
    if strategy_applies_transforms(trainer):
        return
    models = language_models(pl_module)
    if require_parameters and not any(has_parameters(model) for model in models):
        raise ValueError(
            f"{type(callback).__name__} transforms the model at setup when the strategy is not 'fpdt', but "
            f"{type(pl_module).__name__} has no parameters yet (built in configure_model?): build the model in "
            f"__init__, or train with strategy='fpdt', which applies the transform after configure_model"
        )
    for model in transform_targets(callback.fpdt_transform_slot, models):
        callback.fpdt_transform(model, find_blocks(model, layer_classes))
    add_gradient_check(trainer)
