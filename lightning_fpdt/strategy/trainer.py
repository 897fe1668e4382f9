"""``FPDTStrategy``: ``Trainer(strategy="fpdt")`` (docs/design.md §5), the Trainer's front door to an fpdt run.

Its hooks drive the run (``strategy/run.py``: the mesh, the model's setup, each batch, the loss, the outputs, the
checkpoint's extras) and add what only the Trainer has: the rank watchdog and preemption, the checkpoint folders
checked at setup, the host-resident states and the optimizer step during the backward, the non-finite loss check,
gradient accumulation's reduce-scatters, ``trainer.predict``'s gathered outputs, the resumable training loader.
"""

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
from typing_extensions import override

from lightning_fpdt.callbacks.gradient_check import add_gradient_check
from lightning_fpdt.flops import attention_heads
from lightning_fpdt.integrations.adapters import keep_trained_adapters
from lightning_fpdt.integrations.attributes import DEVICE_MESH
from lightning_fpdt.integrations.discovery import train_modes_for_fit
from lightning_fpdt.lightning_private import evaluate_under_no_grad, wrapped_closure
from lightning_fpdt.offload.host_memory import HostMemoryError
from lightning_fpdt.sequence.kernels import AttentionBackend
from lightning_fpdt.strategy import budget, noise, storage
from lightning_fpdt.strategy import checkpoint as checkpointing
from lightning_fpdt.strategy.host_optimizer import (
    InBackwardStep,
    fuse_optimizers,
    host_step,
    host_threads,
    prepare_device_step,
    prepare_host_step,
)
from lightning_fpdt.strategy.materialize import has_meta_parameters
from lightning_fpdt.strategy.option_docs import documented
from lightning_fpdt.strategy.parallelize import no_gradient_sync
from lightning_fpdt.strategy.precision import FPDTPrecision, to_fpdt_precision
from lightning_fpdt.strategy.predict import check_predict_outputs
from lightning_fpdt.strategy.preemption import DEFAULT_TIMEOUT, Preemption, add_preemption_checkpoint, watch_with
from lightning_fpdt.strategy.run import DrivesRun, FPDTRun
from lightning_fpdt.strategy.step_loss import TrainingLossCheck
from lightning_fpdt.strategy.watchdog import DEFAULT_STALE_AFTER, RankWatchdog, checked_heartbeat_timeout


