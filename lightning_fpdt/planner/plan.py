"""``plan_memory``: the memory of one training step under ``strategy="fpdt"``, per GPU and per host, and what to change
when it does not fit (the formulas: :mod:`lightning_fpdt.planner.components`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional, Union

from lightning_fpdt.memory.block_schedule import check_checkpoint_blocks, check_keep_inputs
from lightning_fpdt.planner.components import GIB, MemoryPlan
from lightning_fpdt.planner.cost import inter_host_rate
from lightning_fpdt.planner.features import FEATURES
from lightning_fpdt.planner.features.disk_tier import DISK_GBPS
from lightning_fpdt.planner.geometry import OPTIMIZER_STATES, PRECISIONS, geometry_name, resolve_geometry
from lightning_fpdt.planner.host import gib
from lightning_fpdt.planner.options import resolve_options
from lightning_fpdt.planner.phases import PROCESS_BASELINE_BYTES
from lightning_fpdt.planner.search import SEARCHED, Run, changes_between, fastest_fitting
from lightning_fpdt.sequence.options import FPDTOptions

AUTO_NEUTRAL = {name: value for feature in FEATURES for name, value in feature.neutral.items()}
"""What these options are before the search resolves their ``"auto"`` (and when nothing fits): each feature's."""

Switch = Union[Literal["auto"], bool]


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
    offload: Switch = "auto",
    offload_dq: Switch = "auto",
    activation_offload: bool,
    tiled_mlp: bool,
    tiled_loss: bool,
    activation_checkpointing: Optional[bool] = None,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    cpu_offload_params: bool = False,
    gpu_memory_gib: float = 80.0,
    host_memory_gib: Optional[float] = None,
    recompute_attention: Switch = False,
    head_chunks: Union[Literal["auto"], int] = 1,
    reload_input: Switch = False,
    prefetch: Union[Literal["auto"], int] = 1,
    keep_inputs: Union[Literal["auto", "all"], int] = "all",
    checkpoint_blocks: Union[Literal["auto", "all"], int] = "all",
    host_baseline_gib: Optional[float] = None,
    disk_memory_gib: Optional[float] = None,
    disk_gbps: float = DISK_GBPS,
    disk_inputs: Union[Literal["auto"], int] = "auto",
    accumulate_grad_batches: int = 1,
    sync_every_batch: Switch = "auto",
    trainable_parameters: Optional[int] = None,
    inter_host_gbps: Optional[float] = None,
) -> MemoryPlan:
    """Predict the memory of one training step under ``strategy="fpdt"``, per GPU and per host; resolve the
    ``"auto"`` options to the fastest configuration that fits both memories; recommend changes when none fits.

    Args:
        geometry: a :class:`ModelGeometry`, a ``LlamaConfig`` or Hugging Face config, a named size (``"llama3-8b"``)
            or the path of a Hugging Face ``config.json``.
        seq_len: global tokens of one sequence ``S`` (padded here as the strategy pads it, to a multiple of ``P·u``).
        batch_size: sequences per data-parallel group per step.
        num_gpus: all GPUs ``W`` (FSDP2 shards the states over all of them).
        gpus_per_node: GPUs of one host (``None``: all of them); host memory is needed per host.
        sequence_parallel_size, ring_size, chunks, offload, offload_dq, head_chunks, cpu_offload_params: as
            ``FPDTStrategy`` takes them. ``"auto"`` (``ring_size``: the smallest ring the heads need; for a group
            spanning hosts the fastest layout, ``inter_host_gbps``) is resolved by the search
            (:mod:`lightning_fpdt.planner.search`), as the strategy resolves it on a GPU.
        activation_offload, tiled_mlp, tiled_loss: whether the ``ActivationOffload``, ``TiledMLP``, ``TiledLoss``
            callbacks are on.
        activation_checkpointing: blocks checkpointed with their inputs on the GPU (``ActivationOffload(offload=
            False)``); ``None``: only when ``activation_offload``.
        recompute_attention, reload_input, prefetch: ``ActivationOffload``'s ``recompute_attention``,
            ``reload_input`` and ``prefetch`` (blocks ahead whose inputs come back), or ``"auto"``.
        keep_inputs: ``ActivationOffload(keep_inputs=...)``: ``"all"``, a count of block inputs kept (1 to the
            model's layers; the others regenerated in the backward), or ``"auto"``.
        checkpoint_blocks: ``ActivationOffload(checkpoint_blocks=...)``: ``"all"``, a count of blocks checkpointed
            (0 to the model's layers; the first ones, the others plain), or ``"auto"`` (the fewest that fit).
        precision: ``"bf16-mixed"``, ``"bf16-true"`` or ``"32-true"``.
        optimizer: ``"adamw"``, ``"adam"`` (two moments) or ``"sgd"`` (none).
        gpu_memory_gib: memory of one GPU in GiB (about 79 for an H100 80GB, 139 for an H200).
        host_memory_gib: memory the processes of one host may hold (pinned and pageable); ``None``: not checked.
        host_baseline_gib: resident memory of one process before the step's buffers; ``None``: the planner's
            estimate (:data:`~lightning_fpdt.planner.phases.PROCESS_BASELINE_BYTES`).
        disk_memory_gib: free space of the disk tier's directory on one host (``FPDTStrategy(offload_dir=...)``);
            ``None``: no disk tier.
        disk_gbps: the disk's read and write rate in GB/s, shared by the GPUs of a host.
        disk_inputs: block inputs per GPU on disk; ``"auto"``: as many as the host's memory needs, when it needs
            them and that is the fastest way to fit (:mod:`lightning_fpdt.planner.features.disk_tier`).
        accumulate_grad_batches: ``Trainer(accumulate_grad_batches=...)``: batches per optimizer step.
        sync_every_batch: with ``accumulate_grad_batches > 1``, ``FPDTStrategy(sync_every_batch=...)``: every batch
            reduce-scatters its gradients into the shards (``True``), or only a window's last, every parameter's
            unsharded gradient (reduce dtype) alive on every GPU through the window (``False``); ``"auto"``: the
            faster that fits (:mod:`lightning_fpdt.planner.features.accumulation`).
        trainable_parameters: the parameters that train (LoRA's adapters, a model with frozen parts): only they
            have gradients and optimizer states, so the states take less and longer sequences fit; ``None``: all.
        inter_host_gbps: GB/s one GPU sends to GPUs of other hosts (``None``: :data:`~lightning_fpdt.planner.cost.
            INTER_HOST_BYTES`, a 400 Gb/s InfiniBand link per GPU): the step-time estimate charges the traffic that
            leaves a host at it, and a sequence-parallel group spanning hosts takes the layout (``ring_size``
            ``"auto"``) that estimate ranks fastest among those that fit (:mod:`lightning_fpdt.planner.cost`).

    Returns:
        A :class:`MemoryPlan`: components, ``peak_gpu_bytes = Σ persistent + max(transient phases)``, host bytes
        per host (pinned and resident), ``binding_limit`` and, when it does not fit, ``recommended`` (the fastest
        plan that fits) and ``recommendation`` (the changes in words). A model, not a measurement: see
        :mod:`lightning_fpdt.planner.components`.
    """
    geometry = resolve_geometry(geometry)
    model = geometry_name(geometry)
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("num_gpus", num_gpus),
                        ("accumulate_grad_batches", accumulate_grad_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} ({value!r}) must be a positive int")
    gpus_per_node = num_gpus if gpus_per_node is None else gpus_per_node
    if gpus_per_node < 1 or num_gpus % gpus_per_node:
        raise ValueError(f"gpus_per_node ({gpus_per_node}) must divide num_gpus ({num_gpus})")
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not planned for; use one of {sorted(PRECISIONS)}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer {optimizer!r} is not planned for; use one of {sorted(OPTIMIZER_STATES)}")
    for name, value in (("recompute_attention", recompute_attention), ("reload_input", reload_input),
                        ("sync_every_batch", sync_every_batch)):
        if value not in ("auto", True, False):
            raise ValueError(f"{name} must be 'auto', True or False, got {value!r}")
    if prefetch != "auto" and (isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0):
        raise ValueError(f"prefetch must be 'auto' or >= 0 blocks, got {prefetch!r}")
    if disk_memory_gib is not None and (disk_memory_gib < 0 or disk_gbps <= 0):
        raise ValueError(f"disk_memory_gib ({disk_memory_gib}) must be >= 0 and disk_gbps ({disk_gbps}) positive")
    if disk_inputs != "auto":
        if isinstance(disk_inputs, bool) or not isinstance(disk_inputs, int) or not 0 <= disk_inputs <= geometry.num_layers:
            raise ValueError(f"disk_inputs must be 'auto' or a number of block inputs from 0 to the "
                             f"{geometry.num_layers} layers, got {disk_inputs!r}")
        if disk_inputs and (disk_memory_gib is None or not activation_offload):
            raise ValueError(f"disk_inputs={disk_inputs} puts block inputs on disk: it needs activation_offload=True "
                             f"and a disk (disk_memory_gib)")
    check_keep_inputs(keep_inputs, geometry.num_layers)
    check_checkpoint_blocks(checkpoint_blocks, geometry.num_layers)
    if checkpoint_blocks == geometry.num_layers:
        checkpoint_blocks = "all"
    if checkpoint_blocks not in ("all", "auto") and not (activation_offload or activation_checkpointing):
        raise ValueError(f"checkpoint_blocks={checkpoint_blocks!r} chooses which blocks ActivationOffload checkpoints: "
                         f"it needs activation_offload=True (or activation_checkpointing=True)")
    if keep_inputs == geometry.num_layers:
        keep_inputs = "all"
    given = dict(chunks=chunks, offload=offload, offload_dq=offload_dq, head_chunks=head_chunks,
                 recompute_attention=recompute_attention, reload_input=reload_input, prefetch=prefetch,
                 disk_inputs=disk_inputs, keep_inputs=keep_inputs, sync_every_batch=sync_every_batch,
                 checkpoint_blocks=checkpoint_blocks, ring_size=ring_size)
    free = {name for name, value in given.items() if value == "auto"}
    attention_options = FPDTOptions(chunks=chunks, offload=offload, offload_dq=offload_dq,
                                    head_chunks=1 if head_chunks == "auto" else head_chunks, ring_size=ring_size)
    if gpu_memory_gib <= 0 or (host_memory_gib is not None and host_memory_gib <= 0):
        raise ValueError(f"gpu_memory_gib ({gpu_memory_gib}) and host_memory_gib ({host_memory_gib}) must be positive")
    gpu_bytes = int(gpu_memory_gib * GIB)
    run = Run(geometry, model, seq_len=seq_len, batch_size=batch_size, num_gpus=num_gpus, gpus_per_node=gpus_per_node,
              gpu_memory_bytes=gpu_bytes, host_memory_bytes=None if host_memory_gib is None else int(host_memory_gib * GIB),
              host_baseline_bytes=PROCESS_BASELINE_BYTES if host_baseline_gib is None else int(host_baseline_gib * GIB),
              disk_memory_bytes=None if disk_memory_gib is None else int(disk_memory_gib * GIB),
              disk_bytes_per_second=disk_gbps * 1e9, inter_host_bytes_per_second=inter_host_rate(inter_host_gbps))
    neutral = {name: AUTO_NEUTRAL[name] if given[name] == "auto" else given[name] for name in AUTO_NEUTRAL}
    base = resolve_options(
        geometry, attention_options, seq_len=seq_len, batch_size=batch_size, num_gpus=num_gpus,
        gpus_per_node=gpus_per_node, sequence_parallel_size=sequence_parallel_size,
        activation_offload=activation_offload, activation_checkpointing=activation_checkpointing,
        tiled_mlp=tiled_mlp, tiled_loss=tiled_loss, precision=precision, optimizer=optimizer,
        cpu_offload_params=cpu_offload_params, gpu_memory_bytes=gpu_bytes, accumulate_grad_batches=accumulate_grad_batches,
        trainable_parameters=trainable_parameters,
        **{name: value for name, value in neutral.items() if name != "head_chunks"},
    )
    base = dataclasses.replace(base, head_chunks=neutral["head_chunks"])
    plan = (fastest_fitting(run, base, free) if free else None) or run.plan(base)
    if plan.fits:
        return dataclasses.replace(plan, recommendation="the options as given fit" if not free else
                                   "the options as given fit (\"auto\" resolved to the fastest that fits)")
    explicit = {name: getattr(base, name) for name in SEARCHED if name not in free}
    recommended = fastest_fitting(run, plan.options, SEARCHED, explicit)
    if recommended is None:
        return dataclasses.replace(plan, recommendation=nothing_fits(plan, run, explicit))
    changes = changes_between(plan.options, recommended.options)
    return dataclasses.replace(plan, recommended=recommended, recommendation=said(changes, free))


