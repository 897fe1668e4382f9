"""``apply_fpdt``: the fixed order of transforms that makes a model sequence-parallel (DESIGN.md §5)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from lightning_fpdt.sequence import integrations
from lightning_fpdt.sequence.integrations import SequenceParallelContext
from lightning_fpdt.strategy.mesh import flat_mesh

ModelTransform = Callable[[nn.Module, list[nn.Module]], None]
_APPLIED = "_fpdt_applied"


@dataclass
class ParallelizeConfig:
    """What ``apply_fpdt`` needs besides the model and the mesh."""

    context: SequenceParallelContext
    """The attention, group and per-batch state the installed wrappers share with the strategy."""
    layer_classes: Optional[Sequence[str]] = None
    """Class names of the transformer blocks; ``None`` takes the classes of the largest ``nn.ModuleList``."""
    mp_policy: Optional[MixedPrecisionPolicy] = None
    cpu_offload_params: bool = False
    memory_transforms: Sequence[ModelTransform] = field(default_factory=list)
    """Tiled MLP, tiled loss, activation checkpointing + offload, in that order (declared by callbacks)."""


def find_blocks(model: nn.Module, layer_classes: Optional[Sequence[str]] = None) -> list[nn.Module]:
    """The transformer blocks: modules of ``layer_classes``, else the members of the largest ``nn.ModuleList``."""
    if layer_classes:
        names = set(layer_classes)
        blocks = [m for m in model.modules() if type(m).__name__ in names]
        if not blocks:
            raise ValueError(f"layer_classes={sorted(names)} matched no module of {type(model).__name__}")
        return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    return list(max(lists, key=len))


def find_model(module: nn.Module) -> nn.Module:
    """The network inside a LightningModule: its single child that holds the blocks, or the module itself."""
    children = [c for c in module.children() if any(True for _ in c.parameters())]
    return children[0] if len(children) == 1 else module


def apply_fpdt(module: nn.Module, mesh: DeviceMesh, *, config: ParallelizeConfig) -> nn.Module:
    """Make ``module`` (a LightningModule or any ``nn.Module``) sequence-parallel in place; idempotent."""
    if getattr(module, _APPLIED, False):
        return module  # fit then validate must not wrap twice
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        raise ValueError(
            f"{type(module).__name__} holds parameters {own} directly; FSDP2 shards submodules (never the "
            f"LightningModule itself, whose training_step Lightning calls): move them into a submodule"
        )
    model = find_model(module)
    blocks = find_blocks(model, config.layer_classes)

    # 1. attention (and loss) swap first: later wrappers (checkpointing, FSDP) must wrap the swapped modules
    integrations.install(model, blocks, config.context)
    # 2.-4. tiled MLP, tiled loss, activation checkpointing + offload: checkpoint wrappers go on before FSDP
    for transform in config.memory_transforms:
        transform(model, blocks)
    # 5. FSDP2 (plain gradient averaging over all ranks, see sequence_parallel_loss): each block its own unit
    #    (gathered just in time), then each top-level child for what remains; never the LightningModule root,
    #    whose training_step (not forward) Lightning calls
    fsdp_mesh = flat_mesh(mesh)
    kwargs = dict(mesh=fsdp_mesh, mp_policy=config.mp_policy or MixedPrecisionPolicy())
    if config.cpu_offload_params:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in find_blocks(model, config.layer_classes):  # again: a transform may have wrapped the blocks
        fully_shard(block, **kwargs)
    for child in module.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, **kwargs)
    setattr(module, _APPLIED, True)
    return module


def unwrap_loss(output: object) -> Optional[torch.Tensor]:
    """The loss tensor of a training_step output (a tensor, or a mapping with ``"loss"``)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return output.get("loss")
    return None
