"""The options a plan is made for, every ``"auto"`` resolved as the strategy resolves it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from lightning_fpdt.flops import ModelGeometry, is_count
from lightning_fpdt.memory.block_schedule import check_checkpoint_blocks, check_keep_inputs, check_plain_blocks
from lightning_fpdt.planner.geometry import PRECISIONS, attention_geometry, total_parameters
from lightning_fpdt.sequence.options import FPDTOptions, check_switch
from lightning_fpdt.sequence.planning import AttentionGeometry, grouped_geometry
from lightning_fpdt.sequence.ring_rules import check_ring
from lightning_fpdt.sequence.sizes import resolve_sequence_sizes


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """The options a plan is made for, with every ``"auto"`` resolved."""

    sequence_parallel_size: int
    """``P``: GPUs sharing one sequence."""
    data_parallel_size: int
    """Groups of ``P`` GPUs that see different samples."""
    chunks: int
    """FPDT chunks per rank ``u``."""
    offload: bool
    """Attention chunks (and, under checkpointing, each layer's attention output) in pinned host memory."""
    offload_dq: bool
    """The backward's fp32 partial dQ sums in host memory too."""
    activation_offload: bool
    """ActivationOffload: blocks checkpointed, their inputs in pinned host memory."""
    activation_checkpointing: bool
    """Blocks checkpointed (implied by ``activation_offload``; ``ActivationOffload(offload=False)`` alone)."""
    tiled_mlp: bool
    """TiledMLP."""
    tiled_loss: bool
    """TiledLoss."""
    cpu_offload_params: bool
    """FSDP2 CPUOffloadPolicy: sharded parameters, gradients and optimizer states in pinned host memory."""
    precision: str
    """``"bf16-mixed"``, ``"bf16-true"`` or ``"32-true"``."""
    optimizer: str
    """``"adamw"``, ``"adam"`` or ``"sgd"``."""
    recompute_attention: bool = False
    """``ActivationOffload(recompute_attention=True)``: the checkpoint recomputes the attention in backward, so only
    the layer in backward holds a stash (instead of every layer) at the price of a second attention forward."""
    ring_size: int = 1
    """``R``: ring ranks of the 2-D sequence mesh (``P = U·R``); 1: plain Ulysses/FPDT."""
    head_chunks: int = 1
    """Head groups ``G``: the attention's projections and FPDT calls run on ``H/G`` query heads at a time."""
    reload_input: bool = False
    """``ActivationOffload(reload_input=True)``: a block's input stays on the host through its backward (counted
    under ``activation_offload`` only, as both below)."""
    prefetch: int = 1
    """``ActivationOffload(prefetch=n)``: the inputs of the next ``n`` blocks come back during a block's backward."""
    disk_inputs: int = 0
    """Block inputs (per GPU) in files of the disk tier (``FPDTStrategy(offload_dir=...)``) instead of pinned host
    memory: the last ones of the forward, those beyond the host budget (under ``activation_offload`` only)."""
    keep_inputs: Union[Literal["all"], int] = "all"
    """``ActivationOffload(keep_inputs=k)``: how many block inputs wait for their backward, evenly spaced, the
    others regenerated in the backward (partial residency); ``"all"``: every block's. A count is below the number of
    layers: keeping all of them is ``"all"``."""
    checkpoint_blocks: Union[Literal["all"], int] = "all"
    """``ActivationOffload(checkpoint_blocks=n)``: only the first ``n`` blocks checkpointed, the others plain (their
    activations on the GPU until their backward, their MLPs whole); ``"all"``: every block (under
    ``activation_checkpointing`` only)."""
    accumulate_grad_batches: int = 1
    """``Trainer(accumulate_grad_batches=...)``: batches of a window, each with its forward and backward, before one
    optimizer step."""
    sync_every_batch: bool = False
    """``FPDTStrategy(sync_every_batch=...)``, with ``accumulate_grad_batches > 1``: every batch reduce-scatters the
    gradients into their shards (``True``), or only a window's last, the others adding into every parameter's
    unsharded gradient (``False``)."""
    trainable_parameters: Optional[int] = None
    """Parameters that train (``requires_grad``): only they have gradients and optimizer states (LoRA adapters, a
    frozen embedding); ``None``: every parameter of the model."""
    other_parameters: int = 0
    """Parameters held beside the planned model (a frozen reference model, a value head): their sharded weights are
    counted."""
    other_trainable_parameters: int = 0
    """Those of :attr:`other_parameters` that train: their gradients and optimizer states are counted too."""

    def __post_init__(self) -> None:
        if self.trainable_parameters is not None and not is_count(self.trainable_parameters, least=0):
            raise ValueError(f"trainable_parameters must be a count of parameters >= 0 or None (all of them), got "
                             f"{self.trainable_parameters!r}")
        if not is_count(self.other_parameters, least=0) or not is_count(self.other_trainable_parameters, least=0) \
                or self.other_trainable_parameters > self.other_parameters:
            raise ValueError(f"other_parameters ({self.other_parameters!r}) and other_trainable_parameters "
                             f"({self.other_trainable_parameters!r}) must be counts, the trainable ones at most all")
        if self.activation_offload and not self.activation_checkpointing:
            raise ValueError("activation_offload checkpoints the blocks: set activation_checkpointing=True with it")
        if self.recompute_attention and not self.activation_checkpointing:
            raise ValueError("recompute_attention needs checkpointed blocks: set activation_checkpointing=True with it")
        if self.disk_inputs < 0 or (self.disk_inputs and not self.activation_offload):
            raise ValueError(f"disk_inputs={self.disk_inputs}: block inputs go to disk only from host memory, under "
                             f"activation_offload; use 0 <= disk_inputs with activation_offload=True")
        if self.keep_inputs != "all":
            check_keep_inputs(self.keep_inputs, words=("all",))
            if not self.activation_checkpointing:
                raise ValueError(f"keep_inputs={self.keep_inputs} needs checkpointed blocks: set "
                                 f"activation_checkpointing=True with it, or keep_inputs='all'")
        if not is_count(self.prefetch, least=0):
            raise ValueError(f"prefetch must be >= 0 blocks, got {self.prefetch!r}")
        if self.checkpoint_blocks != "all":
            check_checkpoint_blocks(self.checkpoint_blocks, words=("all",))
            if not self.activation_checkpointing:
                raise ValueError(f"checkpoint_blocks={self.checkpoint_blocks} needs checkpointed blocks: set "
                                 f"activation_checkpointing=True with it, or checkpoint_blocks='all'")
            check_plain_blocks(self.checkpoint_blocks, None, keep_inputs=None if self.keep_inputs == "all" else
                               self.keep_inputs,
                               recompute_attention=self.recompute_attention)
            if self.disk_inputs:
                raise ValueError(f"checkpoint_blocks={self.checkpoint_blocks} leaves blocks plain (their activations "
                                 f"kept on the GPU) while disk_inputs={self.disk_inputs} spills block inputs: use "
                                 f"checkpoint_blocks='all' with the disk tier")
        check_ring(self.ring_size, chunks=self.chunks, offload_dq=self.offload_dq, head_chunks=self.head_chunks)

    def describe(self) -> str:
        def on(flag: bool) -> str:
            return "on" if flag else "off"

        checkpointing = "offload" if self.activation_offload else ("on GPU" if self.activation_checkpointing else "off")
        split = (f" (ring {self.ring_size} x ulysses {self.sequence_parallel_size // self.ring_size})"
                 if self.ring_size > 1 else "")
        return (
            f"sp={self.sequence_parallel_size}{split} dp={self.data_parallel_size} chunks={self.chunks} "
            f"offload={on(self.offload)} (dq {on(self.offload_dq)}) tiled_mlp={on(self.tiled_mlp)} "
            f"tiled_loss={on(self.tiled_loss)} checkpointing={checkpointing}"
            f"{' (attention recomputed)' if self.recompute_attention else ''} "
            f"cpu_offload_params={on(self.cpu_offload_params)} {self.precision} {self.optimizer}"
            + (f" head_chunks={self.head_chunks}" if self.head_chunks > 1 else "")
            + (" reload_input" if self.activation_offload and self.reload_input else "")
            + (f" prefetch={self.prefetch}" if self.activation_offload and self.prefetch != 1 else "")
            + (f" disk_inputs={self.disk_inputs}" if self.disk_inputs else "")
            + (f" keep_inputs={self.keep_inputs}" if self.keep_inputs != "all" else "")
            + (f" checkpoint_blocks={self.checkpoint_blocks}" if self.checkpoint_blocks != "all" else "")
            + (f" accumulate_grad_batches={self.accumulate_grad_batches}" if self.accumulate_grad_batches > 1 else "")
            + (" sync_every_batch" if self.accumulate_grad_batches > 1 and self.sync_every_batch else "")
            + (f" trainable_parameters={self.trainable_parameters:,}" if self.trainable_parameters is not None else "")
            + (f" other_parameters={self.other_parameters:,} ({self.other_trainable_parameters:,} trained)"
               if self.other_parameters else "")
        )


Switch = Union[Literal["auto"], bool]


@dataclass(frozen=True, kw_only=True)
class MemoryFeatures:
    """What the memory callbacks ask of a run, as the user gave it (``"auto"`` or a value): the callbacks contribute
    it (``fpdt_memory_features``), and the strategy's host check, the ``"auto"`` search, the planner and the
    benchmarks take it (:meth:`plan_kwargs`)."""

    activation_checkpointing: bool = False
    """Blocks checkpointed (``ActivationOffload``)."""
    activation_offload: bool = False
    """Their inputs in host memory (``ActivationOffload(offload=True)``, the default)."""
    recompute_attention: Switch = False
    """``ActivationOffload(recompute_attention=...)``."""
    reload_input: Switch = False
    """``ActivationOffload(reload_input=...)``."""
    prefetch: Union[Literal["auto"], int] = 1
    """``ActivationOffload(prefetch=...)``: blocks ahead whose inputs come back, or ``"auto"``."""
    keep_inputs: Union[Literal["auto", "all"], int] = "all"
    """``ActivationOffload(keep_inputs=...)``: ``"all"``, a count of block inputs kept, or ``"auto"``."""
    checkpoint_blocks: Union[Literal["auto", "all"], int] = "all"
    """``ActivationOffload(checkpoint_blocks=...)``: ``"all"``, a count of blocks checkpointed (the first ones), or
    ``"auto"``."""
    tiled_mlp: bool = False
    """``TiledMLP``."""
    tiled_loss: bool = False
    """``TiledLoss``."""

    def __post_init__(self) -> None:
        check_switch("recompute_attention", self.recompute_attention)
        check_switch("reload_input", self.reload_input)
        prefetch = self.prefetch
        if prefetch != "auto" and not is_count(prefetch, least=0):
            raise ValueError(f"prefetch must be 'auto' or >= 0 blocks, got {prefetch!r}")

    @classmethod
    def declared(cls, callbacks: Iterable[Any]) -> "MemoryFeatures":
        """The features the callbacks declare together (``fpdt_memory_features``); a switch is on when any callback
        turns it on, an option another callback leaves at its default takes the one callback's value."""
        merged: dict[str, Any] = {}
        defaults = cls()
        for callback in callbacks:
            features = getattr(callback, "fpdt_memory_features", None)
            if features is None:
                continue
            for field in dataclasses.fields(cls):
                value = getattr(features, field.name)
                if value != getattr(defaults, field.name):
                    merged[field.name] = value if merged.get(field.name) in (None, value) else True
        return cls(**merged)

    def plan_kwargs(self) -> dict[str, Any]:
        """The keywords of :func:`~lightning_fpdt.planner.plan_memory` for these features."""
        return dataclasses.asdict(self)


def free_for_auto(
    geometry: ModelGeometry, *, precision: str, cpu_offload_params: bool, num_gpus: int, gpu_memory_bytes: int
) -> int:
    """What ``"auto"`` plans with: the free GPU memory at the first batch, once the sharded weights are there."""
    master = 0 if cpu_offload_params else PRECISIONS[precision]["master"] * total_parameters(geometry) // num_gpus
    return max(gpu_memory_bytes - master, 1)


def planned_attention(geometry: ModelGeometry, precision: str, head_chunks: int) -> AttentionGeometry:
    """The attention the ``"auto"`` options are sized for: one head group's calls, in the activation dtype."""
    return grouped_geometry(attention_geometry(geometry, PRECISIONS[precision]["act"]), head_chunks)


def resolve_options(
    geometry: ModelGeometry, attention_options: FPDTOptions, *, seq_len: int, batch_size: int, num_gpus: int,
    gpus_per_node: int, sequence_parallel_size: Union[str, int], activation_offload: bool,
    activation_checkpointing: Optional[bool], tiled_mlp: bool, tiled_loss: bool, precision: str, optimizer: str,
    cpu_offload_params: bool, gpu_memory_bytes: int, **features: Any,
) -> PlanOptions:
    """The sizes (as the strategy resolves its mesh) and the attention options (:meth:`FPDTOptions.resolve`, with
    the free memory of :func:`free_for_auto`) of a plan; ``features``: the memory features' other options, as
    :class:`PlanOptions` takes them (their defaults where not given)."""
    head_chunks = attention_options.head_chunks
    dp, sp, ring = resolve_sequence_sizes(
        world_size=num_gpus, devices_per_node=gpus_per_node, data_parallel_size="auto",
        sequence_parallel_size=sequence_parallel_size, ring_size=attention_options.ring_size,
        heads=(geometry.num_heads, geometry.num_kv_heads), head_chunks=head_chunks,
        allow_ring=attention_options.allows_ring,
    )
    free = free_for_auto(geometry, precision=precision, cpu_offload_params=cpu_offload_params, num_gpus=num_gpus,
                         gpu_memory_bytes=gpu_memory_bytes)
    chunks, offload, offload_dq = attention_options.resolve(
        planned_attention(geometry, precision, head_chunks), batch_size=batch_size, seq_len=seq_len, sp_size=sp,
        ring_size=ring, free_bytes=free,
    )
    return PlanOptions(
        sequence_parallel_size=sp, data_parallel_size=dp, chunks=chunks, offload=offload, offload_dq=offload_dq,
        activation_offload=activation_offload,
        activation_checkpointing=activation_offload or bool(activation_checkpointing),
        tiled_mlp=tiled_mlp, tiled_loss=tiled_loss, cpu_offload_params=cpu_offload_params, precision=precision,
        optimizer=optimizer, ring_size=ring, head_chunks=head_chunks, **features,
    )