DISK_SEARCH_ROUNDS = 6
"""Searches at most for the least disk a refused plan would fit with (each one below the last one's disk bytes)."""


def _disk_would_need(plan: MemoryPlan, run: Optional[Run], explicit: Optional[dict[str, Any]]) -> str:
    """With a disk tier: ``; it fits with N GiB per host on disk ...`` when a larger disk would make the run fit (the
    search again: the least disk any configuration fits with), else nothing. Without one: that the disk tier may help (the search is
    not run again: a refusal without a disk stays as fast as it was)."""
    if run is None or not plan.options.activation_offload:
        return ""
    if run.disk_memory_bytes is None:
        return "; block inputs may also go to a local disk: FPDTStrategy(offload_dir=...), `lightning-fpdt plan --disk-gib N`"
    # the least disk that fits: the fastest plan with the disk's room unbounded, then again below what it put on disk
    # (keeping fewer block inputs, say), until nothing fits
    least, room = None, 2**62
    for _ in range(DISK_SEARCH_ROUNDS):
        wider = fastest_fitting(dataclasses.replace(run, disk_memory_bytes=room), plan.options, SEARCHED, explicit)
        if wider is None:
            break
        least, room = wider, wider.disk_bytes_per_node - 1
        if room < 0:
            break
    if least is None:
        return ""
    return (f"; it fits with {least.options.disk_inputs} block inputs per GPU on disk, "
            f"{gib(least.disk_bytes_per_node)} GiB per host (the disk tier has {gib(run.disk_memory_bytes)} GiB "
            f"free), with {least.options.describe()}")


