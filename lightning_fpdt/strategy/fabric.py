"""``FPDTFabricStrategy``: ``Fabric(strategy="fpdt")``, the fpdt run for one's own training loop (docs/fabric.md).

A separate class from the Trainer's :class:`~lightning_fpdt.strategy.FPDTStrategy` because Fabric and the Trainer
have separate strategy interfaces (Lightning's own ``ModelParallelStrategy`` is two classes too). Both drive the same
run (``strategy/run.py``: the mesh, the model's setup, each batch, the loss, the checkpoint's extras, the memory
budget, the early gathers); what only Fabric has is here: the loop owns the order of the steps, so the optimizers are
pointed at the sharded parameters at ``fabric.setup``, every loader's batches are sharded as they come out, a loss
the loop did not reduce is reduced at ``fabric.backward``, and a gather started for a batch the loop fetched early is
dropped before its optimizer step. What the Trainer adds around a step beyond the run (the rank watchdog,
preemption, the non-finite loss check, host-resident states) is not part of a Fabric run; the options that drive it
are refused here by name (:data:`TRAINER_ONLY_OPTIONS`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fpdt.flops import attention_heads
from lightning_fpdt.sequence.kernels import AttentionBackend
from lightning_fpdt.sequence.sizes import resolve_sequence_sizes
from lightning_fpdt.strategy import noise
from lightning_fpdt.strategy.materialize import has_meta_parameters
from lightning_fpdt.strategy.option_docs import documented
from lightning_fpdt.strategy.precision import FPDTFabricPrecision, to_fpdt_precision
from lightning_fpdt.strategy.run import DrivesRun, FPDTRun

_HOST_STATES = "the host-resident states and their in-backward step run inside the Trainer's optimizer step"
_PREEMPTION = "the Trainer saves and exits on SIGTERM; in your loop, save with fabric.save"
TRAINER_ONLY_OPTIONS = {
    "cpu_offload_params": _HOST_STATES,
    "host_step_in_backward": _HOST_STATES,
    "device_step_in_backward": "the in-backward step runs inside the Trainer's optimizer step",
    "nonfinite_loss": "your loop holds the loss: check torch.isfinite(loss) there",
    "heartbeat_timeout": "the rank watchdog is part of the Trainer's run",
    "preemption": _PREEMPTION,
    "preemption_timeout": _PREEMPTION,
    "sync_every_batch": "under Fabric you choose: wrap the batches before a window's last in "
                        "fabric.no_backward_sync(model)",
    "predict_outputs": "trainer.predict only; under Fabric gather outputs yourself",
    "plan_trial": "the trial times the Trainer's training steps and switches configurations between them; under "
                  "Fabric the planner's fastest estimate runs (compare configurations with `python3 -m "
                  "bench.neighbours`)",
}
"""``FPDTStrategy``'s options that have no meaning under Fabric, each with why (named when given)."""


