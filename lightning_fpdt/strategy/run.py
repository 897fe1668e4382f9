"""``FPDTRun``: one fpdt run, whichever front door drives it (docs/design.md §5).

The Trainer's strategy (``strategy/trainer.py``) and Fabric's (``strategy/fabric.py``) drive the same run: its options,
the mesh, the memory budget, the sequence-parallel context, the model's setup, the per-batch step, the loss's
reduction, the outputs' gathering and what a checkpoint holds beyond Lightning's. Their hooks are a line or two into
it, plus what only their front door has. A runtime feature both front doors give is written here, once; one that
only the Trainer can give is an option Fabric refuses by name (``TRAINER_ONLY_OPTIONS``).

:class:`DrivesRun` is what both adapters answer from the run they drive, with the steps of it that read Lightning's
strategy attributes (``world_size``, ``global_rank``, ``root_device``, ...), which the Trainer's and Fabric's
strategies name alike.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_fpdt.fused import FUSED_OPS
from lightning_fpdt.integrations import SequenceParallelContext
from lightning_fpdt.sequence.kernels import AttentionBackend
from lightning_fpdt.sequence.loss import is_sequence_level
from lightning_fpdt.sequence.options import FPDTOptions, check_switch
from lightning_fpdt.sequence.planning import AttentionGeometry
from lightning_fpdt.strategy import checkpoint as checkpointing
from lightning_fpdt.strategy import tokens
from lightning_fpdt.strategy.batch import BatchPlan, BatchStep, check_batch
from lightning_fpdt.strategy.budget import MemoryBudget, RunFacts, Switch, checked_offload_dir
from lightning_fpdt.strategy.mesh import MeshSizes, build_mesh
from lightning_fpdt.strategy.parallelize import (
    EarlyGathers,
    ParallelizeConfig,
    declared_transforms,
    parallelize_model,
    sequence_parallel_context,
)
from lightning_fpdt.strategy.planned_memory import PlannedMemory
from lightning_fpdt.strategy.precision import FPDTFabricPrecision
from lightning_fpdt.strategy.predict import gather_sequence
from lightning_fpdt.strategy.step_loss import group_sums, is_reduced, unwrap_loss, with_loss
from lightning_fpdt.strategy.topology import Size, resolve_topology


class FPDTRun(MeshSizes):
    """One fpdt run, made by a strategy's constructor from its options. Set up in this order: the mesh
    (:meth:`build_mesh`), the facts the memory budget plans from (:meth:`bind`), the context the model's attention
    shares (:meth:`prepare`), the model (:meth:`setup_model`) and its optimizers (:meth:`attach_optimizers`). Then
    each batch is sharded (:meth:`shard`), each step's loss reduced once (:meth:`reduce_loss`,
    :meth:`reduced_output`), and each checkpoint carries every rank's random states and its files' checksums. It
    reads nothing of the strategy that drives it."""

    def __init__(
        self, *, chunks: Size = "auto", offload: Switch = "auto", offload_dq: Switch = "auto", ring_size: Size = "auto",
        attention_backend: AttentionBackend = "auto", head_chunks: Size = "auto",
        layer_classes: Optional[list[str]] = None, pad_to_multiple: bool = True, pad_token_id: int = 0,
        check_memory: bool = True, offload_dir: Optional[Union[str, os.PathLike]] = None, fused_ops: Switch = "auto",
        cpu_offload_params: bool = False, sync_every_batch: Switch = "auto", plan_trial: bool = False,
    ) -> None:
        self.options = FPDTOptions(chunks=chunks, offload=offload, offload_dq=offload_dq, head_chunks=head_chunks,
                                   ring_size=ring_size, attention_backend=attention_backend)
        check_switch("sync_every_batch", sync_every_batch)
        check_switch("fused_ops", fused_ops)
        self.layer_classes = layer_classes
        self.cpu_offload_params, self.sync_every_batch, self.fused_ops = cpu_offload_params, sync_every_batch, fused_ops
        self.offload_dir = checked_offload_dir(offload_dir)
        self.memory = MemoryBudget(options=self.options, check=check_memory, offload_dir=self.offload_dir,
                                   plan_trial=plan_trial)
        """The plans of the lengths trained, the host memory guard, the page-locked states (``strategy/budget.py``)."""
        self.batches = BatchStep(pad_token_id=pad_token_id, pad_to_multiple=pad_to_multiple, log=rank_zero_info)
        self.device_mesh: Optional[DeviceMesh] = None
        self.context: Optional[SequenceParallelContext] = None
        """The attention, group and per-batch state the model's installed wrappers share with the run."""
        self.geometry: Optional[AttentionGeometry] = None
        self.vocabulary: Optional[tokens.Vocabulary] = None  # read once at setup; every batch's ids are checked
        self.model: Optional[nn.Module] = None
        """The model the early gathers serve: the last one set up that trains (the first one set up otherwise)."""
        self.early_gathers: Optional[EarlyGathers] = None
        self.batch_plan: Optional[BatchPlan] = None
        """What the sharding of the last batch decided (its layout, documents, valid tokens)."""
        self.pending_rng_states: Optional[dict[str, Any]] = None

    # ---- setup ----------------------------------------------------------------------------------------------------
    def build_mesh(self, *, world_size: int, devices_per_node: int, device_type: str, data_parallel_size: Size,
                   sequence_parallel_size: Size, heads: Optional[tuple[int, int]]) -> tuple[DeviceMesh, int, int]:
        """The ``(data_parallel, sequence_parallel)`` mesh, with a ring's axes where one is needed
        (``strategy/mesh.py``), its ``"auto"`` sizes resolved for a model of ``heads = (query, kv)`` heads (``None``:
        not known; ``strategy/topology.py``). Returns it with the data- and sequence-parallel sizes it has."""
        dp, sp, ring = resolve_topology(
            world_size=world_size, devices_per_node=devices_per_node, options=self.options,
            data_parallel_size=data_parallel_size, sequence_parallel_size=sequence_parallel_size, heads=heads)
        self.device_mesh = build_mesh(device_type, dp, sp, ring)
        return self.device_mesh, dp, sp

    def bind(self, *, model: Optional[nn.Module], device: torch.device, world_size: int, local_processes: int,
             precision: str, callbacks: Any = (), accumulate_grad_batches: int = 1,
             agree: Callable[[bool], bool] = bool, global_rank: int = 0,
             share: Callable[[Any], Any] = lambda value: value) -> None:
        """The facts the memory budget plans each length from (:class:`~lightning_fpdt.strategy.budget.RunFacts`): the
        model, the mesh's sizes (1 before the mesh exists), the options, the memory callbacks; ``share``: rank 0's
        value on every rank (the GPU's calibration, a plan trial's choice)."""
        meshed = self.device_mesh is not None
        self.memory.bind(RunFacts(
            model=model, device=device, world_size=world_size, local_processes=local_processes,
            sequence_parallel_size=self.sequence_parallel_size if meshed else 1,
            ring_size=self.ring_size if meshed else 1, precision=precision,
            cpu_offload_params=self.cpu_offload_params, sync_every_batch=self.sync_every_batch, callbacks=callbacks,
            accumulate_grad_batches=accumulate_grad_batches, agree=agree, global_rank=global_rank, share=share,
            sequence_group=self.sequence_parallel_group if meshed else None))

    def prepare(self, known: Optional[tuple[int, int]] = None) -> None:
        """Before a model is set up: the context its attention will share, with the head groups of ``head_chunks``
        (for ``"auto"`` the plan's of the length ``known`` at setup), and the process's fused-ops switch (before any
        forward)."""
        if self.context is None:
            head_chunks = self.memory.head_chunks_at_setup(known)
            self.context = sequence_parallel_context(self.device_mesh, self.options, head_chunks=head_chunks)
        FUSED_OPS.enabled = self.fused_ops

    def setup_model(self, module: nn.Module, *, precision: FPDTFabricPrecision, callbacks: Any, device: torch.device,
                    rank: int, local_rank: int, data: Any = None) -> nn.Module:
        """The FPDT steps of a model's setup, in place: the callbacks' declared transforms and FSDP2 in
        ``apply_fpdt``'s order, the vocabulary checks and a meta model allocated shard by shard
        (``parallelize_model``); the early gathers of its training steps; the memory budget given the attention and
        its geometry; the host memory guard; the disk tier."""
        if self.context is None:
            raise RuntimeError("FPDTRun.setup_model before prepare(): the model's attention needs the context")
        config = ParallelizeConfig(context=self.context, layer_classes=self.layer_classes,
                                   mp_policy=precision.mixed_precision_policy(),
                                   cpu_offload_params=self.cpu_offload_params, **declared_transforms(callbacks))
        self.geometry, self.vocabulary = parallelize_model(
            module, self.device_mesh, config=config, precision=precision.precision,
            pad_token_id=self.batches.pad_token_id, device=device, rank=rank, data=data)
        if self.model is None or any(p.requires_grad for p in module.parameters()):  # not a frozen reference's
            self.drop_gathers()
            self.model, self.early_gathers = module, EarlyGathers(module, self.layer_classes)
        self.memory.attach(attention=self.context.attention, geometry=self.geometry)
        self.memory.guard_host_memory()
        on_gpu = device.type == "cuda"
        self.memory.open_disk(rank=rank, local_rank=local_rank, pin_memory=on_gpu, planned=on_gpu)
        return module

    def attach_optimizers(self, optimizers: Any) -> None:
        """The optimizers, once made: the memory budget counts their host-resident states as held."""
        assert self.context is not None
        self.memory.attach(attention=self.context.attention, optimizers=optimizers)

    def close(self) -> None:
        """The end of a run: the page-locked states' registration ends, the disk tier's files go."""
        self.memory.close()

    # ---- each batch -----------------------------------------------------------------------------------------------
    def shard(self, batch: Any, move: Callable[[Any], Any], *, training: Optional[bool] = None) -> dict[str, Any]:
        """This rank's share of a global batch ``{"input_ids": (B, S), ...}`` (``strategy/batch.py``): its token ids
        checked against the model's vocabulary before ``move`` puts it on the device (one min/max on the host, no
        device sync); for a training batch (``training``; ``None``: the mode of :attr:`model`) the step's first
        all-gathers started while the host shards it; random states a checkpoint restored applied; the batch's
        length planned when new, and the batch sharded with that plan's chunks."""
        if self.context is None:
            raise RuntimeError("a batch sharded before the model was set up (fabric.setup(model) under Fabric): the "
                               "model's attention must be in place first")
        tokens.check_token_ids(batch, self.vocabulary)
        if training is None:
            training = self.model is not None and self.model.training
        if training and self.early_gathers is not None:
            self.early_gathers.start()  # the step's first all-gathers run while the host shards this batch
        batch = move(batch)
        check_batch(batch)
        if self.pending_rng_states is not None:
            checkpointing.set_rng_states(self.pending_rng_states)
            self.pending_rng_states = None
        sharded, self.batch_plan = self.batches(batch, memory=self.memory, context=self.context,
                                                sp_size=self.sequence_parallel_size,
                                                sp_rank=self.sequence_parallel_rank, ring_size=self.ring_size,
                                                training=bool(training))
        return sharded

    def forward_ran(self) -> None:
        """A training forward ran: FSDP2 has set up its streams there, so the next batches' gathers may start early."""
        if self.early_gathers is not None:
            self.early_gathers.ready = True

    def drop_gathers(self) -> None:
        """Before anything changes the sharded parameters from outside a step's forward and backward (an optimizer
        step a loop runs after it sharded the next batch, a checkpoint's load, the end of a fit): a gather no forward
        took is waited and dropped, so no forward reads parameters older than the shards."""
        if self.early_gathers is not None:
            self.early_gathers.drop()

    def syncs_every_batch(self) -> bool:
        """Whether the batches of an accumulation window reduce-scatter their gradients: ``sync_every_batch``, or for
        ``"auto"`` the choice of the current sequence length's plan (``False`` where nothing planned it)."""
        return self.memory.syncs_every_batch(self.sync_every_batch, self.batch_plan)

    # ---- the loss and the outputs ---------------------------------------------------------------------------------
    def reduce_loss(self, loss: Tensor) -> Tensor:
        """This rank's token-mean loss (over its tokens with a target) as the sequence group's token mean: equal on
        every rank of the group, what one process computes for the whole sequence; its gradient is this rank's share.
        A loss whose graph is built from the group's values (a model's own) is returned as it is: reduced again, its
        gradient would be scaled twice. Collective."""
        if self.context is None or self.batch_plan is None:
            raise RuntimeError("reduce_loss before a batch was sharded (under Fabric: iterate a loader from "
                               "fabric.setup_dataloaders, or call fabric.strategy.shard_batch(batch))")
        if loss.grad_fn is not None and is_sequence_level(loss):
            return loss
        return self.context.reduce(loss, self.batch_plan.valid_tokens)

    def reduced_output(self, output: Any) -> Any:
        """A step's output (a loss, or a mapping with ``"loss"``) whose loss is the sequence group's token mean: a
        loss the step computed from this rank's tokens is reduced (docs/design.md §5.3); one built from the group's
        values stays (``strategy/step_loss.py``, ``is_reduced``), as does anything before the first batch."""
        loss = unwrap_loss(output)
        if loss is None or self.context is None or self.batch_plan is None or is_reduced(loss, self.context):
            return output
        return with_loss(output, self.context.reduce(loss, self.batch_plan.valid_tokens))

    def sequence_sum(self, values: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """Per-sequence sums over the sequence group (``lightning_fpdt.sequence_sum``). Collective."""
        return group_sums(self.context, values, mask, mean=False)

    def sequence_mean(self, values: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """Per-sequence means over the sequence group (``lightning_fpdt.sequence_mean``). Collective."""
        return group_sums(self.context, values, mask, mean=True)

    def gather_outputs(self, output: Any) -> Any:
        """A step's output with every tensor of this rank's tokens, ``(B, S/P, …)``, replaced by the whole
        sequence's ``(B, S, …)``, the padding dropped (``strategy/predict.py``). Collective over the sequence group."""
        assert self.batch_plan is not None
        return gather_sequence(output, self.batch_plan, self.sequence_parallel_group)

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    def checkpoint_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with every rank's random states (torch, CUDA, Python, NumPy): a resumed run draws what the
        uninterrupted one would (``strategy/checkpoint.py``); and the plan trials' choices, so a resumed run does not
        try its lengths again. Collective."""
        state = dict(state)
        checkpointing.gather_rng_states(state, dist.get_world_size())
        self.memory.save_choices(state)
        return state

    def save_checksums(self, path: Any) -> None:
        """After a distributed checkpoint's save: its files' checksums, which :meth:`check_before_load` verifies.
        Collective."""
        checkpointing.save_checksums(path, dist.get_rank(), dist.get_world_size())

    def check_before_load(self, path: Any) -> None:
        """Before a load: a folder whose save was interrupted, or one of whose files changed since, refused by name;
        a gather no forward took dropped (the next forward gathers the loaded parameters). Collective."""
        checkpointing.check_checkpoint_complete(path)
        checkpointing.verify_checksums(path, dist.get_rank(), dist.get_world_size())
        self.drop_gathers()

    def restore_rng_states(self, checkpoint: dict[str, Any], *, at_next_batch: bool) -> None:
        """This rank's random states as they were at the save, taken out of ``checkpoint`` (a checkpoint of another
        number of ranks: afresh, with a warning); set now, or where the Trainer creates a dataloader iterator (which
        draws from the torch generator) between the load and the first batch, at that batch."""
        self.memory.load_choices(checkpoint)  # the plan trials' choices (beside the states in the run's extras)
        states = checkpointing.restored_rng_state(checkpoint, dist.get_world_size(), dist.get_rank())
        if states is not None and at_next_batch:
            self.pending_rng_states = states
        elif states is not None:
            checkpointing.set_rng_states(states)


class DrivesRun(PlannedMemory, MeshSizes):
    """What both fpdt strategies answer from the run they drive (``self.run``), and the steps of the run that read
    Lightning's strategy attributes (the Trainer's and Fabric's strategies name them alike)."""

    run: FPDTRun
    strategy_name = "fpdt"

    @property
    def options(self) -> FPDTOptions:
        """The attention's options, ``"auto"`` where the plan of each length chooses."""
        return self.run.options

    @property
    def memory(self) -> MemoryBudget:
        return self.run.memory

    @property
    def offload_dir(self) -> Optional[str]:
        """The disk tier's directory (``None``: no disk tier)."""
        return self.run.offload_dir

    @property
    def fused_ops(self) -> Switch:
        return self.run.fused_ops

    @property
    def batch_plan(self) -> Optional[BatchPlan]:
        """What the sharding of the last batch decided (its layout, documents, valid tokens)."""
        return self.run.batch_plan

    @batch_plan.setter
    def batch_plan(self, plan: Optional[BatchPlan]) -> None:
        self.run.batch_plan = plan

    @property
    def _context(self) -> Optional[SequenceParallelContext]:
        return self.run.context

    @property
    def _batches(self) -> BatchStep:
        return self.run.batches

    @property
    def last_batch_geometry(self) -> Optional[tuple[int, int, int]]:
        """``(batch_size, seq_len, padded_seq_len)`` of the global sequence of the last batch sharded."""
        plan = self.run.batch_plan
        return None if plan is None else (plan.batch_size, plan.seq_len, plan.padded_len)

    @property
    def last_batch_attention_length(self) -> Optional[float]:
        """``Σ L_d² / S`` of the last batch's packed documents (FLOP counts); ``None``: one document per sequence."""
        return None if self.run.batch_plan is None else self.run.batch_plan.attention_length

    def reduce_loss(self, loss: Tensor) -> Tensor:
        """This rank's token-mean loss as the sequence group's token mean (``lightning_fpdt.sequence_loss``;
        :meth:`FPDTRun.reduce_loss`). Collective."""
        return self.run.reduce_loss(loss)

    def sequence_sum(self, values: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """Per-sequence sums over the sequence group (``lightning_fpdt.sequence_sum``). Collective."""
        return self.run.sequence_sum(values, mask)

    def sequence_mean(self, values: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """Per-sequence means over the sequence group (``lightning_fpdt.sequence_mean``). Collective."""
        return self.run.sequence_mean(values, mask)

    def _build_mesh(self, heads: Optional[tuple[int, int]]) -> None:
        self._device_mesh, self._data_parallel_size, self._sequence_parallel_size = self.run.build_mesh(
            world_size=self.world_size, devices_per_node=self.num_processes, device_type=self.root_device.type,
            data_parallel_size=self._data_parallel_size, sequence_parallel_size=self._sequence_parallel_size,
            heads=heads)

    def _bind_run(self, model: Optional[nn.Module], precision: str, callbacks: Any,
                  accumulate_grad_batches: int = 1) -> None:
        self.run.bind(model=model, device=self.root_device if self.parallel_devices else torch.device("cpu"),
                      world_size=self.world_size, local_processes=self.num_processes, precision=precision,
                      callbacks=callbacks, accumulate_grad_batches=accumulate_grad_batches,
                      agree=lambda yes: self.reduce_boolean_decision(yes, all=True), global_rank=self.global_rank,
                      share=self.broadcast)

    def _setup_run_model(self, module: nn.Module, precision: Any, callbacks: Any, data: Any = None) -> nn.Module:
        if not isinstance(precision, FPDTFabricPrecision):
            raise TypeError(f"the fpdt strategy's precision plugin is an FPDTFabricPrecision, got {precision!r}")
        return self.run.setup_model(module, precision=precision, callbacks=callbacks, device=self.root_device,
                                    rank=self.global_rank, local_rank=self.local_rank, data=data)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="lightning_fpdt sequence parallelism")
