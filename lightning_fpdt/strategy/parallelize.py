"""``apply_fpdt``: the fixed order of transforms that makes a model sequence-parallel (docs/design.md §5)."""

from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor

from lightning_fpdt.integrations import SequenceParallelContext, attention_geometry, check_router_loss, install
from lightning_fpdt.integrations.attributes import APPLIED, ATTENTION_AUDIT, STEP_METHODS
from lightning_fpdt.integrations.audit import AttentionAudit
from lightning_fpdt.integrations.discovery import language_models, planned_model, transform_targets
from lightning_fpdt.integrations.head_loss import loss_head
from lightning_fpdt.integrations.install import check_family
from lightning_fpdt.memory.surgery import find_blocks
from lightning_fpdt.sequence.attention import FPDTAttention
from lightning_fpdt.sequence.options import FPDTOptions
from lightning_fpdt.sequence.planning import AttentionGeometry
from lightning_fpdt.strategy import tokens
from lightning_fpdt.strategy.materialize import has_meta_parameters, materialize
from lightning_fpdt.strategy.mesh import attention_group, flat_mesh, sequence_mesh

ModelTransform = Callable[[nn.Module, list[nn.Module]], None]
"""``transform(model, blocks)``: changes the network in place (a memory callback's ``fpdt_transform``)."""
SLOTS = ("tiled_mlp", "tiled_loss", "activation_checkpointing")
"""The memory transforms' slots of :class:`ParallelizeConfig`, in the order ``apply_fpdt`` runs them."""


@dataclass(kw_only=True)
class ParallelizeConfig:
    """What ``apply_fpdt`` needs besides the model and the mesh (keyword-only)."""

    context: SequenceParallelContext
    """The attention, group and per-batch state the installed wrappers share with the strategy."""
    layer_classes: Optional[Sequence[str]] = None
    """Class names of the transformer blocks; ``None`` takes the classes of the largest ``nn.ModuleList``."""
    mp_policy: Optional[MixedPrecisionPolicy] = None
    """FSDP2's mixed precision (the precision plugin's); ``None``: FSDP2's default."""
    cpu_offload_params: bool = False
    """FSDP2 ``CPUOffloadPolicy``: sharded parameters, gradients and optimizer states in host memory."""
    tiled_mlp: Sequence[ModelTransform] = ()
    """Run the MLPs over token tiles (``TiledMLP``)."""
    tiled_loss: Sequence[ModelTransform] = ()
    """Compute the loss over token tiles (``TiledLoss``)."""
    activation_checkpointing: Sequence[ModelTransform] = ()
    """Checkpoint the blocks, their inputs in host memory (``ActivationOffload``)."""


def declared_transforms(callbacks: Iterable[Any]) -> dict[str, list[ModelTransform]]:
    """The transforms callbacks declare (``fpdt_transform_slot``, ``fpdt_transform``), by slot."""
    slots: dict[str, list[ModelTransform]] = {slot: [] for slot in SLOTS}
    for callback in callbacks:
        slot = getattr(callback, "fpdt_transform_slot", None)
        if slot is None:
            continue
        if slot not in slots:
            raise ValueError(f"{type(callback).__name__} declares fpdt_transform_slot={slot!r}; the slots are "
                             f"{list(SLOTS)}")
        slots[slot].append(callback.fpdt_transform)
    return slots