@documented
class FPDTStrategy(DrivesRun, ModelParallelStrategy):
    """Sequence-parallel training of long sequences: Ulysses all-to-all, FPDT chunked attention, FSDP2."""

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
        self.run = FPDTRun(
            chunks=chunks, offload=offload, offload_dq=offload_dq, ring_size=ring_size, head_chunks=head_chunks,
            attention_backend=attention_backend, layer_classes=layer_classes, pad_to_multiple=pad_to_multiple,
            pad_token_id=pad_token_id, check_memory=check_memory, offload_dir=offload_dir, fused_ops=fused_ops,
            cpu_offload_params=cpu_offload_params, sync_every_batch=sync_every_batch, plan_trial=plan_trial)
        """The run this strategy drives (``strategy/run.py``)."""
        self._loss_check = TrainingLossCheck.of(nonfinite_loss, warn=rank_zero_warn)
        self._heartbeat_timeout = checked_heartbeat_timeout(heartbeat_timeout)
        self.predict_outputs = check_predict_outputs(predict_outputs)
        self._sequence_parallel_size = sequence_parallel_size
        self.cpu_offload_params = cpu_offload_params
        self._host_step_in_backward = host_step_in_backward
        self._device_step_in_backward = device_step_in_backward
        self._in_backward: Optional[InBackwardStep] = None
        self._checkpoint_size: Optional[storage.CheckpointSize] = None  # counted at setup, named when a save fails
        self._watchdog: Optional[RankWatchdog] = None
        self._preemption = Preemption(timeout=preemption_timeout) if preemption else None

    # ---- sizes and mesh -------------------------------------------------------------------------------------------
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
        self._build_mesh(heads=attention_heads(self.lightning_module))
        setattr(self.lightning_module, DEVICE_MESH, self._device_mesh)

    # ---- model ----------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        # Lightning's base sequence (Strategy.setup: the accelerator, the precision's module conversion,
        # model_to_device, _setup_model, the optimizers, the precision plugin, the optimizers' states to the device),
        # the FPDT steps in its hooks below; not ModelParallelStrategy.setup, which requires configure_model and puts
        # a meta model on the GPU before apply_fpdt could shard it
        evaluate_under_no_grad(trainer)  # DTensor parameters do not work under inference_mode
        self._bind_trainer_run(trainer)
        self.run.prepare(budget.known_length(trainer))
        Strategy.setup(self, trainer)
        if trainer.state.fn == TrainerFn.FITTING:  # a folder that cannot take a checkpoint fails now, not hours in
            self._checkpoint_size = storage.check_at_setup(self, trainer, preemption=self._preemption is not None)
        known = budget.known_length(trainer)
        if known is not None:  # the length is known before the first batch
            self.check_memory_plan(*known, collective=True)
        add_preemption_checkpoint(trainer, self._preemption)
        if trainer.state.fn == TrainerFn.FITTING:  # a parameter that gets no gradient stops the run
            add_gradient_check(trainer)
            for name in train_modes_for_fit(self.lightning_module):
                rank_zero_info(f"fpdt: the Hugging Face model {name} was in eval mode (as from_pretrained returns it): "
                               f"put in training mode for fit")
        noise.steps_only_epochs(trainer)

    @override
    def model_to_device(self) -> None:
        if has_meta_parameters(self.model):
            return  # allocated shard by shard once sharded (_setup_model)
        super().model_to_device()  # FSDP2 shards what is on the mesh's device

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The run's model setup (``FPDTRun.setup_model``: ``apply_fpdt``, the vocabulary checks, a meta model
        allocated shard by shard, the early gathers, the host memory guard and the disk tier), the data module's
        vocabulary checked too, and the sharded model on this rank's device."""
        trainer = self.lightning_module.trainer
        self._setup_run_model(model, self.precision_plugin, trainer.callbacks, data=trainer.datamodule)
        if not self.cpu_offload_params:
            super().model_to_device()
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
        self.run.attach_optimizers(self.optimizers)

    def _bind_trainer_run(self, trainer: Optional["pl.Trainer"]) -> None:
        """The run's facts as this Trainer sets it up: its model, precision, callbacks and accumulation."""
        self._bind_run(self.model, self.precision_plugin.precision, getattr(trainer, "callbacks", ()),
                       accumulate_grad_batches=getattr(trainer, "accumulate_grad_batches", 1))

    # ---- data -----------------------------------------------------------------------------------------------------
    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """Move the batch, then shard its sequence (``FPDTRun.shard``): this rank's tokens, ``position_ids`` and the
        globally shifted ``labels``/``shift_labels``. A packed batch (``document_ids``, or ``position_ids``
        restarting at 0) turns on per-document masking (docs/packing.md)."""
        trainer = budget.attached_trainer(self.lightning_module)
        return self.run.shard(batch, lambda b: super(FPDTStrategy, self).batch_to_device(b, device, dataloader_idx),
                              training=trainer is not None and trainer.training)

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

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = self.run.reduced_output(super().training_step(*args, **kwargs))
        self.run.forward_ran()
        if self._loss_check is not None:
            self._loss_check(output, self.batch_plan.targetless, self.lightning_module.trainer, rank=self.global_rank)
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.run.reduced_output(super().validation_step(*args, **kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.run.reduced_output(super().test_step(*args, **kwargs))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().predict_step(*args, **kwargs)
        return output if self.predict_outputs == "rank" else self.run.gather_outputs(output)

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
        return self.run.syncs_every_batch()

    # ---- memory budget, failures, checkpoints ---------------------------------------------------------------------
    def check_memory_plan(self, seq_len: int, batch_size: int = 1, *, collective: bool = False) -> None:
        """Plan ``seq_len`` (``strategy/budget.py``): resolve the ``"auto"`` options to the fastest configuration that
        fits the GPU and the host, hand the memory callbacks their part, log the choice; refuse, before any pinned
        buffer of this length exists, a run that fits neither (with ``check_memory``). At setup (``collective``)
        every rank refuses together, so none waits in a collective for a rank that raised."""
        if self.memory.facts is None:  # planned outside a fit's setup
            self._bind_trainer_run(budget.attached_trainer(self.lightning_module))
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
        self.run.drop_gathers()  # a batch whose step did not run (a hook ended the epoch) left its gathers
        keep_trained_adapters(self.lightning_module)  # collective: every rank ends fit here, and none saves later

    @override
    def teardown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
        self.run.close()  # the states' registration ends before FSDP2 lets the memory go; the disk tier's files go
        if self._preemption is not None:
            self._preemption.uninstall()
        if self._in_backward is not None:
            self._in_backward.close()  # kept: what its last step did stays readable
        super().teardown()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        started = time.monotonic()
        checkpoint = self.run.checkpoint_state(checkpoint)
        with storage.space_named(Path(filepath), self._checkpoint_size):
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            if self._save_distributed_checkpoint:
                self.run.save_checksums(Path(self.broadcast(filepath)))
        if self._preemption is not None:
            self._preemption.progress(save_seconds=time.monotonic() - started)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        self.run.check_before_load(Path(self.broadcast(checkpoint_path)))
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        # applied at the next batch: creating the dataloader iterator in between draws from the torch generator
        self.run.restore_rng_states(checkpoint, at_next_batch=True)
        return checkpoint
