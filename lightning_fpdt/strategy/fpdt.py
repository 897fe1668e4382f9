"""``FPDTStrategy``: ``Trainer(strategy="fpdt")`` (docs/design.md §5). Lightning's hooks only; the work is in the
modules beside this one (batch sharding, checkpoint state, meta init, the memory budget, the mesh, ``apply_fpdt``)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_fpdt.callbacks.gradient_check import add_gradient_check
from lightning_fpdt.flops import attention_heads
from lightning_fpdt.integrations import SequenceParallelContext
from lightning_fpdt.integrations.adapters import keep_trained_adapters
from lightning_fpdt.integrations.attributes import DEVICE_MESH
from lightning_fpdt.integrations.huggingface import train_mode_for_fit
from lightning_fpdt.lightning_private import evaluate_under_no_grad, wrapped_closure
from lightning_fpdt.memory.surgery import find_model
from lightning_fpdt.models.ops import FUSED_OPS
from lightning_fpdt.offload.host_memory import HostMemoryError
from lightning_fpdt.sequence.kernels import AttentionBackend
from lightning_fpdt.sequence.options import FPDTOptions, check_switch
from lightning_fpdt.sequence.planning import AttentionGeometry
from lightning_fpdt.strategy import budget
from lightning_fpdt.strategy import checkpoint as checkpointing
from lightning_fpdt.strategy import noise, storage, tokens
from lightning_fpdt.strategy.batch import BatchPlan, BatchStep, check_batch
from lightning_fpdt.strategy.host_optimizer import (
    InBackwardStep,
    fuse_optimizers,
    host_step,
    host_threads,
    prepare_device_step,
    prepare_host_step,
)
from lightning_fpdt.strategy.loss import TrainingLossCheck, unwrap_loss, with_loss
from lightning_fpdt.strategy.materialize import has_meta_parameters
from lightning_fpdt.strategy.mesh import MeshSizes, build_mesh
from lightning_fpdt.strategy.parallelize import (
    EarlyGathers,
    ParallelizeConfig,
    declared_transforms,
    no_gradient_sync,
    parallelize_model,
    sequence_parallel_context,
)
from lightning_fpdt.strategy.planned_memory import PlannedMemory
from lightning_fpdt.strategy.precision import FPDTPrecision, to_fpdt_precision
from lightning_fpdt.strategy.predict import check_predict_outputs, gather_sequence
from lightning_fpdt.strategy.preemption import DEFAULT_TIMEOUT, Preemption, add_preemption_checkpoint, watch_with
from lightning_fpdt.strategy.topology import resolve_topology
from lightning_fpdt.strategy.watchdog import DEFAULT_STALE_AFTER, RankWatchdog, checked_heartbeat_timeout


class FPDTStrategy(MeshSizes, PlannedMemory, ModelParallelStrategy):
    """Sequence-parallel training of long sequences: Ulysses all-to-all, FPDT chunked attention, FSDP2.

    Args:
        sequence_parallel_size: ranks that share one sequence; ``"auto"``: the devices of a node, capped by what
            the model's head counts allow.
        data_parallel_size: groups that see different samples; ``"auto"``: world size / sequence_parallel_size.
        chunks: FPDT chunks per rank ``u``; ``1`` is plain Ulysses.
        offload: keep the attention's q/k/v/out/lse chunks in pinned host memory between forward and backward.
        offload_dq: keep the backward's partial dQ sums (fp32, twice q's size) in host memory too.
            ``"auto"`` (these three, ``head_chunks`` and the memory callbacks' ``"auto"`` options): on a GPU, for a
            model whose config the planner reads, the fastest configuration that fits the GPU and the host memory,
            chosen per sequence length by the planner's search (docs/planner.md) and logged with its predicted peaks;
            elsewhere at most 65,536 global tokens per chunk and nothing offloaded.
        ring_size: ring ranks ``R`` of a Ulysses × ring sequence mesh (``sequence_parallel_size = U·R``,
            docs/ring.md), for more ranks than the heads allow; ``"auto"``: 1 when the heads allow
            ``sequence_parallel_size``, else the smallest ``R`` that works. With ``R > 1`` chunks are 1.
        attention_backend: block attention kernel: ``"auto"``, ``"cudnn"``, ``"flash"`` or ``"math"``.
        head_chunks: head groups ``G``: each attention layer runs ``H/G`` query heads (and their kv heads) at a
            time, so its full-width q/k/v/out never exist at once (docs/head_chunks.md); ``G`` must divide the kv
            heads. ``1``: all heads at once. ``"auto"``: chosen at setup with the other ``"auto"`` options when the
            sequence length is known then (a data module's ``seq_len``) and the model's attention can be grouped,
            else 1.
        layer_classes: class names of the transformer blocks (FSDP2 units); ``None``: the largest ``ModuleList``.
        cpu_offload_params: keep sharded parameters, gradients and optimizer state in host memory (FSDP2
            ``CPUOffloadPolicy``), for models whose states do not fit the GPUs.
        host_step_in_backward: with ``cpu_offload_params``, step each parameter on the host as soon as its gradient
            lands there, during the backward (``strategy/host_optimizer.py``); with gradient clipping, several
            optimizers or one other than Adam, AdamW or SGD the step runs after the backward (a note says why).
        device_step_in_backward: with the states on the GPU (no ``cpu_offload_params``), step each parameter as
            soon as FSDP2 has reduce-scattered its gradient, on that reduce-scatter's stream, beside the backward of
            the layers below; the same update, under the same conditions as ``host_step_in_backward``, from the
            second optimizer step on (the first allocates the optimizer's states and steps after the backward).
        pad_to_multiple: right-pad sequences to a multiple of sequence_parallel_size × chunks (labels -100);
            ``False`` raises instead.
        nonfinite_loss: ``"raise"`` stops training on every rank at the first NaN/inf loss, naming the step;
            ``"ignore"`` trains on (no check, no extra collective).
        pad_token_id: the token id used for that padding.
        save_distributed_checkpoint: save one shard per rank (DCP) instead of one consolidated file.
        process_group_backend: ``"nccl"``, ``"gloo"``, …; default by device.
        timeout: collective timeout.
        heartbeat_timeout: seconds a rank's heartbeat may stand still before the rank counts as dead or frozen; the
            others then name it and end the job (``strategy/watchdog.py``). A long step never stops a heartbeat.
            ``None``: no watch (a frozen rank then holds the others for the collective ``timeout``).
        check_memory: refuse, at setup or at a new sequence length, a run whose plan does not fit the GPU or the
            host, naming the change that fits; ``False`` warns instead and runs.
        preemption: on SIGTERM (and SLURM's requeue signal under ``SLURMEnvironment(auto_requeue=True)``) every rank
            stops after the same optimizer step, saves ``hpc_ckpt_<N>.ckpt`` in ``default_root_dir`` and exits with
            status ``128 + signal`` (``strategy/preemption.py``); ``False``: Lightning's own handling.
        preemption_timeout: seconds a rank may make no progress after a stop signal, beyond its longest step and
            checkpoint save so far, before it exits without a checkpoint (a peer hangs outside the collective).
        offload_dir: a directory on a local disk for the disk tier (docs/design.md §4.4): the checkpointed block
            inputs of ``ActivationOffload`` (and the attention's chunks when ``offload`` is on) that the host's memory
            cannot hold go to files there, written behind and read ahead; the planner counts its free space and its
            time and uses it only where host memory does not suffice. Each process writes under
            ``<offload_dir>/fpdt-<host>-<pid>-rank<r>/``, removed at the end of training and at exit; directories a
            crash left are named at setup, not removed. A directory that cannot be created or written, or that has
            less free space than the plan puts there, is refused with the bytes; without a GPU, where nothing plans
            and nothing spills, one that cannot be used is a warning. ``None``: no disk tier.
        sync_every_batch: with ``Trainer(accumulate_grad_batches > 1)``: ``True`` reduce-scatters the gradients after
            every batch, into their shards (the memory of a step without accumulation, ``A - 1`` more
            reduce-scatters per optimizer step); ``False`` only after a window's last batch, the batches before it
            adding into every parameter's unsharded gradient, which waits on every GPU in the reduce dtype (fp32
            under ``bf16-mixed``: 4 bytes per parameter, 32 GB for an 8B model, whatever the GPU count).
            ``"auto"``: the planner's choice per sequence length, the faster that fits by its cost model (``False``
            where the unsharded gradients fit beside the rest as it is); ``False`` where nothing plans (no GPU, no
            model config the planner reads).
        fused_ops: run the RMSNorms, RoPE and the gated MLPs' SiLU product (the reference Llama's, a Hugging Face
            family's norms and SiLU-gated MLPs), and the tiled loss's softmax and its gradient over each tile's
            logits, as one fused kernel per pass, compiled by ``torch.compile`` (``lightning_fpdt.models.ops``): the
            same formulas, several times fewer trips through device memory.
            ``"auto"``: on CUDA devices; ``False``: the eager forms. Where compiling fails the ops run eager, with one
            warning. Unless ``False``, Adam and AdamW whose ``fused`` and ``foreach`` the module left unset step with
            torch's fused CUDA kernel where their parameters are on the GPU (the same update in one pass per tensor).
        predict_outputs: what ``trainer.predict`` returns: ``"sequence"``, on every rank the outputs of the whole
            sequence, as one process returns them (each tensor of shape ``(B, S/P, …)`` that ``predict_step``
            returns gathered from the sequence group into ``(B, S, …)``, the padding dropped); ``"rank"``, each rank's
            own shard, in the layout's token order (docs/design.md §3), padding included.
        plan_trial: where the fastest configurations that fit a new sequence length are within 10% of each other by
            the planner's step-time model, train its first steps on each in turn (one untimed step and two timed ones
            each) and keep the fastest for the rest of the run (``lightning_fpdt.planner.trial``, docs/planner.md);
            the choice is logged and kept with checkpoints. Every candidate computes the same gradients. On a GPU,
            for a model whose config the planner reads; ``False``: the planner's fastest estimate runs.
    """

    strategy_name = "fpdt"
    applies_memory_transforms = True
    """The memory callbacks' declared transforms are applied here, in ``apply_fpdt``'s order, before FSDP2."""

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
        cpu_offload_params: bool = False,
        host_step_in_backward: bool = True,
        device_step_in_backward: bool = True,
        pad_to_multiple: bool = True,
        nonfinite_loss: Literal["raise", "ignore"] = "raise",
        pad_token_id: int = 0,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        heartbeat_timeout: Optional[float] = DEFAULT_STALE_AFTER,
        check_memory: bool = True,
        preemption: bool = True,
        preemption_timeout: float = DEFAULT_TIMEOUT,
        offload_dir: Optional[Union[str, os.PathLike]] = None,
        sync_every_batch: Union[Literal["auto"], bool] = "auto",
        fused_ops: Union[Literal["auto"], bool] = "auto",
        predict_outputs: Literal["sequence", "rank"] = "sequence",
        plan_trial: bool = True,
    ) -> None:
        noise.quiet_lightning()  # before the Trainer that takes this strategy logs its tips
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size="auto",
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.options = FPDTOptions(chunks=chunks, offload=offload, offload_dq=offload_dq, head_chunks=head_chunks,
                                   ring_size=ring_size, attention_backend=attention_backend)
        self._loss_check = TrainingLossCheck.of(nonfinite_loss, warn=rank_zero_warn)
        self._heartbeat_timeout = checked_heartbeat_timeout(heartbeat_timeout)
        check_switch("sync_every_batch", sync_every_batch)
        check_switch("fused_ops", fused_ops)
        self.sync_every_batch, self.fused_ops = sync_every_batch, fused_ops
        self.predict_outputs = check_predict_outputs(predict_outputs)
        self._sequence_parallel_size = sequence_parallel_size
        self._layer_classes = layer_classes
        self.cpu_offload_params = cpu_offload_params
        self._host_step_in_backward = host_step_in_backward
        self._device_step_in_backward = device_step_in_backward
        self._in_backward: Optional[InBackwardStep] = None
        self._early_gathers: Optional[EarlyGathers] = None
        self._geometry: Optional[AttentionGeometry] = None
        self._vocabulary: Optional[tokens.Vocabulary] = None  # read once at setup; every batch's ids are checked
        self._checkpoint_size: Optional[storage.CheckpointSize] = None  # counted at setup, named when a save fails
        self.offload_dir = budget.checked_offload_dir(offload_dir)
        self.memory = budget.MemoryBudget(options=self.options, check=check_memory, offload_dir=self.offload_dir,
                                          plan_trial=plan_trial)
        """The plans of the lengths trained, the host memory guard, the page-locked states (``strategy/budget.py``)."""
        self._batches = BatchStep(pad_token_id=pad_token_id, pad_to_multiple=pad_to_multiple, log=rank_zero_info)
        self._context: Optional[SequenceParallelContext] = None
        self._pending_rng_states: Optional[dict[str, Any]] = None
        self._watchdog: Optional[RankWatchdog] = None
        self._preemption = Preemption(timeout=preemption_timeout) if preemption else None
        self.batch_plan: Optional[BatchPlan] = None
        """What the sharding of the last batch decided (its layout, documents, valid tokens)."""

    # ---- sizes and mesh (the sizes, rank and groups: MeshSizes) --------------------------------------------------
    @property
    def last_batch_geometry(self) -> Optional[tuple[int, int, int]]:
        """``(batch_size, seq_len, padded_seq_len)`` of the global sequence of the last batch sharded."""
        plan = self.batch_plan
        return None if plan is None else (plan.batch_size, plan.seq_len, plan.padded_len)

    @property
    def last_batch_attention_length(self) -> Optional[float]:
        """``Σ L_d² / S`` of the last batch's packed documents (FLOP counts); ``None``: one document per sequence."""
        return None if self.batch_plan is None else self.batch_plan.attention_length

    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else FPDTPrecision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        # also reached when the strategy is given as a string, where Lightning itself checks nothing
        self._precision_plugin = to_fpdt_precision(plugin)

    @override
    def setup_environment(self) -> None:
        # not super().setup_environment(): it would build a (data, tensor) mesh, process groups included, that the
        # (data, sequence) mesh below replaces; _setup_distributed is the rest of it (device, ranks, process group)
        self._setup_distributed()
        run = self.broadcast(uuid.uuid4().hex[:12])  # this run's keys in a store that may outlive it
        self._watchdog = RankWatchdog(self.global_rank, self.world_size, stale_after=self._heartbeat_timeout,
                                      namespace=f"fpdt/{run}")
        self._watchdog.start()
        if self._preemption is not None:
            watch_with(self._preemption, self._watchdog)
        dp, sp, ring = resolve_topology(
            world_size=self.world_size, devices_per_node=self.num_processes, options=self.options,
            data_parallel_size=self._data_parallel_size, sequence_parallel_size=self._sequence_parallel_size,
            heads=attention_heads(self.lightning_module),
        )
        self._data_parallel_size, self._sequence_parallel_size = dp, sp
        self._device_mesh = build_mesh(self.root_device.type, dp, sp, ring)
        setattr(self.lightning_module, DEVICE_MESH, self._device_mesh)

    # ---- model ----------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        # Lightning's base sequence (Strategy.setup: the accelerator, the precision's module conversion,
        # model_to_device, _setup_model, the optimizers, the precision plugin, the optimizers' states to the device),
        # the FPDT steps in its hooks below; not ModelParallelStrategy.setup, which requires configure_model and puts
        # a meta model on the GPU before apply_fpdt could shard it
        evaluate_under_no_grad(trainer)  # DTensor parameters do not work under inference_mode
        self.memory.bind(self._run_facts(trainer))
        if self._context is None:
            head_chunks = self.memory.head_chunks_at_setup(budget.known_length(trainer))
            self._context = sequence_parallel_context(self.device_mesh, self.options, head_chunks=head_chunks)
        FUSED_OPS.enabled = self.fused_ops  # the process's model ops (before any forward)
        Strategy.setup(self, trainer)
        if trainer.state.fn == TrainerFn.FITTING:  # a folder that cannot take a checkpoint fails now, not hours in
            self._checkpoint_size = storage.check_at_setup(self, trainer, preemption=self._preemption is not None)
        known = budget.known_length(trainer)
        if known is not None:  # the length is known before the first batch
            self.check_memory_plan(*known, collective=True)
        add_preemption_checkpoint(trainer, self._preemption)
        if trainer.state.fn == TrainerFn.FITTING:  # a parameter that gets no gradient stops the run
            add_gradient_check(trainer)
            if train_mode_for_fit(find_model(self.lightning_module)):
                rank_zero_info("fpdt: the Hugging Face model was in eval mode (as from_pretrained returns it): put in "
                               "training mode for fit")
        noise.steps_only_epochs(trainer)

    @override
    def model_to_device(self) -> None:
        if has_meta_parameters(self.model):
            return  # allocated shard by shard once sharded (_setup_model)
        super().model_to_device()  # FSDP2 shards what is on the mesh's device

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The FPDT steps of setup: the model transforms and FSDP2 (``apply_fpdt``), the vocabulary checks, a meta
        model allocated shard by shard, the host memory guard and the disk tier."""
        trainer = self.lightning_module.trainer
        self._geometry, self._vocabulary = parallelize_model(
            model, self.device_mesh, config=self._parallelize_config(trainer),
            precision=self.precision_plugin.precision, pad_token_id=self._batches.pad_token_id, device=self.root_device,
            rank=self.global_rank, data=trainer.datamodule)
        if not self.cpu_offload_params:
            super().model_to_device()
        self._early_gathers = EarlyGathers(model, self._layer_classes)
        self.memory.attach(attention=self._context.attention, geometry=self._geometry)
        self.memory.guard_host_memory()
        on_gpu = self.root_device.type == "cuda"
        self.memory.open_disk(rank=self.global_rank, local_rank=self.local_rank, pin_memory=on_gpu, planned=on_gpu)
        self.barrier()
        return model

    @override
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        super().setup_optimizers(trainer)
        if self.cpu_offload_params:
            self._in_backward = prepare_host_step(self.optimizers, trainer, in_backward=self._host_step_in_backward,
                                                  threads=host_threads(self.num_processes), replaces=self._in_backward)
        else:
            if self.root_device.type == "cuda" and self.fused_ops is not False:
                fuse_optimizers(self.optimizers, "cuda")  # one pass per tensor instead of foreach's eight
            self._in_backward = prepare_device_step(self.optimizers, trainer, in_backward=self._device_step_in_backward,
                                                    replaces=self._in_backward)
        self.memory.attach(attention=self._context.attention, optimizers=self.optimizers)

    def _parallelize_config(self, trainer: "pl.Trainer") -> ParallelizeConfig:
        """The callbacks' declared transforms in their slots (docs/design.md §6), the precision and the context."""
        assert isinstance(self.precision_plugin, FPDTPrecision)
        return ParallelizeConfig(context=self._context, layer_classes=self._layer_classes,
                                 mp_policy=self.precision_plugin.mixed_precision_policy(),
                                 cpu_offload_params=self.cpu_offload_params, **declared_transforms(trainer.callbacks))

    def _run_facts(self, trainer: Optional["pl.Trainer"]) -> budget.RunFacts:
        """What the memory budget plans this run from (``strategy/budget.py``)."""
        return budget.RunFacts(
            model=self.model, device=self.root_device if self.parallel_devices else torch.device("cpu"),
            world_size=self.world_size, local_processes=self.num_processes,
            sequence_parallel_size=self.sequence_parallel_size if self._device_mesh is not None else 1,
            ring_size=self.ring_size if self._device_mesh is not None else 1,
            precision=self.precision_plugin.precision, cpu_offload_params=self.cpu_offload_params,
            sync_every_batch=self.sync_every_batch, callbacks=getattr(trainer, "callbacks", ()),
            accumulate_grad_batches=getattr(trainer, "accumulate_grad_batches", 1), global_rank=self.global_rank,
            agree=lambda yes: self.reduce_boolean_decision(yes, all=True), share=self.broadcast,
            sequence_group=self.sequence_parallel_group if self._device_mesh is not None else None)

    # ---- data -----------------------------------------------------------------------------------------------------
    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """Move the batch, then shard its sequence (:func:`~lightning_fpdt.strategy.batch.shard_batch`): this rank's
        tokens, ``position_ids`` and the globally shifted ``labels``/``shift_labels``. A packed batch
        (``document_ids``, or ``position_ids`` restarting at 0) turns on per-document masking (docs/packing.md)."""
        tokens.check_token_ids(batch, self._vocabulary)  # before the move: one min/max on the host, no device sync
        trainer = budget.attached_trainer(self.lightning_module)
        if self._early_gathers is not None and trainer is not None and trainer.training:
            self._early_gathers.start()  # the step's first all-gathers run while the host shards this batch
        batch = super().batch_to_device(batch, device, dataloader_idx)
        check_batch(batch)
        if self._pending_rng_states is not None:
            checkpointing.set_rng_states(self._pending_rng_states)
            self._pending_rng_states = None
        sharded, self.batch_plan = self._batches(batch, memory=self.memory, context=self._context,
                                                 sp_size=self.sequence_parallel_size,
                                                 sp_rank=self.sequence_parallel_rank, ring_size=self.ring_size,
                                                 training=trainer is not None and trainer.training)
        return sharded

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Training loaders resume mid-epoch at the checkpointed position (``strategy/checkpoint.py``)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return checkpointing.resumable_loader(dataloader, trainer)

    # ---- steps ----------------------------------------------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """With host-resident states the step's arithmetic runs on all cores of this rank's share of the host, during
        the backward where it can (``strategy/host_optimizer.py``)."""
        threads = host_threads(self.num_processes) if self.cpu_offload_params else torch.get_num_threads()
        if self._in_backward is not None and optimizer is self._in_backward.optimizer:
            model = model or self.lightning_module
            return self._in_backward.run(wrapped_closure(self.precision_plugin, model, optimizer, closure),
                                         threads)
        return host_step(lambda c: super(FPDTStrategy, self).optimizer_step(optimizer, c, model, **kwargs), closure,
                         threads)

    def reduce_loss(self, loss: Tensor) -> Tensor:
        """This rank's token-mean loss (over its tokens with a target) as the sequence group's token mean: the value
        to log (``lightning_fpdt.sequence_loss``). A step that returns it is not reduced again. Collective."""
        return self._context.reduce(loss, self.batch_plan.valid_tokens)

    def _sequence_parallel_output(self, output: Any) -> Any:
        """A loss a model computed itself (local token mean) becomes the group's token mean (docs/design.md §5)."""
        loss = unwrap_loss(output)
        if loss is None or self._context.loss_reduced:
            return output
        return with_loss(output, self.reduce_loss(loss))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = self._sequence_parallel_output(super().training_step(*args, **kwargs))
        if self._early_gathers is not None:
            self._early_gathers.ready = True  # FSDP2 has set up its streams in the first forward
        if self._loss_check is not None:
            self._loss_check(output, self.batch_plan.targetless, self.lightning_module.trainer, rank=self.global_rank)
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._sequence_parallel_output(super().validation_step(*args, **kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._sequence_parallel_output(super().test_step(*args, **kwargs))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().predict_step(*args, **kwargs)
        if self.predict_outputs == "rank":
            return output
        return gather_sequence(output, self.batch_plan, self.sequence_parallel_group)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """A batch of an accumulation window before its last: FSDP2's gradient reduce-scatter only where the gradients
        are synced every batch (``sync_every_batch``)."""
        if self.syncs_every_batch():
            yield
        else:
            with no_gradient_sync(self.model):
                yield

    def syncs_every_batch(self) -> bool:
        """Whether the batches of an accumulation window reduce-scatter their gradients: the option, or for
        ``"auto"`` the choice of the current sequence length's plan (``False`` where nothing planned it)."""
        return self.memory.syncs_every_batch(self.sync_every_batch, self.batch_plan)

    # ---- memory budget, failures, checkpoints ---------------------------------------------------------------------
    def check_memory_plan(self, seq_len: int, batch_size: int = 1, *, collective: bool = False) -> None:
        """Plan ``seq_len`` (``strategy/budget.py``): resolve the ``"auto"`` options to the fastest configuration that
        fits the GPU and the host, hand the memory callbacks their part, log the choice; refuse, before any pinned
        buffer of this length exists, a run that fits neither (with ``check_memory``). At setup (``collective``)
        every rank refuses together, so none waits in a collective for a rank that raised."""
        if self.memory.facts is None:  # planned outside a fit's setup
            self.memory.bind(self._run_facts(budget.attached_trainer(self.lightning_module)))
        self.memory.plan_length(seq_len, batch_size, collective=collective)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Name the rank that died or hung when a collective failed (``strategy/watchdog.py``); a host that ran short
        of memory ends every rank with its message."""
        super().on_exception(exception)
        if self._watchdog is not None:
            if isinstance(exception, HostMemoryError):
                self._watchdog.post_abort(f"rank {self.global_rank}: {exception}")
            self._watchdog.report(exception)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self._early_gathers is not None:
            self._early_gathers.drop()  # a batch whose step did not run (a hook ended the epoch) left its gathers
        keep_trained_adapters(self.lightning_module)  # collective: every rank ends fit here, and none saves later

    @override
    def teardown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
        self.memory.close()  # the states' registration ends before FSDP2 lets the memory go; the disk tier's files go
        if self._preemption is not None:
            self._preemption.uninstall()
        if self._in_backward is not None:
            self._in_backward.close()  # kept: what its last step did stays readable
        super().teardown()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        started = time.monotonic()
        checkpointing.gather_rng_states(checkpoint, self.world_size)
        self.memory.save_choices(checkpoint)  # a plan trial's choices: a resumed run does not try again
        with storage.space_named(Path(filepath), self._checkpoint_size):
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            if self._save_distributed_checkpoint:
                checkpointing.save_checksums(Path(self.broadcast(filepath)), self.global_rank, self.world_size)
        if self._preemption is not None:
            self._preemption.progress(save_seconds=time.monotonic() - started)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        checkpointing.check_checkpoint_complete(path)
        checkpointing.verify_checksums(path, self.global_rank, self.world_size)
        if self._early_gathers is not None:
            self._early_gathers.drop()  # the next forward gathers the loaded parameters
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self.memory.load_choices(checkpoint)
        # applied at the next batch: creating the dataloader iterator in between draws from the torch generator
        self._pending_rng_states = checkpointing.restored_rng_state(checkpoint, self.world_size, self.global_rank)
        return checkpoint

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="lightning_fpdt sequence parallelism")