def apply_fpdt(module: nn.Module, mesh: DeviceMesh, *, config: ParallelizeConfig) -> nn.Module:
    """Make ``module`` (a LightningModule or any ``nn.Module``) sequence-parallel in place; idempotent. Every language
    model it holds (``integrations/discovery.py``: a policy and a frozen reference, a model beside a head) is
    installed and transformed; what is not a language model runs on this rank's tokens as it is."""
    if getattr(module, APPLIED, False):
        return module  # fit then validate must not wrap twice
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        raise ValueError(
            f"{type(module).__name__} holds parameters {own} directly; FSDP2 shards submodules (never the "
            f"LightningModule itself, whose training_step Lightning calls): move them into a submodule"
        )
    models = language_models(module)
    blocks = {id(model): find_blocks(model, config.layer_classes) for model in models}

    without_grad = [name for name, transforms in (("ActivationOffload", config.activation_checkpointing),
                                                  ("TiledMLP", config.tiled_mlp)) if transforms]
    for model in models:  # every model checked before any is changed
        check_router_loss(model, forward_without_grad=without_grad)
        check_family(model)
    # 1. the attention (and loss) swap first: later wrappers (tiling, checkpointing, FSDP2) wrap the swapped modules
    for model in models:
        install(model, blocks[id(model)], config.context)
    #    then every block and attention-like module is watched: its first forward must run the swapped attention
    audit = AttentionAudit(module, blocks=[block for model in models for block in blocks[id(model)]],
                           attention=config.context.attention,
                           sequence_parallel_size=config.context.sequence_parallel_size)
    setattr(module, ATTENTION_AUDIT, audit)
    # 2. tiled MLP inside the blocks, before checkpointing wraps them; 3. tiled loss on the model's forward, which
    # FSDP2's root unit wraps; 4. activation checkpointing + host offload: its wrappers hold the tiled MLP and must
    # be in place before FSDP2. Each in the models it applies to (transform_targets: checkpointing where they train)
    for slot in SLOTS:
        for model in transform_targets(slot, models):
            for transform in getattr(config, slot):
                transform(model, blocks[id(model)])
    # 5. FSDP2 (plain gradient averaging over all ranks, see sequence_parallel_loss): each block its own unit
    #    (gathered just in time), then one root unit for what remains (embeddings, final norm, head; tied weights
    #    stay in one unit): the network's own module, or, when the parts sit on the module given (nanoGPT style, or
    #    the model itself under Fabric), that module, whose LightningModule steps then count as forwards (Lightning
    #    calls training_step, never forward, so FSDP2 would otherwise not gather the root's parameters)
    fsdp = dict(mesh=flat_mesh(mesh), mp_policy=config.mp_policy or MixedPrecisionPolicy())
    if config.cpu_offload_params:
        # page-locked by the strategy itself, each shard exactly its size (host_states.register_host_states): FSDP2's
        # own pinning rounds every shard up to a power of two
        fsdp["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for model in models:
        for block in find_blocks(model, config.layer_classes):  # again: a transform may have wrapped the blocks
            fully_shard(block, **fsdp)
        #    an output head that computes the tiled loss in its own forward is a unit too: its all-gather then
        #    overlaps the last block's forward, it is not held gathered through the blocks' forward and backward,
        #    and its gradient's reduce-scatter (with host-resident states: its step, strategy/host_optimizer.py)
        #    overlaps the blocks' backward instead of waiting with the embedding's at the end; gathered from its
        #    forward to its backward, which follows at once
        head = loss_head(model)
        if head is not None:
            fully_shard(head, reshard_after_forward=False, **fsdp)
    if len(models) > 1:
        #    several models: each its own root unit, gathered for its own forward (a frozen reference's embeddings
        #    are not held beside the policy's through the step)
        for model in models:
            fully_shard(model, **fsdp)
    rest = unsharded_children(module)
    if len(rest) == 1:
        fully_shard(rest[0], **fsdp)
    elif rest:
        fully_shard(module, **fsdp)
        for method in STEP_METHODS:
            if callable(getattr(module, method, None)):  # a plain nn.Module (a Fabric loop's model) has none
                register_fsdp_forward_method(module, method)
    setattr(module, APPLIED, True)
    return module


def sequence_parallel_context(mesh: DeviceMesh, options: FPDTOptions, *, head_chunks: int) -> SequenceParallelContext:
    """The attention (its group, kernel, offload and head groups) and the context the installed wrappers share with a
    strategy; the loss is reduced over all ``P`` ranks of the sequence mesh, with or without a ring."""
    attention = FPDTAttention(  # (ulysses_group, ring_group) with a ring: the hybrid
        group=attention_group(mesh), backend=options.attention_backend, offload=options.offload is True,
        offload_dq=options.offload_dq is True, head_chunks=head_chunks,
    )
    return SequenceParallelContext(group=sequence_mesh(mesh).get_group(), attention=attention)


def parallelize_model(
    module: nn.Module, mesh: DeviceMesh, *, config: ParallelizeConfig, precision: str, pad_token_id: int,
    device: torch.device, rank: int, data: Any = None,
) -> tuple[Optional[AttentionGeometry], Optional[tokens.Vocabulary]]:
    """The model steps both strategies take at setup: :func:`apply_fpdt`, the vocabulary checks (the pad token, and
    ``data``'s vocabulary when it names one), a meta model allocated shard by shard on ``device`` (the host under
    ``cpu_offload_params``, where FSDP2 keeps the shards). Returns the attention geometry the ``"auto"`` options are
    sized with and the model's vocabulary, which every batch's token ids are checked against."""
    on_meta = has_meta_parameters(module)
    apply_fpdt(module, mesh, config=config)
    geometry = attention_geometry(planned_model(module), precision)
    vocabulary = tokens.model_vocabulary(module)
    tokens.check_pad_token(pad_token_id, vocabulary)
    tokens.check_data_vocabulary(data, vocabulary)
    if on_meta:
        # FSDP2 offloading keeps the sharded parameters in host memory and refuses them anywhere else
        materialize(module, torch.device("cpu") if config.cpu_offload_params else device, rank=rank)
    return geometry, vocabulary


class EarlyGathers:
    """The all-gathers a training step's forward starts with (the root unit's, which holds the embeddings, then the
    first block's), started when the step's batch is sharded: the device gathers while the host runs Lightning's
    hooks and the step's first launches, where it otherwise waited at the forward's start.

    FSDP2's pre-forward waits for a unit's pending gather (``FSDPModule.unshard(async_op=True)``). A gather no
    forward took is dropped (waited and the unit resharded) before the next starts and before anything may change the
    sharded parameters from outside a step (a checkpoint's load, the end of a fit), so a forward never reads a gather
    older than the parameters. Nothing starts before the first forward, where FSDP2 sets up its streams.
    """

    def __init__(self, module: nn.Module, layer_classes: Optional[Sequence[str]]) -> None:
        root = next((m for m in module.modules() if isinstance(m, FSDPModule)), None)
        if layer_classes:  # FSDP2 has subclassed each block's class (FSDP<name>): matched by the classes it derives
            names = set(layer_classes)
            blocks = [m for m in module.modules() if any(c.__name__ in names for c in type(m).__mro__)]
        else:
            blocks = find_blocks(planned_model(module))
        self.units: list[FSDPModule] = [root] if root is not None else []
        if blocks and isinstance(blocks[0], FSDPModule) and blocks[0] is not root:
            self.units.append(blocks[0])
        self.ready = False
        """Set after the first forward."""
        self.starts = 0
        """How many batches started their step's gathers early."""
        self._started: list[tuple[FSDPModule, Any]] = []

    def start(self) -> None:
        if not self.ready:
            return
        self.drop()
        self._started = [(unit, unit.unshard(async_op=True)) for unit in self.units]
        self.starts += 1

    def drop(self) -> None:
        for unit, handle in self._started:
            handle.wait()  # nothing where the forward took it
            unit.reshard()
        self._started = []


def has_unsharded_parameters(module: nn.Module) -> bool:
    """Whether ``module`` holds a parameter no FSDP2 unit manages yet (``fully_shard`` makes its own DTensors)."""
    return any(not isinstance(p, DTensor) for p in module.parameters())


def unsharded_children(module: nn.Module) -> list[nn.Module]:
    """The children of ``module`` that hold parameters no FSDP2 unit holds yet; a container that has no forward of
    its own (``nn.ModuleList``, ``nn.ModuleDict``: FSDP2 refuses them) stands for its own such children. A model in
    one submodule gives that submodule; a nanoGPT-style LightningModule (embeddings, a ``ModuleList`` of blocks and
    a head held directly) gives the embeddings and the head."""
    found = []
    for child in module.children():
        if isinstance(child, FSDPModule) or not has_unsharded_parameters(child):
            continue
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            found += unsharded_children(child)
        else:
            found.append(child)
    return found


@contextmanager
def no_gradient_sync(model: Optional[nn.Module]) -> Generator[None, None, None]:
    """No FSDP2 gradient reduce-scatter inside (gradient-accumulation micro-steps)."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)] if model is not None else []
    for module in modules:
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)
