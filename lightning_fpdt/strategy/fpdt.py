"""``FPDTStrategy``: ``Trainer(strategy="fpdt")`` (DESIGN.md §5)."""

from __future__ import annotations

import logging
import math
import random
import warnings
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.distributed.fsdp import FSDPModule

from lightning_fpdt.sequence.documents import DocumentBoundaries, document_starts_mask, has_position_resets
from lightning_fpdt.sequence.fpdt import FPDTAttention
from lightning_fpdt.sequence.head_chunks import HeadGroupedAttention, grouped_geometry
from lightning_fpdt.sequence.integrations import SequenceParallelContext, installed_attentions, sequence_parallel_loss
from lightning_fpdt.sequence.kernels import check_backend_name
from lightning_fpdt.sequence.layout import IGNORE_INDEX, SequenceLayout
from lightning_fpdt.sequence.planning import (
    MAX_CHUNK_TOKENS,
    AttentionGeometry,
    choose_chunks,
    choose_offload,
    choose_offload_dq,
)
from lightning_fpdt.strategy.mesh import (
    attention_group,
    build_mesh,
    resolve_sequence_sizes,
    ring_size_of,
    sequence_mesh,
)
from lightning_fpdt.strategy.parallelize import ParallelizeConfig, apply_fpdt, find_model, unwrap_loss
from lightning_fpdt.strategy.precision import FPDTPrecision, to_fpdt_precision
from lightning_fpdt.strategy.resumable import ResumableLoader
from lightning_fpdt.strategy.topology import warn_if_sequence_groups_span_hosts
from lightning_fpdt.strategy.watchdog import RankWatchdog

