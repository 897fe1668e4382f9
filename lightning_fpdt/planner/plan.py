"""``plan_memory``: the memory of one training step under ``strategy="fpdt"``, per GPU and per host, and what to change
when it does not fit (the formulas: :mod:`lightning_fpdt.planner.components`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional, Union

from lightning_fpdt.planner.components import GIB, MemoryPlan, build_plan
from lightning_fpdt.planner.geometry import OPTIMIZER_STATES, PRECISIONS, geometry_name, resolve_geometry
from lightning_fpdt.planner.options import resolve_options
from lightning_fpdt.planner.recommend import recommend
from lightning_fpdt.sequence.options import FPDTOptions


def plan_memory(
    *,
    geometry: Any,
    seq_len: int,
    batch_size: int = 1,
    num_gpus: int,
    gpus_per_node: Optional[int] = None,
    sequence_parallel_size: Union[Literal["auto"], int] = "auto",
    ring_size: Union[Literal["auto"], int] = "auto",
    chunks: Union[Literal["auto"], int] = "auto",
    offload: Union[Literal["auto"], bool] = "auto",
    offload_dq: Union[Literal["auto"], bool] = "auto",
    activation_offload: bool,
    tiled_mlp: bool,
    tiled_loss: bool,
    activation_checkpointing: Optional[bool] = None,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    cpu_offload_params: bool = False,
    gpu_memory_gib: float = 80.0,
    host_memory_gib: Optional[float] = None,
    recompute_attention: bool = False,
    head_chunks: int = 1,
    reload_input: bool = False,
    input_prefetch: bool = True,
) -> MemoryPlan:
    """Predict the memory of one training step under ``strategy="fpdt"``, per GPU and per host, and recommend options.

    Args:
        geometry: a :class:`ModelGeometry`, a ``LlamaConfig`` or Hugging Face config, a named size (``"llama3-8b"``)
            or the path of a Hugging Face ``config.json``.
        seq_len: global tokens of one sequence ``S`` (padded here as the strategy pads it, to a multiple of ``P·u``).
        batch_size: sequences per data-parallel group per step.
        num_gpus: all GPUs ``W`` (FSDP2 shards the states over all of them).
        gpus_per_node: GPUs of one host (``None``: all of them); pinned host memory is needed per host.
        sequence_parallel_size, ring_size, chunks, offload, offload_dq, cpu_offload_params: as ``FPDTStrategy``
            takes them (``ring_size="auto"``: the smallest ring the heads need, 1 when ``P`` divides them);
            ``"auto"`` resolves as the strategy does, with the free memory of ``gpu_memory_gib`` minus the sharded
            weights.
        activation_offload, tiled_mlp, tiled_loss: whether the ``ActivationOffload``, ``TiledMLP``, ``TiledLoss``
            callbacks are on.
        activation_checkpointing: blocks checkpointed with their inputs on the GPU (``ActivationOffload(offload=
            False)``); ``None``: only when ``activation_offload``.
        recompute_attention: ``ActivationOffload(recompute_attention=True)``: one layer's stash instead of every
            layer's, the attention forward run twice.
        precision: ``"bf16-mixed"``, ``"bf16-true"`` or ``"32-true"``.
        optimizer: ``"adamw"``, ``"adam"`` (two moments) or ``"sgd"`` (none).
        gpu_memory_gib: memory of one GPU in GiB (about 79 for an H100 80GB, 139 for an H200).
        host_memory_gib: memory one host can pin; ``None``: not checked.
        head_chunks: head groups ``G`` (``FPDTStrategy(head_chunks=...)``): the attention phases hold one group's
            q/k/v/out (``1/G`` of the full-width buffers) and its FPDT working set, plus a hidden-sized output sum.
        reload_input: ``ActivationOffload(reload_input=True)``: a block's input stays on the host through its
            backward (one hidden-sized tensor less in the backward phases).
        input_prefetch: ``ActivationOffload(prefetch=...)`` of one block or more: the next block's input comes back
            during a block's attention backward (``False``: ``prefetch=0``).

    Returns:
        A :class:`MemoryPlan`: components, ``peak_gpu_bytes = Σ persistent + max(transient phases)``, pinned host
        bytes per host, ``binding_limit`` and, when it does not fit, ``recommended`` (a plan that fits) and
        ``recommendation`` (the changes in words). A model, not a measurement: see the module docstring.
    """
    geometry = resolve_geometry(geometry)
    model = geometry_name(geometry)
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("num_gpus", num_gpus)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} ({value!r}) must be a positive int")
    gpus_per_node = num_gpus if gpus_per_node is None else gpus_per_node
    if gpus_per_node < 1 or num_gpus % gpus_per_node:
        raise ValueError(f"gpus_per_node ({gpus_per_node}) must divide num_gpus ({num_gpus})")
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not planned for; use one of {sorted(PRECISIONS)}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer {optimizer!r} is not planned for; use one of {sorted(OPTIMIZER_STATES)}")
    attention_options = FPDTOptions(chunks=chunks, offload=offload, offload_dq=offload_dq, head_chunks=head_chunks,
                                    ring_size=ring_size)
    if gpu_memory_gib <= 0 or (host_memory_gib is not None and host_memory_gib <= 0):
        raise ValueError(f"gpu_memory_gib ({gpu_memory_gib}) and host_memory_gib ({host_memory_gib}) must be positive")
    gpu_bytes = int(gpu_memory_gib * GIB)
    host_bytes = None if host_memory_gib is None else int(host_memory_gib * GIB)
    options = resolve_options(
        geometry, attention_options, seq_len=seq_len, batch_size=batch_size, num_gpus=num_gpus,
        gpus_per_node=gpus_per_node, sequence_parallel_size=sequence_parallel_size,
        activation_offload=activation_offload, activation_checkpointing=activation_checkpointing,
        tiled_mlp=tiled_mlp, tiled_loss=tiled_loss, precision=precision, optimizer=optimizer,
        cpu_offload_params=cpu_offload_params, gpu_memory_bytes=gpu_bytes, recompute_attention=recompute_attention,
        reload_input=reload_input, input_prefetch=input_prefetch,
    )
    plan = build_plan(geometry, model, seq_len=seq_len, batch_size=batch_size, num_gpus=num_gpus,
                      gpus_per_node=gpus_per_node, options=options, gpu_memory_bytes=gpu_bytes,
                      host_memory_bytes=host_bytes)
    recommended, recommendation = recommend(plan, offload_dq)
    return dataclasses.replace(plan, recommended=recommended, recommendation=recommendation)