def said(changes: dict[str, Any], auto: set[str]) -> str:
    """``set a=1, b=2`` for the options to set; those left ``"auto"`` follow in brackets."""
    if changes.get("activation_offload") and "activation_checkpointing" in changes:
        changes = {k: v for k, v in changes.items() if k != "activation_checkpointing"}  # ActivationOffload implies it
    chosen = [f"{name}={value}" for name, value in changes.items() if name not in auto]
    resolved = [f"{name}={value}" for name, value in changes.items() if name in auto]
    text = "set " + ", ".join(chosen) if chosen else "keep the options as given"
    return text + (f" (\"auto\" then resolves {', '.join(resolved)})" if resolved else "")


def nothing_fits(plan: MemoryPlan, run: Optional[Run] = None, explicit: Optional[dict[str, Any]] = None) -> str:
    """Why no configuration fits, and what to do instead (``explicit``: the options the user gave, as the
    recommendation's search weighs their changes)."""
    if plan.binding_limit == "host memory":
        return (f"nothing fits the host ({gib(plan.host_resident_bytes_per_node)} GiB per host as planned, "
                f"{gib(plan.host_memory_bytes)} GiB there{_disk_would_need(plan, run, explicit)}): use more hosts (each GPU "
                f"holds S/P tokens) or a shorter sequence")
    if plan.binding_limit == "disk space":
        return (f"nothing fits the disk ({gib(plan.disk_bytes_per_node)} GiB per host on disk as planned, "
                f"{gib(plan.disk_memory_bytes)} GiB free there): fewer block inputs on disk (disk_inputs), a larger "
                f"local disk for offload_dir, more hosts or a shorter sequence")
    return ("nothing in the search fits (still over GPU memory with every memory feature tried): use more GPUs "
            "(each holds S/P tokens and 1/W of the states) or a shorter sequence")
