"""``FPDTFabricStrategy``: ``Fabric(strategy="fpdt")``, the fpdt strategy for one's own training loop (docs/fabric.md).

A separate class from the Trainer's :class:`~lightning_fpdt.strategy.FPDTStrategy` because Fabric and the Trainer
have separate strategy interfaces (Lightning's own ``ModelParallelStrategy`` is two classes too); both take the same
steps from the modules beside this one: the mesh (``topology.py``, ``mesh.py``), the model's transforms and FSDP2
(``parallelize.py``), the batch sharding (``batch.py``), the loss reduction (the installed context) and the
distributed checkpoint with checksums (``checkpoint.py``) and the memory budget (``budget.py``: the planner's
choice of the ``"auto"`` options at each new length, the refusal of a length that fits neither memory, the host
memory guard, the disk tier). What the Trainer adds around a step beyond that (the rank watchdog, preemption, the
non-finite loss check, host-resident states) is not part of a Fabric run; the options that drive it are refused here
by name (:data:`TRAINER_ONLY_OPTIONS`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fpdt.flops import attention_heads
from lightning_fpdt.integrations import SequenceParallelContext
from lightning_fpdt.models.ops import FUSED_OPS
from lightning_fpdt.sequence.kernels import AttentionBackend
from lightning_fpdt.sequence.options import FPDTOptions, check_switch
from lightning_fpdt.sequence.planning import AttentionGeometry
from lightning_fpdt.sequence.sizes import resolve_sequence_sizes
from lightning_fpdt.strategy import budget, noise, tokens
from lightning_fpdt.strategy import checkpoint as checkpointing
from lightning_fpdt.strategy.batch import BatchPlan, BatchStep, check_batch
from lightning_fpdt.strategy.materialize import has_meta_parameters
from lightning_fpdt.strategy.mesh import MeshSizes, build_mesh
from lightning_fpdt.strategy.parallelize import (
    ParallelizeConfig,
    declared_transforms,
    parallelize_model,
    sequence_parallel_context,
)
from lightning_fpdt.strategy.planned_memory import PlannedMemory
from lightning_fpdt.strategy.precision import FPDTFabricPrecision, to_fpdt_precision
from lightning_fpdt.strategy.topology import resolve_topology

TRAINER_ONLY_OPTIONS = {
    "cpu_offload_params": "the host-resident states and their in-backward step run inside the Trainer's optimizer step",
    "host_step_in_backward": "the host-resident states and their in-backward step run inside the Trainer's optimizer "
                             "step",
    "device_step_in_backward": "the in-backward step runs inside the Trainer's optimizer step",
    "nonfinite_loss": "your loop holds the loss: check torch.isfinite(loss) there",
    "heartbeat_timeout": "the rank watchdog is part of the Trainer's run",
    "preemption": "the Trainer saves and exits on SIGTERM; in your loop, save with fabric.save",
    "preemption_timeout": "the Trainer saves and exits on SIGTERM; in your loop, save with fabric.save",
    "sync_every_batch": "under Fabric you choose: wrap the batches before a window's last in "
                        "fabric.no_backward_sync(model)",
    "predict_outputs": "trainer.predict only; under Fabric gather outputs yourself",
    "plan_trial": "the trial times the Trainer's training steps and switches configurations between them; under "
                  "Fabric the planner's fastest estimate runs (compare configurations with `python3 -m "
                  "bench.neighbours`)",
}
"""``FPDTStrategy``'s options that have no meaning under Fabric, each with why (named when given)."""


