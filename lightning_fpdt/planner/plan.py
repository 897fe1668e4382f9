"""``plan_memory``: the memory of one training step under ``strategy="fpdt"``, per GPU and per host, and what to change
when it does not fit (the formulas: :mod:`lightning_fpdt.planner.components`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from lightning_fpdt.planner.components import MemoryPlan
from lightning_fpdt.planner.cost import inter_host_rate
from lightning_fpdt.planner.features import FEATURES
from lightning_fpdt.planner.geometry import geometry_name
from lightning_fpdt.planner.host import gib
from lightning_fpdt.planner.phases import PROCESS_BASELINE_BYTES
from lightning_fpdt.planner.plan_options import PlanOptions, resolve_options
from lightning_fpdt.planner.rates import BUILTIN_RATES
from lightning_fpdt.planner.request import FEATURE_FIELDS, PlanRequest
from lightning_fpdt.planner.search import SEARCHED, Run, SearchMemo, changes_between, fastest_fitting
from lightning_fpdt.planner.step_sizes import StepSizes
from lightning_fpdt.sequence.options import FPDTOptions

AUTO_NEUTRAL = {name: value for feature in FEATURES for name, value in feature.neutral.items()}
"""What these options are before the search resolves their ``"auto"`` (and when nothing fits): each feature's."""


def prepared(request: PlanRequest) -> tuple[Run, PlanOptions, set[str]]:
    """What a search of ``request`` starts from: the run, its options with every ``"auto"`` at the value the search
    starts from, and the names of the options left ``"auto"`` (free)."""
    geometry, machine, features = request.geometry, request.machine, request.features
    # the options the search may resolve, as given: the callbacks' from their features, the strategy's from the request
    given = {name: getattr(features if name in FEATURE_FIELDS else request, name)
             for name in (*AUTO_NEUTRAL, "chunks", "offload", "offload_dq", "ring_size")}
    free = {name for name, value in given.items() if value == "auto"}
    head_chunks = request.head_chunks
    attention_options = FPDTOptions(chunks=request.chunks, offload=request.offload, offload_dq=request.offload_dq,
                                    head_chunks=1 if head_chunks == "auto" else head_chunks,
                                    ring_size=request.ring_size)
    run = Run(geometry, geometry_name(geometry), seq_len=request.seq_len, batch_size=request.batch_size,
              num_gpus=machine.num_gpus, gpus_per_node=machine.gpus_per_node,
              gpu_memory_bytes=machine.gpu_memory_bytes, host_memory_bytes=machine.host_memory_bytes,
              host_baseline_bytes=PROCESS_BASELINE_BYTES if machine.host_baseline_bytes is None else
              machine.host_baseline_bytes,
              disk_memory_bytes=machine.disk_memory_bytes, disk_bytes_per_second=machine.disk_gbps * 1e9,
              inter_host_bytes_per_second=inter_host_rate(machine.inter_host_gbps),
              rates=machine.rates or BUILTIN_RATES)
    neutral = {name: AUTO_NEUTRAL[name] if given[name] == "auto" else given[name] for name in AUTO_NEUTRAL}
    base = resolve_options(
        geometry, attention_options, seq_len=request.seq_len, batch_size=request.batch_size,
        num_gpus=machine.num_gpus, gpus_per_node=machine.gpus_per_node,
        sequence_parallel_size=request.sequence_parallel_size, activation_offload=features.activation_offload,
        activation_checkpointing=features.activation_checkpointing, tiled_mlp=features.tiled_mlp,
        tiled_loss=features.tiled_loss, precision=request.precision, optimizer=request.optimizer,
        cpu_offload_params=request.cpu_offload_params, gpu_memory_bytes=machine.gpu_memory_bytes,
        accumulate_grad_batches=request.accumulate_grad_batches, trainable_parameters=request.trainable_parameters,
        other_parameters=request.other_parameters, other_trainable_parameters=request.other_trainable_parameters,
        **{name: value for name, value in neutral.items() if name != "head_chunks"},
    )
    base = dataclasses.replace(base, head_chunks=neutral["head_chunks"])
    return run, base, free


def timed_sizes(request: PlanRequest) -> list[StepSizes]:
    """The sizes of ``request`` with each chunk count the search may try, and each head-group count where those are
    free: what the cost model times, so what a calibration measures for it (the GEMMs and attention blocks of
    :func:`lightning_fpdt.planner.calibration.needed_shapes`)."""
    run, base, free = prepared(request)
    s = run.sizes(base)
    owners = {field: feature for feature in FEATURES for field in feature.fields}
    chunks = owners["chunks"].choices("chunks", s) if "chunks" in free else (base.chunks,)
    groups = owners["head_chunks"].choices("head_chunks", s) if "head_chunks" in free else (base.head_chunks,)
    found = []
    for u in chunks:
        for g in groups:
            try:
                found.append(run.sizes(dataclasses.replace(base, chunks=u, head_chunks=g)))
            except ValueError:
                continue  # a combination the options refuse
    return found