def attention_heads(module: torch.nn.Module) -> Optional[tuple[int, int]]:
    """``(num_heads, num_kv_heads)`` read from a config found in ``module``, or ``None``."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if config is None:
            continue
        heads = getattr(config, "num_heads", None) or getattr(config, "num_attention_heads", None)
        if heads:
            kv = getattr(config, "num_kv_heads", None) or getattr(config, "num_key_value_heads", None) or heads
            return int(heads), int(kv)
    return None


class FPDTStrategy(ModelParallelStrategy):
    """Sequence-parallel training of long sequences: Ulysses all-to-all, FPDT chunked attention, FSDP2.

    Args:
        sequence_parallel_size: ranks that share one sequence; ``"auto"``: the devices of a node, capped by what
            the model's head counts allow.
        data_parallel_size: groups that see different samples; ``"auto"``: world size / sequence_parallel_size.
        chunks: FPDT chunks per rank ``u``; ``"auto"``: the fewest whose working set fits a sixteenth of the free
            GPU memory, with at most 65536 global tokens per chunk (``lightning_fpdt.sequence.planning``).
            ``1`` is plain Ulysses.
        offload: keep the attention's q/k/v/out/lse chunks in pinned host memory between forward and backward;
            ``"auto"``: when all layers' chunks would take more than a quarter of the free GPU memory (never on CPU).
        offload_dq: keep the backward's partial dQ sums (fp32, twice q's size) in host memory too; ``"auto"``:
            when the chunks are offloaded and those sums would take more than an eighth of the free GPU memory.
        ring_size: ring ranks ``R`` of a 2-D sequence mesh (``sequence_parallel_size = U·R``: ``U`` Ulysses ranks
            all-to-all heads, ``R`` ring ranks pass kv shares around; docs/ring.md), so the sequence-parallel size
            may exceed the head count. ``"auto"``: ``1`` when the heads allow ``sequence_parallel_size`` Ulysses
            ranks, else the smallest ``R`` whose ``U`` they allow. With ``R > 1`` chunks are 1 (FPDT chunks are
            not composed with the ring yet); ``offload`` keeps the ring's head-sharded shares in host memory.
        attention_backend: block attention kernel: ``"auto"``, ``"cudnn"``, ``"flash"`` or ``"math"``.
        head_chunks: head groups ``G`` (UPipe): each attention layer projects, attends and output-projects ``H/G``
            query heads (and their ``Hkv/G`` kv heads) at a time, so the full-width q/k/v/out of the local sequence
            never exist at once (``lightning_fpdt.sequence.head_chunks``). ``G`` must divide the kv heads, and the
            query heads of a group must split over the sequence-parallel ranks. ``1``: all heads at once.
        layer_classes: class names of the transformer blocks (FSDP2 units); ``None``: the largest ``ModuleList``.
        cpu_offload_params: keep sharded parameters, gradients and optimizer state in host memory (FSDP2
            ``CPUOffloadPolicy``), for models whose states do not fit the GPUs.
        pad_to_multiple: right-pad sequences to a multiple of sequence_parallel_size × chunks (labels -100);
            ``False`` raises instead.
        pad_token_id: the token id used for that padding.
        nonfinite_loss: ``"raise"`` stops training on every rank at the first NaN/inf loss, naming the step;
            ``"ignore"`` trains on (no check, no extra collective).
        save_distributed_checkpoint: save one shard per rank (DCP) instead of one consolidated file.
        process_group_backend: ``"nccl"``, ``"gloo"``, …; default by device.
        timeout: collective timeout.
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
        attention_backend: str = "auto",
        head_chunks: int = 1,
        layer_classes: Optional[list[str]] = None,
        cpu_offload_params: bool = False,
        pad_to_multiple: bool = True,
        nonfinite_loss: Literal["raise", "ignore"] = "raise",
        pad_token_id: int = 0,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size="auto",
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        if chunks != "auto" and (not isinstance(chunks, int) or chunks < 1):
            raise ValueError(f"chunks must be 'auto' or a positive int, got {chunks!r}")
        for name, value in (("offload", offload), ("offload_dq", offload_dq)):
            if value not in ("auto", True, False):
                raise ValueError(f"{name} must be 'auto', True or False, got {value!r}")
        if ring_size != "auto" and (isinstance(ring_size, bool) or not isinstance(ring_size, int) or ring_size < 1):
            raise ValueError(f"ring_size must be 'auto' or a positive int, got {ring_size!r}")
        self._offload = offload
        self._offload_dq = offload_dq
        self._ring_size = ring_size
        self._geometry: Optional[AttentionGeometry] = None
        self._free_bytes: Optional[int] = None  # free GPU memory at the first batch, what "auto" plans with
        self._plans_logged: set[tuple[int, int, bool]] = set()
        check_backend_name(attention_backend)
        if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1:
            raise ValueError(f"head_chunks must be a positive int, got {head_chunks!r}")
        self._head_chunks = head_chunks
        self._sequence_parallel_size = sequence_parallel_size
        self._chunks = chunks
        self._attention_backend = attention_backend
        self._layer_classes = layer_classes
        self._cpu_offload_params = cpu_offload_params
        self._pad_to_multiple = pad_to_multiple
        self._pad_token_id = pad_token_id
        if nonfinite_loss not in ("raise", "ignore"):
            raise ValueError(f"nonfinite_loss must be 'raise' or 'ignore', got {nonfinite_loss!r}")
        self._nonfinite_loss = nonfinite_loss
        self._context: Optional[SequenceParallelContext] = None
        self._padding_logged = False
        self.last_batch_geometry: Optional[tuple[int, int, int]] = None
        """``(batch_size, seq_len, padded_seq_len)`` of the global sequence of the last batch sharded."""
        self.last_batch_attention_length: Optional[float] = None
        """``Σ L_d² / S`` of the last batch's packed documents (FLOP counts); ``None``: one document per sequence."""
        self._valid_tokens_local: Union[Tensor, int] = 0
        self._pending_rng_states: Optional[dict[str, Any]] = None
        self._watchdog: Optional[RankWatchdog] = None
        if isinstance(ring_size, int) and ring_size > 1:
            self._check_ring_options(ring_size)

    # ---- sizes and mesh -------------------------------------------------------------------------------------------
    @property
    def sequence_parallel_size(self) -> int:
        return sequence_mesh(self.device_mesh).size()

    @property
    def ring_size(self) -> int:
        """``R``: ring ranks of the sequence mesh (1: plain Ulysses/FPDT)."""
        return ring_size_of(self.device_mesh)

    @property
    def data_parallel_size(self) -> int:
        return self.device_mesh["data_parallel"].size()

    @property
    def sequence_parallel_rank(self) -> int:
        return sequence_mesh(self.device_mesh).get_local_rank()

    @property
    def sequence_parallel_group(self) -> torch.distributed.ProcessGroup:
        return sequence_mesh(self.device_mesh).get_group()

    def _ring_on(self) -> bool:
        """Whether the ring is on: from the mesh once it exists, from the option before."""
        if self._device_mesh is not None:
            return self.ring_size > 1
        return isinstance(self._ring_size, int) and self._ring_size > 1

    def _check_ring_options(self, ring_size: int) -> None:
        """Options the ring does not compose with yet are refused, not silently ignored."""
        if isinstance(self._chunks, int) and self._chunks > 1:
            raise ValueError(
                f"chunks={self._chunks} with ring_size={ring_size}: FPDT chunks are not composed with ring attention "
                f"yet; use chunks=1 (or 'auto') with a ring, or ring_size=1"
            )
        if self._offload_dq is True:
            raise ValueError(
                f"offload_dq=True with ring_size={ring_size}: the ring has no partial dQ sums across chunks to "
                f"offload (its dQ is one share, on the device); use offload_dq='auto' or False with a ring"
            )

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else FPDTPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        # also reached when the strategy is given as a string, where Lightning itself checks nothing
        self._precision_plugin = to_fpdt_precision(plugin)

    def setup_environment(self) -> None:
        self._setup_distributed()
        self._watchdog = RankWatchdog(self.global_rank, self.world_size)
        self._watchdog.start()
        assert self.lightning_module is not None
        heads = attention_heads(self.lightning_module)
        # with head groups each group's heads split over the ranks: the sizes are resolved per group
        dp, sp, ring = resolve_sequence_sizes(
            world_size=self.world_size,
            devices_per_node=self.num_processes,
            data_parallel_size=self._data_parallel_size,
            sequence_parallel_size=self._sequence_parallel_size,
            ring_size=self._ring_size,
            heads=heads,
            head_chunks=self._head_chunks,
        )
        if heads is not None and self._head_chunks > 1:
            rank_zero_info(f"fpdt: {heads[0]} query / {heads[1]} kv heads in {self._head_chunks} head groups")
            heads = (heads[0] // self._head_chunks, heads[1] // self._head_chunks)
        if ring > 1:
            self._check_ring_options(ring)
        self._data_parallel_size, self._sequence_parallel_size = dp, sp
        # with a ring only the Ulysses groups (U consecutive ranks) all-to-all; the ring's P2P may cross hosts
        warn_if_sequence_groups_span_hosts(
            sequence_parallel_size=sp // ring, devices_per_node=self.num_processes, world_size=self.world_size
        )
        self._device_mesh = build_mesh(self.root_device.type, dp, sp, ring)
        self.lightning_module._device_mesh = self._device_mesh
        axes = {"data_parallel": dp, "sequence_parallel": sp}
        if ring > 1:
            axes.update(ring=ring, ulysses=sp // ring)
        rank_zero_info(f"fpdt: mesh {axes}, heads {heads}")

    # ---- model ----------------------------------------------------------------------------------------------------
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        # DTensor parameters do not work under inference_mode; evaluation runs under no_grad instead
        for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop, trainer.fit_loop.epoch_loop.val_loop):
            loop.inference_mode = False
        if self._context is None:
            self._context = SequenceParallelContext(
                group=self.sequence_parallel_group,  # the loss is reduced over all P ranks
                attention=FPDTAttention(  # (ulysses_group, ring_group) with a ring: the hybrid of sequence/ring.py
                    group=attention_group(self.device_mesh), num_chunks=1, backend=self._attention_backend,
                    offload=self._offload is True, offload_dq=self._offload_dq is True,
                    head_chunks=self._head_chunks,
                ),
            )
        self.model = self.precision_plugin.convert_module(self.model)
        on_meta = any(p.is_meta for p in self.model.parameters())
        if not on_meta:
            self.model_to_device()  # FSDP2 shards what is on the mesh's device
        assert isinstance(self.precision_plugin, FPDTPrecision)
        apply_fpdt(
            self.model,
            self.device_mesh,
            config=ParallelizeConfig(
                context=self._context,
                layer_classes=self._layer_classes,
                mp_policy=self.precision_plugin.mixed_precision_policy(),
                memory_transforms=memory_transforms(trainer),
                cpu_offload_params=self._cpu_offload_params,
            ),
        )
        self._geometry = attention_geometry(find_model(self.model), self.precision_plugin.precision)
        if on_meta:
            # FSDP2 offloading keeps the sharded parameters in host memory and refuses them anywhere else
            device = torch.device("cpu") if self._cpu_offload_params else self.root_device
            _materialize(self.model, device, rank=self.global_rank)
        if not self._cpu_offload_params:
            self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self._cpu_offload_params:
            _optimizers_to_device(self.optimizers, self.root_device)
        datamodule = trainer.datamodule
        if isinstance(getattr(datamodule, "seq_len", None), int):  # the length is known before the first batch
            self.check_memory_plan(datamodule.seq_len, getattr(datamodule, "batch_size", 1), collective=True)

    # ---- data -----------------------------------------------------------------------------------------------------
    def _free_memory(self) -> Optional[int]:
        if self.parallel_devices is None or self.root_device.type != "cuda":
            return None
        if self._free_bytes is None:
            self._free_bytes = usable_free_bytes(self.root_device)
        return self._free_bytes

    def num_chunks_for(self, seq_len: int, batch_size: int = 1) -> int:
        """FPDT chunks for a global sequence of ``seq_len`` tokens (the option, or the plan for ``"auto"``)."""
        if self._chunks != "auto":
            return self._chunks
        if self._ring_on():
            return 1  # FPDT chunks are not composed with the ring yet
        free = self._free_memory()
        if free is None or self._geometry is None:
            return max(1, math.ceil(seq_len / MAX_CHUNK_TOKENS))
        return choose_chunks(self._geometry, batch_size=batch_size, seq_len=seq_len,
                             sp_size=self.sequence_parallel_size, free_bytes=free)

    def offload_dq_for(self, seq_len: int, batch_size: int, offload: bool) -> bool:
        """Whether the backward keeps its partial dQ sums in host memory (the option, or the plan)."""
        if self._offload_dq != "auto":
            return self._offload_dq
        if self._ring_on():
            return False  # the ring's dQ is one share per layer: nothing to offload across chunks
        free = self._free_memory()
        if not offload or free is None or self._geometry is None:
            return False
        return choose_offload_dq(self._geometry, batch_size=batch_size, seq_len=seq_len,
                                 sp_size=self.sequence_parallel_size, free_bytes=free)

    def offload_for(self, seq_len: int, batch_size: int = 1) -> bool:
        """Whether the attention offloads its chunks for this sequence length (the option, or the plan)."""
        if self._offload != "auto":
            return self._offload
        free = self._free_memory()
        if free is None or self._geometry is None:
            return False
        return choose_offload(self._geometry, batch_size=batch_size, seq_len=seq_len,
                              sp_size=self.sequence_parallel_size, free_bytes=free, ring_size=self.ring_size)

    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """Move the batch, then shard its sequence with :class:`SequenceLayout` (adds ``position_ids`` and the
        globally shifted ``labels``/``shift_labels``). A packed batch (``document_ids``, or ``position_ids`` restarting
        at 0) turns on per-document attention masking for this batch (docs/packing.md)."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), Tensor):
            raise ValueError(
                "the fpdt strategy shards batches by their 'input_ids' (B, S): return a dict with an 'input_ids' "
                f"tensor from the dataloader (got {type(batch).__name__}"
                f"{' with keys ' + str(sorted(batch)) if isinstance(batch, Mapping) else ''})"
            )
        return self.shard_batch(dict(batch))

    def shard_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        if self._pending_rng_states is not None:
            _set_rng_states(self._pending_rng_states)
            self._pending_rng_states = None
        input_ids = batch["input_ids"]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, sequence), got shape {tuple(input_ids.shape)}")
        batch_size, seq_len = input_ids.shape
        num_chunks = self.num_chunks_for(seq_len, batch_size)
        offload = self.offload_for(seq_len, batch_size)
        if (seq_len, num_chunks, offload) not in self._plans_logged:
            self._plans_logged.add((seq_len, num_chunks, offload))
            self.check_memory_plan(seq_len, batch_size)  # before the forward pins host memory for this length
            rank_zero_info(
                f"fpdt: sequences of {seq_len} tokens: chunks={num_chunks} ({self._chunks!r}), offload={offload} "
                f"({self._offload!r}), sequence_parallel_size={self.sequence_parallel_size}"
                + (f", planned for {self._free_bytes / 2**30:.1f} GiB free" if self._free_bytes else "")
            )
        layout = SequenceLayout(self.sequence_parallel_size, self.sequence_parallel_rank, num_chunks,
                                ring_size=self.ring_size)
        padded = layout.padded_length(seq_len)
        if padded != seq_len:
            if not self._pad_to_multiple:
                layout.check_divisible(seq_len)
            if not self._padding_logged:
                rank_zero_info(
                    f"fpdt: padding sequences of {seq_len} tokens to {padded} (a multiple of {layout.num_pieces}: "
                    f"sequence_parallel_size {layout.sp_size} × chunks {num_chunks}"
                    + (" × 2 for the ring's head-tail pieces" if layout.ring_size > 1 else "")
                    + "); padded labels are -100"
                )
                self._padding_logged = True

        attention_mask = batch.pop("attention_mask", None)
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError(
                "batch['attention_mask'] has zeros: the fpdt attention is causal over the whole sequence and takes no "
                "padding mask; right-pad instead and set the padded labels to -100"
            )
        if "shift_labels" in batch:
            targets = batch["shift_labels"]
        else:
            labels = batch.get("labels", input_ids)
            targets = SequenceLayout.shift_labels(labels)  # on the global sequence: no label lost at shard edges
        position_ids = batch.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=input_ids.device).expand(batch_size, -1)
        documents, document_starts = packed_documents(batch.get("document_ids"), position_ids, input_ids.shape)
        if documents is not None:
            # the last token of a document predicts nothing (run alone it has no next token), whatever the labels say
            targets = torch.cat([targets[:, :-1].masked_fill(document_starts[:, 1:], IGNORE_INDEX), targets[:, -1:]], 1)

        sharded = {}
        for key, value in batch.items():
            if key in ("input_ids", "labels", "shift_labels", "position_ids", "document_ids"):
                continue
            if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[:2] == (batch_size, seq_len):
                sharded[key] = layout.shard(layout.pad(value, dim=1, value=0), dim=1)  # any other per-token tensor
            else:
                sharded[key] = value
        sharded["input_ids"] = layout.shard(layout.pad(input_ids, dim=1, value=self._pad_token_id))
        shift_labels = layout.shard(layout.pad(targets, dim=1, value=IGNORE_INDEX))
        sharded["labels"] = sharded["shift_labels"] = shift_labels
        sharded["position_ids"] = layout.shard(layout.pad_position_ids(position_ids))
        if "document_ids" in batch:
            document_ids = batch["document_ids"]
            pad_document = (document_ids[:, -1:] + 1).expand(-1, padded - seq_len)  # the padding is a document
            sharded["document_ids"] = layout.shard(torch.cat([document_ids, pad_document], dim=1))

        self.last_batch_geometry = (batch_size, seq_len, padded)
        self.last_batch_attention_length = documents.attention_length() if documents is not None else None
        # kept on the device: only a module computing its own loss needs it, and int() here would stall every step
        self._valid_tokens_local = (shift_labels != IGNORE_INDEX).sum()
        assert self._context is not None
        self._context.attention.num_chunks = num_chunks
        self._context.attention.offload = offload
        self._context.attention.stashes.offload_dq = self.offload_dq_for(seq_len, batch_size, offload)
        self._context.position_ids = sharded["position_ids"]
        self._context.attention.documents = documents.padded(padded) if documents is not None else None
        self._context.loss_reduced = False
        return sharded

    # ---- steps ----------------------------------------------------------------------------------------------------
    def _sequence_parallel_output(self, output: Any) -> Any:
        """A loss a model computed itself (local token mean) becomes the group's token mean (DESIGN.md §5)."""
        assert self._context is not None
        loss = unwrap_loss(output)
        if loss is None or self._context.loss_reduced:
            return output
        reduced = sequence_parallel_loss(loss, self._valid_tokens_local, group=self._context.group)
        if isinstance(output, Tensor):
            return reduced
        return {**output, "loss": reduced}

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = self._sequence_parallel_output(super().training_step(*args, **kwargs))
        if self._nonfinite_loss == "raise":
            self._check_finite(unwrap_loss(output))
        return output

    def _check_finite(self, loss: Optional[Tensor]) -> None:
        """Stop every rank together on a non-finite loss (one rank stopping alone would hang the others)."""
        if loss is None:
            return
        flag = (~torch.isfinite(loss.detach())).float().reshape(1)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag.item():
            trainer = self.lightning_module.trainer
            raise FloatingPointError(
                f"non-finite loss ({loss.item()} on rank {self.global_rank}) at global step {trainer.global_step} "
                f"(epoch {trainer.current_epoch}): training stopped; lower the learning rate, check the data, or "
                f"pass FPDTStrategy(nonfinite_loss='ignore') to train on"
            )

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._sequence_parallel_output(super().validation_step(*args, **kwargs))

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._sequence_parallel_output(super().test_step(*args, **kwargs))

    def check_memory_plan(self, seq_len: int, batch_size: int = 1, *, collective: bool = False) -> None:
        """Refuse, before any pinned buffer exists, a run whose pinned host memory does not fit this host
        (lightning_fpdt.planner; pinned-memory exhaustion takes the machine down, not just the job)."""
        from lightning_fpdt.callbacks import ActivationOffload, TiledLoss, TiledMLP
        from lightning_fpdt.planner import available_host_memory, check_host_memory, plan_memory, resolve_geometry

        config = getattr(find_model(self.model), "config", None)
        available = available_host_memory()
        if self.root_device.type != "cuda" or config is None or available is None:
            return  # pinned memory is a CUDA matter; without a config there is no geometry to plan
        try:
            geometry = resolve_geometry(config)
        except ValueError:
            return  # a config the planner cannot read: nothing to check against
        callbacks = self.lightning_module.trainer.callbacks
        checkpoints = [cb for cb in callbacks if isinstance(cb, ActivationOffload)]
        offload = self.offload_for(seq_len, batch_size)
        plan = plan_memory(
            geometry=geometry, seq_len=seq_len, batch_size=batch_size, num_gpus=self.world_size,
            gpus_per_node=self.num_processes, sequence_parallel_size=self.sequence_parallel_size,
            ring_size=self.ring_size,
            chunks=self.num_chunks_for(seq_len, batch_size), offload=offload,
            offload_dq=self.offload_dq_for(seq_len, batch_size, offload),
            activation_offload=any(cb.stashes.offload for cb in checkpoints),
            activation_checkpointing=bool(checkpoints),
            recompute_attention=any(cb.recompute_attention for cb in checkpoints),
            tiled_mlp=any(isinstance(cb, TiledMLP) for cb in callbacks),
            tiled_loss=any(isinstance(cb, TiledLoss) for cb in callbacks),
            precision=self.precision_plugin.precision, cpu_offload_params=self._cpu_offload_params,
            head_chunks=self._head_chunks,
            gpu_memory_gib=usable_total_bytes(self.root_device) / 2**30,
        )
        try:
            check_host_memory(plan, available)
            refusal = None
        except ValueError as error:
            refusal = error
        # at setup every rank refuses together, so none waits in a collective for a rank that raised
        if collective and not self.reduce_boolean_decision(refusal is None, all=True):
            raise refusal or ValueError("another rank refused the run: its host lacks the pinned memory (see its log)")
        if refusal is not None:
            raise refusal

    def on_exception(self, exception: BaseException) -> None:
        """Name the rank that died or hung when a collective failed (see ``strategy/watchdog.py``)."""
        super().on_exception(exception)
        if self._watchdog is None or isinstance(exception, (ValueError, FloatingPointError, KeyboardInterrupt)):
            return
        faults = self._watchdog.diagnose(wait=6 * self._watchdog.interval)
        if faults:
            logging.getLogger("lightning.pytorch").error(
                f"fpdt: rank {self.global_rank} failed ({type(exception).__name__}: {str(exception)[:200]}); "
                + "; ".join(faults)
            )

    def teardown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
        super().teardown()

    def process_dataloader(self, dataloader: object) -> object:
        """Training loaders resume mid-epoch at the checkpointed position (see ``strategy/resumable.py``)."""
        from torch.utils.data import DataLoader

        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or not isinstance(dataloader, DataLoader):
            return dataloader
        progress = trainer.fit_loop.epoch_loop.batch_progress
        # `processed`: batches whose training step finished (a checkpoint written in on_train_batch_end has not
        # counted its batch as `completed` yet; after the loop's restart reset both are equal)
        return ResumableLoader(dataloader, completed_batches=lambda: progress.current.processed)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        # every rank's random state (dropout, sampling), so a resumed run draws what the uninterrupted one would
        states: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(states, _rng_states())
        checkpoint[RNG_KEY] = states
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        check_checkpoint_complete(Path(self.broadcast(checkpoint_path)))
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        states = checkpoint.pop(RNG_KEY, None)
        if states is not None and len(states) == self.world_size:
            # applied at the next batch: creating the dataloader iterator in between draws from the torch generator
            self._pending_rng_states = states[self.global_rank]
        elif states is not None:
            rank_zero_warn(
                f"fpdt: the checkpoint holds the random states of {len(states)} ranks and this run has "
                f"{self.world_size}; random streams start afresh (parameters and optimizer states are restored)"
            )
        return checkpoint

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No FSDP2 gradient reduce-scatter on gradient-accumulation micro-steps."""
        modules = [m for m in self.model.modules() if isinstance(m, FSDPModule)] if self.model is not None else []
        for module in modules:
            module.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for module in modules:
                module.set_requires_gradient_sync(True, recurse=False)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="lightning_fpdt sequence parallelism")


RNG_KEY = "fpdt_rng_states"


def _rng_states() -> dict[str, Any]:
    # numpy's key array as a tensor: checkpoints load with weights_only=True, which refuses numpy objects
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    kind, key, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def check_checkpoint_complete(path: Path) -> None:
    """A distributed checkpoint is complete only when both its DCP index (``.metadata``, written by the coordinator
    after every rank's shard) and Lightning's ``meta.pt`` (written by rank 0 after that) exist; a save interrupted by a
    dying rank leaves a folder without them, which must never be resumed from as if it were whole."""
    if not path.is_dir():
        if not path.exists():
            raise FileNotFoundError(f"checkpoint {path} does not exist")
        return  # a single-file checkpoint: torch.load checks it
    missing = [name for name in (".metadata", _METADATA_FILENAME) if not (path / name).is_file()]
    if missing:
        raise ValueError(
            f"checkpoint folder {path} is incomplete (missing {', '.join(missing)}): a save was interrupted, e.g. by a "
            f"rank that died; resume from an earlier checkpoint"
        )


def attention_geometry(model: torch.nn.Module, precision: str) -> Optional[AttentionGeometry]:
    """The attention sizes the planner needs, read from the model's config and its installed attention layers."""
    heads = attention_heads(model)
    config = getattr(model, "config", None)
    if heads is None or config is None:
        return None
    hidden = getattr(config, "hidden_size", None)
    head_dim = getattr(config, "head_dim", None) or (hidden // heads[0] if hidden else None)
    handles = installed_attentions(model)
    layers = len(handles)
    head_chunks = max((h.layout.num_groups for h in handles if isinstance(h, HeadGroupedAttention)), default=1)
    if not head_dim or not layers:
        return None
    geometry = AttentionGeometry(num_layers=layers, num_heads=heads[0], num_kv_heads=heads[1], head_dim=int(head_dim),
                                 dtype_bytes=4 if precision == "32-true" else 2)
    return grouped_geometry(geometry, head_chunks)  # what chunks/offload "auto" size: one group's attention calls


def packed_documents(
    document_ids: Optional[Tensor], position_ids: Tensor, shape: torch.Size
) -> tuple[Optional[DocumentBoundaries], Optional[Tensor]]:
    """The documents of a packed global batch and the ``(B, S)`` mask of their starts; ``(None, None)`` for a batch
    of one document per sequence. From ``document_ids`` when the batch has them, else from ``position_ids`` that
    restart at 0 (one host synchronisation per packed batch, for the start offsets)."""
    if document_ids is not None:
        if not isinstance(document_ids, Tensor) or tuple(document_ids.shape) != tuple(shape):
            raise ValueError(
                f"batch['document_ids'] must be a tensor shaped like input_ids {tuple(shape)} (one document id per "
                f"token), got {tuple(document_ids.shape) if isinstance(document_ids, Tensor) else type(document_ids)}"
            )
        starts = document_starts_mask(document_ids=document_ids)
    else:
        if position_ids.dim() != 2 or position_ids.shape[1] != shape[1] or position_ids.shape[0] not in (1, shape[0]):
            raise ValueError(
                f"batch['position_ids'] must be shaped like input_ids {tuple(shape)} (or (1, S)), got "
                f"{tuple(position_ids.shape)}"
            )
        if not has_position_resets(position_ids):
            return None, None
        starts = document_starts_mask(position_ids=position_ids.expand(shape[0], -1))
    return DocumentBoundaries.from_starts_mask(starts), starts


def memory_transforms(trainer: "pl.Trainer") -> list:
    """The model transforms that callbacks declare (``fpdt_transform(model, blocks)``), in their fixed order
    (tiled MLP, tiled loss, activation checkpointing + offload; DESIGN.md §5)."""
    declaring = [cb for cb in trainer.callbacks if callable(getattr(cb, "fpdt_transform", None))]
    return [cb.fpdt_transform for cb in sorted(declaring, key=lambda cb: cb.fpdt_transform_order)]


def usable_total_bytes(device: torch.device) -> int:
    """The GPU memory this process may use: the card's, times ``torch.cuda.set_per_process_memory_fraction``."""
    total = torch.cuda.get_device_properties(device).total_memory
    return int(total * torch.cuda.get_per_process_memory_fraction(device))


def usable_free_bytes(device: torch.device) -> int:
    """Free GPU memory for planning: what the card has free, and no more than the process's cap leaves."""
    free = torch.cuda.mem_get_info(device)[0]
    return max(0, min(free, usable_total_bytes(device) - torch.cuda.memory_reserved(device)))


def _retie_weights(module: torch.nn.Module) -> None:
    # materialising meta parameters unties shared ones; models that tie re-tie here
    tie = getattr(module, "tie_weights", None)
    if callable(tie) and getattr(getattr(module, "config", None), "tie_word_embeddings", False):
        tie()


def _materialize(module: torch.nn.Module, device: torch.device, *, rank: int) -> None:
    """Allocate the meta parameters and buffers of ``module`` on ``device`` (FSDP2 DTensors: each rank only its
    shards) and initialise them: with the model's own ``reset_parameters`` when it has one (the reference Llama's
    N(0, initializer_range) and norms at 1; per submodule, ``nn.Linear`` would give its Kaiming init instead), else
    with each submodule's (Lightning's ``_materialize_distributed_module``)."""
    model = find_model(module)
    reset = getattr(model, "reset_parameters", None)
    with _distinct_shard_draws(device, rank=rank):
        if callable(reset):
            module.to_empty(device=device)  # on the root, as Lightning's helper: nothing left on meta
            reset()
        else:
            _materialize_distributed_module(module, device)
    model.apply(_retie_weights)


@contextmanager
def _distinct_shard_draws(device: torch.device, *, rank: int) -> Generator[None, None, None]:
    """Random ops on DTensors draw each rank's shard at its own offset of one shared stream on CUDA-like devices, but
    shards in host memory from each rank's CPU generator as it stands (DTensor's ``OffsetBasedRNGTracker`` refuses
    the CPU), so ranks seeded alike would draw equal shards. For those each rank draws from a stream of its own,
    derived from the global RNG, which is left where it was (the flat FSDP2 mesh gives no two ranks the same
    shard)."""
    if device.type != "cpu":
        yield
        return
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # DTensor warns that its random ops may not fully support a CPU mesh: the per-rank stream is the answer
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        torch.manual_seed(int(torch.randint(2**62, ())) + rank)
        yield