class FPDTFabricStrategy(MeshSizes, PlannedMemory, ModelParallelStrategy):
    """Sequence-parallel training of long sequences in a Fabric loop: Ulysses all-to-all, FPDT chunked attention,
    FSDP2 over the (data × sequence) mesh.

    ``fabric.setup(model, optimizer)`` makes the model sequence-parallel (the attention and loss swapped, the memory
    transforms of ``memory_callbacks``, FSDP2); ``fabric.setup_dataloaders(loader)`` samples per data-parallel group
    (the ranks of a sequence group see the same samples) and cuts each batch to this rank's share of the sequence, so
    the loop is the one a single process runs. A model whose own forward computes the loss (the reference Llama, a
    Hugging Face causal LM given ``labels``) returns the sequence's token mean on every rank; a loss the loop computes
    from local logits becomes it with :meth:`reduce_loss` (``fabric.backward`` reduces one that was not).

    Args:
        sequence_parallel_size: ranks that share one sequence; ``"auto"``: the devices of a node, capped by the heads
            (the mesh is built at the first ``fabric.setup``, where the model's heads are known).
        data_parallel_size: groups that see different samples; ``"auto"``: world size / sequence_parallel_size.
        chunks: FPDT chunks per rank ``u``; ``1`` is plain Ulysses. ``"auto"``: on a GPU, the planner's choice at
            each new sequence length (the fastest that fits the GPU and the host, as under the Trainer); without one,
            at most 65,536 global tokens per chunk.
        offload: keep the attention's q/k/v/out/lse chunks in host memory between forward and backward; ``"auto"``
            as ``chunks``.
        offload_dq: keep the backward's partial dQ sums in host memory too; ``"auto"`` as ``chunks``.
        ring_size: ring ranks ``R`` of a Ulysses × ring sequence mesh (docs/ring.md); ``"auto"``: as the Trainer's.
        attention_backend: block attention kernel: ``"auto"``, ``"cudnn"``, ``"flash"`` or ``"math"``.
        head_chunks: head groups ``G`` (docs/head_chunks.md); ``"auto"`` is 1 under Fabric (the groups are installed
            at ``fabric.setup``, before any length is known).
        layer_classes: class names of the transformer blocks (FSDP2 units); ``None``: the largest ``ModuleList``.
        memory_callbacks: ``ActivationOffload``, ``TiledMLP``, ``TiledLoss``: their transforms applied in
            ``apply_fpdt``'s fixed order, before FSDP2; options left ``"auto"`` take the planner's choice for each
            length. Pass them here, not to ``Fabric(callbacks=...)``.
        check_memory: refuse, at a new sequence length and before anything of it is allocated, a length whose plan
            fits neither the GPU nor the host (``False``: warn and run it).
        offload_dir: a local directory for the disk tier: block inputs beyond the host's memory go to files there,
            as the plan says (docs/planner.md).
        pad_to_multiple: right-pad sequences to a multiple of sequence_parallel_size × chunks (labels -100);
            ``False`` raises instead.
        pad_token_id: the token id used for that padding.
        save_distributed_checkpoint: ``fabric.save`` writes one shard per rank (DCP) and the files' checksums;
            ``False``: one consolidated file.
        process_group_backend: ``"nccl"``, ``"gloo"``, …; default by device.
        timeout: collective timeout.
        fused_ops: the fused RMSNorm, RoPE and SiLU-product kernels (``FPDTStrategy``'s option); ``"auto"``: on CUDA.
    """

    strategy_name = "fpdt"

    def __init__(
        self,
        *,
        sequence_parallel_size: Union[Literal["auto"], int] = "auto",
        data_parallel_size: Union[Literal["auto"], int] = "auto",
        chunks: Union[Literal["auto"], int] = "auto",
        offload: Union[Literal["auto"], bool] = "auto",
        offload_dq: Union[Literal["auto"], bool] = "auto",
        ring_size: Union[Literal["auto"], int] = "auto",
        attention_backend: AttentionBackend = "auto",
        head_chunks: Union[Literal["auto"], int] = "auto",
        layer_classes: Optional[list[str]] = None,
        memory_callbacks: Sequence[Any] = (),
        pad_to_multiple: bool = True,
        pad_token_id: int = 0,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        fused_ops: Union[Literal["auto"], bool] = "auto",
        check_memory: bool = True,
        offload_dir: Optional[Union[str, os.PathLike]] = None,
        **trainer_options: Any,
    ) -> None:
        if trainer_options:
            named = [name for name in trainer_options if name in TRAINER_ONLY_OPTIONS]
            if named:
                raise ValueError("; ".join(f"{name} is an option of Trainer(strategy=FPDTStrategy(...)) only: "
                                           f"{TRAINER_ONLY_OPTIONS[name]}" for name in named))
            raise TypeError(f"FPDTFabricStrategy got unexpected keyword arguments {sorted(trainer_options)}")
        noise.quiet_lightning()  # Lightning's tips and a deprecation it triggers say nothing about a run
        super().__init__(parallelize_fn=self._parallelize, data_parallel_size=data_parallel_size,
                         tensor_parallel_size="auto", save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.options = FPDTOptions(chunks=chunks, offload=offload, offload_dq=offload_dq, head_chunks=head_chunks,
                                   ring_size=ring_size, attention_backend=attention_backend)
        check_switch("fused_ops", fused_ops)
        self.fused_ops = fused_ops
        self._sequence_parallel_size = sequence_parallel_size
        self._layer_classes = layer_classes
        self._transforms = declared_transforms(memory_callbacks)  # a callback that declares no slot is refused below
        undeclared = [type(c).__name__ for c in memory_callbacks if getattr(c, "fpdt_transform_slot", None) is None]
        if undeclared:
            raise ValueError(f"memory_callbacks takes the memory callbacks (ActivationOffload, TiledMLP, TiledLoss), "
                             f"got {undeclared}: pass other callbacks to Fabric(callbacks=...)")
        self._memory_callbacks = list(memory_callbacks)
        self.memory = budget.MemoryBudget(options=self.options, check=check_memory,
                                          offload_dir=budget.checked_offload_dir(offload_dir))
        """Each length's plan, the host memory guard, the disk tier (``strategy/budget.py``)."""
        self._pad_token_id = pad_token_id
        self._context: Optional[SequenceParallelContext] = None
        self._geometry: Optional[AttentionGeometry] = None
        self._vocabulary: Optional[tokens.Vocabulary] = None
        self._batches = BatchStep(pad_token_id=pad_token_id, pad_to_multiple=pad_to_multiple, log=rank_zero_info)
        self.batch_plan: Optional[BatchPlan] = None
        """What the sharding of the last batch decided (its layout, documents, valid tokens)."""

    # ---- sizes and mesh -------------------------------------------------------------------------------------------
    @property
    @override
    def device_mesh(self) -> Any:
        """The ``(data_parallel, sequence_parallel)`` mesh (``strategy/mesh.py``), with a ring's axes where one is
        needed. Built at the first ``fabric.setup``, where the model's heads cap ``sequence_parallel_size="auto"`` and
        choose ``ring_size="auto"``; read before it (``fabric.setup_dataloaders`` first), it is built without them."""
        if self._device_mesh is None:
            self._build_mesh(heads=None)
        return self._device_mesh

    def _build_mesh(self, heads: Optional[tuple[int, int]]) -> None:
        if not torch.distributed.is_initialized():
            raise RuntimeError("the fpdt mesh is built once the processes have started: call fabric.launch() first")
        dp, sp, ring = resolve_topology(
            world_size=self.world_size, devices_per_node=self.num_processes, options=self.options,
            data_parallel_size=self._data_parallel_size, sequence_parallel_size=self._sequence_parallel_size,
            heads=heads,
        )
        self._data_parallel_size, self._sequence_parallel_size = dp, sp
        self._device_mesh = build_mesh(self.root_device.type, dp, sp, ring)

    @property
    @override
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else FPDTFabricPrecision()

    @precision.setter
    @override
    def precision(self, precision: Optional[Precision]) -> None:
        # Fabric hands over the plugin it chose from Fabric(precision=...): FSDP2's policy replaces autocast
        self._precision = to_fpdt_precision(precision, FPDTFabricPrecision)

    @override
    def setup_environment(self) -> None:
        # not super().setup_environment(): it would build the (data, tensor) mesh the (data, sequence) one replaces
        super(ModelParallelStrategy, self).setup_environment()  # the device
        self._setup_distributed()
        # sizes that cannot work are refused now, on every rank; the mesh waits for the model's heads (fabric.setup),
        # which "auto" sizes and the ring's size are resolved with
        resolve_sequence_sizes(world_size=self.world_size, devices_per_node=self.num_processes,
                               data_parallel_size=self._data_parallel_size,
                               sequence_parallel_size=self._sequence_parallel_size, ring_size=self.options.ring_size,
                               heads=None)

    # ---- model ----------------------------------------------------------------------------------------------------
    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """The FPDT steps (``parallelize_model``: the attention and loss swapped, the memory transforms, FSDP2, a meta
        model allocated shard by shard), the module on this rank's device."""
        if self._device_mesh is None:
            self._build_mesh(heads=attention_heads(module))
        self.memory.bind(budget.RunFacts(
            model=module, device=self.root_device, world_size=self.world_size, local_processes=self.num_processes,
            sequence_parallel_size=self.sequence_parallel_size, ring_size=self.ring_size,
            precision=self.precision.precision, callbacks=self._memory_callbacks, global_rank=self.global_rank,
            agree=lambda yes: self.reduce_boolean_decision(yes, all=True), share=self.broadcast,
            sequence_group=self.sequence_parallel_group))
        if self._context is None:
            self._context = sequence_parallel_context(self.device_mesh, self.options,
                                                      head_chunks=self.memory.head_chunks_at_setup(None))
        FUSED_OPS.enabled = self.fused_ops  # the process's model ops (before any forward)
        if not has_meta_parameters(module):
            module.to(self.root_device)  # FSDP2 shards what is on the mesh's device
        return self._parallelize(module, self.device_mesh)

    def _parallelize(self, module: nn.Module, mesh: Any) -> nn.Module:
        assert self._context is not None
        assert isinstance(self.precision, FPDTFabricPrecision)
        config = ParallelizeConfig(context=self._context, layer_classes=self._layer_classes,
                                   mp_policy=self.precision.mixed_precision_policy(), **self._transforms)
        self._geometry, self._vocabulary = parallelize_model(
            module, mesh, config=config, precision=self.precision.precision, pad_token_id=self._pad_token_id,
            device=self.root_device, rank=self.global_rank)
        self.memory.attach(attention=self._context.attention, geometry=self._geometry)
        self.memory.guard_host_memory()
        on_gpu = self.root_device.type == "cuda"
        self.memory.open_disk(rank=self.global_rank, local_rank=self.local_rank, pin_memory=on_gpu, planned=on_gpu)
        return module

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None
    ) -> tuple[nn.Module, list[Optimizer], Optional[Any]]:
        """The module set up (:meth:`setup_module`), and the optimizers made before it pointed at its sharded
        parameters: FSDP2 replaces each parameter with a sharded one, which the optimizers must step."""
        before = {name: param for name, param in module.named_parameters(remove_duplicate=False)}
        stateful = [type(o).__name__ for o in optimizers if o.state]
        if stateful:
            raise ValueError(f"optimizers {stateful} have stepped already: set up the model with fabric.setup before "
                             f"the first step (load a checkpoint after it with fabric.load)")
        module = self.setup_module(module)
        after = dict(module.named_parameters(remove_duplicate=False))
        replaced = {id(param): after[name] for name, param in before.items() if name in after}
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [replaced.get(id(param), param) for param in group["params"]]
        optimizers = [self.setup_optimizer(o) for o in optimizers]
        self.memory.attach(attention=self._context.attention, optimizers=optimizers)
        return module, optimizers, scheduler

    @override
    def module_to_device(self, module: nn.Module) -> None:
        pass  # setup_module places it: allocated shard by shard when on the meta device

    # ---- data -----------------------------------------------------------------------------------------------------
    def shard_batch(self, batch: Any) -> dict[str, Any]:
        """This rank's share of a global batch ``{"input_ids": (B, S), "labels": ...}`` (on this rank's device), by
        the project's one :class:`~lightning_fpdt.SequenceLayout`: the tokens, their global ``position_ids`` and the
        labels shifted on the global sequence; the model's forward then runs on this batch. The loaders of
        ``fabric.setup_dataloaders`` call it for every batch; call it yourself for batches from elsewhere. Every rank
        of a sequence group must shard the same global batch."""
        if self._context is None:
            raise RuntimeError("shard_batch before fabric.setup(model): the model's attention must be in place first")
        tokens.check_token_ids(batch, self._vocabulary)
        check_batch(batch)
        batch = move_data_to_device(batch, self.root_device)
        sharded, self.batch_plan = self._batches(batch, memory=self.memory, context=self._context,
                                                 sp_size=self.sequence_parallel_size,
                                                 sp_rank=self.sequence_parallel_rank, ring_size=self.ring_size)
        return sharded

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Each batch cut to this rank's share of the sequence (:meth:`shard_batch`)."""
        return SequenceShardedLoader(dataloader, self.shard_batch)

    # ---- the loss -------------------------------------------------------------------------------------------------
    def reduce_loss(self, loss: Tensor) -> Tensor:
        """This rank's token-mean loss (over its tokens with a target) as the sequence group's token mean: equal on
        every rank of the group, what one process computes for the whole sequence; its gradient is this rank's
        share. A loss already reduced (a model's own, under the strategy) is returned as it is. Collective."""
        if self._context is None or self.batch_plan is None:
            raise RuntimeError("reduce_loss before a batch was sharded: iterate a loader from "
                               "fabric.setup_dataloaders, or call fabric.strategy.shard_batch(batch)")
        if self._context.loss_reduced:
            return loss
        return self._context.reduce(loss, self.batch_plan.valid_tokens)

    @override
    def backward(self, tensor: Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        """The backward of the sequence group's token-mean loss: a loss the loop computed from local logits and did
        not reduce (:meth:`reduce_loss`) is reduced first, so every rank's gradient is its share of the sequence's."""
        if self._context is not None and self.batch_plan is not None and not self._context.loss_reduced:
            tensor = self.reduce_loss(tensor)
        super().backward(tensor, module, *args, **kwargs)

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """Lightning's save (one shard per rank and ``meta.pt``, or one file) with every rank's random states (the
        loop draws after a resume what it would have drawn), then the distributed checkpoint's checksums
        (``strategy/checkpoint.py``), which :meth:`load_checkpoint` verifies. Collective."""
        path = Path(self.broadcast(path))
        state = dict(state)
        checkpointing.gather_rng_states(state, self.world_size)
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
        if self._save_distributed_checkpoint:
            checkpointing.save_checksums(path, self.global_rank, self.world_size)

    @override
    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Refuse a folder whose save was interrupted or whose files changed since (named), then Lightning's load
        into ``state``'s model and optimizers, and this rank's random states as they were at the save (a checkpoint
        of another number of ranks: afresh, with a warning). Collective."""
        path = Path(self.broadcast(path))
        checkpointing.check_checkpoint_complete(path)
        checkpointing.verify_checksums(path, self.global_rank, self.world_size)
        remainder = super().load_checkpoint(path, state=state, strict=strict, weights_only=weights_only)
        if isinstance(remainder, dict):
            states = checkpointing.restored_rng_state(remainder, self.world_size, self.global_rank)
            if states is not None:
                checkpointing.set_rng_states(states)
        return remainder

    @override
    def teardown(self) -> None:
        self.memory.close()  # the states' registration ends, the disk tier's files go
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="lightning_fpdt sequence parallelism")


class SequenceShardedLoader:
    """A data loader whose batches come out cut to this rank's share of the sequence (``shard``); everything else
    (``len``, ``sampler``, ``dataset``, ``batch_size``) is the wrapped loader's."""

    def __init__(self, loader: Any, shard: Callable[[Any], Any]) -> None:
        self._loader = loader
        self._shard = shard

    def __iter__(self) -> Iterator[Any]:
        for batch in self._loader:
            yield self._shard(batch)

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_loader", "_shard"):
            raise AttributeError(name)
        return getattr(self._loader, name)

