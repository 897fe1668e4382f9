"""``TiledLoss``: the causal-LM loss without ever materialising the full logits (docs/design.md §6). The tiled
cross-entropy is :func:`lightning_fpdt.memory.tiled_cross_entropy`; switching a model to it is
:func:`lightning_fpdt.integrations.apply_tiled_loss`; this callback declares it."""

from __future__ import annotations

from typing import Literal, Union

import lightning.pytorch as pl
from torch import nn

from lightning_fpdt.callbacks.transforms import transform_without_fpdt
from lightning_fpdt.integrations.install import apply_tiled_loss
from lightning_fpdt.memory.tiled_loss import tiled_cross_entropy
from lightning_fpdt.memory.tiling import check_num_tiles
from lightning_fpdt.planner.plan_options import MemoryFeatures

__all__ = ["TiledLoss", "tiled_cross_entropy"]


class TiledLoss(pl.Callback):
    """The model returns its loss without materialising the full logits: hidden states are projected and
    cross-entropied (fp32) tile by tile, the lm_head and hidden-state gradients accumulated on the way.

    Covers the reference Llama (tied embeddings included) and Hugging Face ``*ForCausalLM`` models, which then
    return ``logits=None`` when given labels; other models call :func:`tiled_cross_entropy` themselves. The loss and
    its gradients are the same function as the untiled loss, so the fpdt strategy's sequence-parallel reduction,
    gradient accumulation and loss scaling apply unchanged.

    With ``strategy="fpdt"`` the strategy applies this in its fixed order (after the attention swap and the tiled
    MLP, before activation checkpointing and FSDP2); the loss runs inside the model's forward, where FSDP2 has
    gathered the lm_head. With any other strategy it is applied in :meth:`setup` to the network in the
    LightningModule (which must then be built in ``__init__``, not ``configure_model``); it works on a single device
    and under DDP, where Hugging Face ``labels`` are shifted locally as Hugging Face does.

    Args:
        num_tiles: token tiles per loss call; ``"auto"``: from each call's input, enough that one tile's fp32 logits
            (tokens × vocabulary × 4 bytes) stay under 1 GiB.
    """

    fpdt_transform_slot = "tiled_loss"
    """The slot of ``apply_fpdt`` it fills: after the tiled MLP, before checkpointing and FSDP2 (docs/design.md §5)."""

    @property
    def fpdt_memory_features(self) -> MemoryFeatures:
        """What the memory planner counts for this callback."""
        return MemoryFeatures(tiled_loss=True)

    def __init__(self, num_tiles: Union[Literal["auto"], int] = "auto") -> None:
        super().__init__()
        check_num_tiles(num_tiles, "TiledLoss")
        self.num_tiles = num_tiles

    def fpdt_transform(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        apply_tiled_loss(model, num_tiles=self.num_tiles)

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        transform_without_fpdt(self, trainer, pl_module)
