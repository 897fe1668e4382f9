"""``TiledMLP``: the MLP of every block runs over sequence tiles, only its input kept for backward (docs/design.md
§6). The work is :func:`lightning_fpdt.memory.apply_tiled_mlp`; this callback declares it."""

from __future__ import annotations

from typing import Literal, Optional, Union

import lightning.pytorch as pl
from torch import nn

from lightning_fpdt.callbacks.transforms import transform_without_fpdt
from lightning_fpdt.integrations.families import mlp_classes
from lightning_fpdt.memory.tiled_mlp import apply_tiled_mlp
from lightning_fpdt.memory.tiling import check_num_tiles
from lightning_fpdt.planner.plan_options import MemoryFeatures


class TiledMLP(pl.Callback):
    """Runs the MLP of every transformer block over sequence tiles; only its input is kept for backward.

    The forward computes each tile under ``no_grad``; the backward recomputes one tile at a time and backpropagates
    it, so at most one tile's intermediate activations exist (for Llama-3-8B, 3 × 14336 values per token instead of
    all tokens' — the largest buffers of a block at long context). The price is one extra MLP forward.

    Detected: in a Hugging Face model of a known family (``lightning_fpdt.integrations.families``), its family's MLP
    classes (gated, fused gate-up, sparse mixture-of-experts blocks); elsewhere gated MLPs with ``gate_proj``,
    ``up_proj``, ``down_proj`` submodules (the reference Llama) and ``nn.Sequential(Linear, activation, Linear)``;
    other MLPs by class name. An MLP must act on each token separately and hold no dropout.

    With ``strategy="fpdt"`` the strategy applies this in its fixed order (after the attention swap, before the tiled
    loss, activation checkpointing and FSDP2). With any other strategy it is applied in :meth:`setup` to the network
    in the LightningModule (which must then be built in ``__init__``, not ``configure_model``); it works on a single
    device and under DDP.

    Args:
        num_tiles: token tiles per MLP call; ``"auto"``: from each call's input, enough that one tile's
            intermediate activations (tokens × intermediate size × 3 × dtype bytes) stay under 256 MiB.
        mlp_classes: class names of the MLP modules to tile instead of the detected ones.
    """

    fpdt_transform_slot = "tiled_mlp"
    """The slot of ``apply_fpdt`` it fills: after the attention swap, before the tiled loss, checkpointing and FSDP2
    (docs/design.md §5)."""

    @property
    def fpdt_memory_features(self) -> MemoryFeatures:
        """What the memory planner counts for this callback."""
        return MemoryFeatures(tiled_mlp=True)

    def __init__(
        self, num_tiles: Union[Literal["auto"], int] = "auto", mlp_classes: Optional[list[str]] = None
    ) -> None:
        super().__init__()
        check_num_tiles(num_tiles, "TiledMLP")
        if mlp_classes is not None and not mlp_classes:
            raise ValueError("TiledMLP(mlp_classes=[]): name at least one class, or pass None to detect MLPs")
        self.num_tiles = num_tiles
        self.mlp_classes = mlp_classes

    def fpdt_transform(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        apply_tiled_mlp(model, num_tiles=self.num_tiles, mlp_classes=self.mlp_classes or mlp_classes(model),
                        blocks=blocks)

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        transform_without_fpdt(self, trainer, pl_module)