def plan_memory(request: Optional[PlanRequest] = None, /, **keywords: Any) -> MemoryPlan:
    """Predict the memory of one training step under ``strategy="fpdt"``, per GPU and per host; resolve the
    ``"auto"`` options to the fastest configuration that fits both memories; recommend changes when none fits.

    Args:
        request: the run and the machine (:class:`~lightning_fpdt.planner.request.PlanRequest`), or, instead of it,
            their fields as keywords (:meth:`PlanRequest.of <lightning_fpdt.planner.request.PlanRequest.of>`:
            ``geometry``, ``seq_len``, ``num_gpus``, ``activation_offload``, ``tiled_mlp`` and ``tiled_loss`` are
            required; docs/planner.md lists the others).

    Returns:
        A :class:`MemoryPlan`: components, ``peak_gpu_bytes = Σ persistent + max(transient phases)``, host bytes
        per host (pinned and resident), ``binding_limit`` and, when it does not fit, ``recommended`` (the fastest
        plan that fits) and ``recommendation`` (the changes in words). A model, not a measurement: see
        :mod:`lightning_fpdt.planner.components`.
    """
    if request is None:
        request = PlanRequest.of(**keywords)
    elif keywords:
        raise TypeError(f"plan_memory takes a PlanRequest or keywords, not both (got {sorted(keywords)} too)")
    run, base, free = prepared(request)
    memo = SearchMemo(run)  # the searches below plan many of the same configurations
    plan = (fastest_fitting(run, base, free, memo=memo) if free else None) or run.plan(base)
    if plan.fits:
        fit = "the options as given fit" + (" the GPU memory" if unchecked_host(plan) else "")
        return dataclasses.replace(plan, recommendation=(fit if not free else
                                   fit + " (\"auto\" resolved to the fastest that fits)") + unchecked_host(plan))
    explicit = {name: getattr(base, name) for name in SEARCHED if name not in free}
    recommended = fastest_fitting(run, plan.options, SEARCHED, explicit, memo=memo)
    if recommended is None:
        return dataclasses.replace(plan, recommendation=nothing_fits(plan, run, explicit, memo))
    changes = changes_between(plan.options, recommended.options)
    return dataclasses.replace(plan, recommended=recommended,
                               recommendation=said(changes, free) + unchecked_host(recommended))


def unchecked_host(plan: MemoryPlan) -> str:
    """``; the host's memory was not checked: ...`` with what the plan needs per host, where it was made without the
    host's memory (``host_memory_gib=None``) and needs any beyond the processes' own; else nothing."""
    if plan.host_memory_bytes is not None or not plan.host_bytes_per_node:
        return ""
    return (f"; the host's memory was not checked: it needs {gib(plan.host_resident_bytes_per_node)} GiB per host, "
            f"{gib(plan.host_bytes_per_node)} GiB of it pinned (give host_memory_gib to check it)")


DISK_SEARCH_ROUNDS = 6
"""Searches at most for the least disk a refused plan would fit with (each one below the last one's disk bytes)."""


def _disk_would_need(plan: MemoryPlan, run: Optional[Run], explicit: Optional[dict[str, Any]],
                     memo: Optional[SearchMemo] = None) -> str:
    """With a disk tier: ``; it fits with N GiB per host on disk ...`` when a larger disk would make the run fit (the
    search again: the least disk any configuration fits with), else nothing. Without one: that the disk tier may help
    (the search is not run again: a refusal without a disk stays as fast as it was)."""
    if run is None or not plan.options.activation_offload:
        return ""
    if run.disk_memory_bytes is None:
        return ("; block inputs may also go to a local disk: FPDTStrategy(offload_dir=...), "
                "`lightning-fpdt plan --disk-gib N`")
    # the least disk that fits: the fastest plan with the disk's room unbounded, then again below what it put on disk
    # (keeping fewer block inputs, say), until nothing fits
    least, room = None, 2**62
    for _ in range(DISK_SEARCH_ROUNDS):
        wider = fastest_fitting(dataclasses.replace(run, disk_memory_bytes=room), plan.options, SEARCHED, explicit,
                                memo=memo)
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


def nothing_fits(plan: MemoryPlan, run: Optional[Run] = None, explicit: Optional[dict[str, Any]] = None,
                 memo: Optional[SearchMemo] = None) -> str:
    """Why no configuration fits, and what to do instead (``explicit``: the options the user gave, as the
    recommendation's search weighs their changes; ``memo``: the work of the searches of ``run`` so far)."""
    if plan.binding_limit == "host memory":
        return (f"nothing fits the host ({gib(plan.host_resident_bytes_per_node)} GiB per host as planned, "
                f"{gib(plan.host_memory_bytes)} GiB there{_disk_would_need(plan, run, explicit, memo)}): use more "
                f"hosts (each GPU holds S/P tokens) or a shorter sequence")
    if plan.binding_limit == "disk space":
        return (f"nothing fits the disk ({gib(plan.disk_bytes_per_node)} GiB per host on disk as planned, "
                f"{gib(plan.disk_memory_bytes)} GiB free there): fewer block inputs on disk (disk_inputs), a larger "
                f"local disk for offload_dir, more hosts or a shorter sequence")
    return ("nothing in the search fits (still over GPU memory with every memory feature tried): use more GPUs "
            "(each holds S/P tokens and 1/W of the states) or a shorter sequence")