@documented
class FPDTFabricStrategy(DrivesRun, ModelParallelStrategy):
    """Sequence-parallel training of long sequences in a Fabric loop: Ulysses all-to-all, FPDT chunked attention,
    FSDP2 over the (data × sequence) mesh.

    ``fabric.setup(model, optimizer)`` makes the model sequence-parallel (the attention and loss swapped, the memory
    transforms of ``memory_callbacks``, FSDP2); ``fabric.setup_dataloaders(loader)`` samples per data-parallel group
    (the ranks of a sequence group see the same samples) and cuts each batch to this rank's share of the sequence, so
    the loop is the one a single process runs. A model whose own forward computes the loss (the reference Llama, a
    Hugging Face causal LM given ``labels``) returns the sequence's token mean on every rank; a loss the loop computes
    from local logits becomes it with :meth:`reduce_loss` (``fabric.backward`` reduces one that was not).
    """

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
        named = [name for name in trainer_options if name in TRAINER_ONLY_OPTIONS]
        if named:
            raise ValueError("; ".join(f"{name} is an option of Trainer(strategy=FPDTStrategy(...)) only: "
                                       f"{TRAINER_ONLY_OPTIONS[name]}" for name in named))
        if trainer_options:
            raise TypeError(f"FPDTFabricStrategy got unexpected keyword arguments {sorted(trainer_options)}")
        undeclared = [type(c).__name__ for c in memory_callbacks if getattr(c, "fpdt_transform_slot", None) is None]
        if undeclared:
            raise ValueError(f"memory_callbacks takes the memory callbacks (ActivationOffload, TiledMLP, TiledLoss), "
                             f"got {undeclared}: pass other callbacks to Fabric(callbacks=...)")
        noise.quiet_lightning()  # Lightning's tips and a deprecation it triggers say nothing about a run
        super().__init__(parallelize_fn=self._setup_module, data_parallel_size=data_parallel_size,
                         tensor_parallel_size="auto", save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.run = FPDTRun(chunks=chunks, offload=offload, offload_dq=offload_dq, ring_size=ring_size,
                           head_chunks=head_chunks, attention_backend=attention_backend, layer_classes=layer_classes,
                           pad_to_multiple=pad_to_multiple, pad_token_id=pad_token_id, check_memory=check_memory,
                           offload_dir=offload_dir, fused_ops=fused_ops)
        """The run this strategy drives (``strategy/run.py``)."""
        self._sequence_parallel_size = sequence_parallel_size
        self._memory_callbacks = list(memory_callbacks)

    # ---- sizes and mesh -------------------------------------------------------------------------------------------
    @property
    @override
    def device_mesh(self) -> Any:
        """The ``(data_parallel, sequence_parallel)`` mesh (``strategy/mesh.py``), with a ring's axes where one is
        needed. Built at the first ``fabric.setup``, where the model's heads cap ``sequence_parallel_size="auto"`` and
        choose ``ring_size="auto"``; read before it (``fabric.setup_dataloaders`` first), it is built without them."""
        if self._device_mesh is None:
            if not torch.distributed.is_initialized():
                raise RuntimeError("the fpdt mesh is built once the processes have started: call fabric.launch() "
                                   "first")
            self._build_mesh(heads=None)
        return self._device_mesh

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
                               sequence_parallel_size=self._sequence_parallel_size,
                               ring_size=self.options.ring_size, heads=None)

    # ---- model ----------------------------------------------------------------------------------------------------
    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """The run's model setup (``FPDTRun.setup_model``: the attention and loss swapped, the memory transforms,
        FSDP2, a meta model allocated shard by shard, the early gathers), the module on this rank's device."""
        if self._device_mesh is None:
            self._build_mesh(heads=attention_heads(module))
        self._bind_run(module, self.precision.precision, self._memory_callbacks)
        self.run.prepare()  # no length is known before the loop's first batch
        if not has_meta_parameters(module):
            module.to(self.root_device)  # FSDP2 shards what is on the mesh's device
        return self._setup_module(module, self.device_mesh)

    def _setup_module(self, module: nn.Module, mesh: Any) -> nn.Module:
        return self._setup_run_model(module, self.precision, self._memory_callbacks)

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
        self.run.attach_optimizers(optimizers)
        return module, optimizers, scheduler

    @override
    def module_to_device(self, module: nn.Module) -> None:
        pass  # setup_module places it: allocated shard by shard when on the meta device

    # ---- data, the loss, the step ---------------------------------------------------------------------------------
    def shard_batch(self, batch: Any) -> dict[str, Any]:
        """This rank's share of a global batch ``{"input_ids": (B, S), "labels": ...}`` (on this rank's device), by
        the project's one :class:`~lightning_fpdt.SequenceLayout`: the tokens, their global ``position_ids`` and the
        labels shifted on the global sequence; the model's forward then runs on this batch. The loaders of
        ``fabric.setup_dataloaders`` call it for every batch; call it yourself for batches from elsewhere. Every rank
        of a sequence group must shard the same global batch. While the model trains (``model.train()``) the first
        all-gathers of its next forward start here (``FPDTRun.shard``)."""
        return self.run.shard(batch, lambda b: move_data_to_device(b, self.root_device))

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Each batch cut to this rank's share of the sequence (:meth:`shard_batch`)."""
        return SequenceShardedLoader(dataloader, self.shard_batch)

    @override
    def backward(self, tensor: Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        """The backward of the sequence group's token-mean loss: a loss the loop computed from local logits and did
        not reduce (:meth:`reduce_loss`) is reduced first, so every rank's gradient is its share of the sequence's."""
        super().backward(self.run.reduced_output(tensor), module, *args, **kwargs)
        self.run.forward_ran()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The loop's optimizer step, after dropping a gather started for a batch fetched before it (a loop that
        shards the next batch before stepping): that gather holds the parameters from before the step."""
        self.run.drop_gathers()
        return super().optimizer_step(optimizer, **kwargs)

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """Lightning's save (one shard per rank and ``meta.pt``, or one file) with every rank's random states (the
        loop draws after a resume what it would have drawn), then the distributed checkpoint's checksums
        (``strategy/checkpoint.py``), which :meth:`load_checkpoint` verifies. Collective."""
        path = Path(self.broadcast(path))
        super().save_checkpoint(path, self.run.checkpoint_state(state), storage_options=storage_options, filter=filter)
        if self._save_distributed_checkpoint:
            self.run.save_checksums(path)

    @override
    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Refuse a folder whose save was interrupted or whose files changed since (named), then Lightning's load
        into ``state``'s model and optimizers, and this rank's random states as they were at the save (a checkpoint
        of another number of ranks: afresh, with a warning). Collective."""
        path = Path(self.broadcast(path))
        self.run.check_before_load(path)
        remainder = super().load_checkpoint(path, state=state, strict=strict, weights_only=weights_only)
        if isinstance(remainder, dict):
            self.run.restore_rng_states(remainder, at_next_batch=False)
        return remainder

    @override
    def teardown(self) -> None:
        self.run.close()  # the states' registration ends, the disk tier's files go
        super().teardown()


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
