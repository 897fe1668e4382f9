"""The memory a run may use: the GPU memory this process may take (what ``"auto"`` options are planned with), and
the pinned host memory a run needs, checked before any pinned buffer exists (pinned-memory exhaustion takes the
machine down, not just the job)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

from lightning_fpdt.memory.surgery import find_model
from lightning_fpdt.planner import available_host_memory, check_host_memory, plan_memory, resolve_geometry

PLAN_FLAGS = ("tiled_mlp", "tiled_loss", "activation_checkpointing", "activation_offload", "recompute_attention",
              "reload_input", "input_prefetch")
"""What the memory callbacks declare to the planner (``fpdt_plan_flags``); off unless a callback says so."""


def usable_total_bytes(device: torch.device) -> int:
    """The GPU memory this process may use: the card's, times ``torch.cuda.set_per_process_memory_fraction``."""
    total = torch.cuda.get_device_properties(device).total_memory
    return int(total * torch.cuda.get_per_process_memory_fraction(device))


def usable_free_bytes(device: torch.device) -> int:
    """Free GPU memory for planning: what the card has free, and no more than the process's cap leaves."""
    free = torch.cuda.mem_get_info(device)[0]
    return max(0, min(free, usable_total_bytes(device) - torch.cuda.memory_reserved(device)))


def declared_plan_flags(callbacks: list[Any]) -> dict[str, bool]:
    """The planner flags the callbacks declare, each on when any callback says so."""
    flags = dict.fromkeys(PLAN_FLAGS, False)
    for callback in callbacks:
        declared: Mapping[str, bool] = getattr(callback, "fpdt_plan_flags", {})
        for name, value in declared.items():
            flags[name] = flags[name] or bool(value)
    return flags


def host_memory_refusal(strategy: Any, seq_len: int, batch_size: int) -> Optional[ValueError]:
    """The error refusing a run of the fpdt ``strategy`` whose pinned host memory does not fit this host, or
    ``None`` (also when nothing can be checked: no CUDA, no readable model config, no reading of the host's
    memory). The plan is made for the strategy's sizes, its resolved options and the callbacks' declarations."""
    device = strategy.root_device
    config = getattr(find_model(strategy.model), "config", None)
    available = available_host_memory()
    if device.type != "cuda" or config is None or available is None:
        return None  # pinned memory is a CUDA matter; without a config there is no geometry to plan
    try:
        geometry = resolve_geometry(config)
    except ValueError:
        return None  # a config the planner cannot read: nothing to check against
    options = strategy.resolved_options(seq_len, batch_size)
    plan = plan_memory(
        geometry=geometry, seq_len=seq_len, batch_size=batch_size, chunks=options.chunks, offload=options.offload,
        offload_dq=options.offload_dq, num_gpus=strategy.world_size, gpus_per_node=strategy.num_processes,
        sequence_parallel_size=strategy.sequence_parallel_size, ring_size=strategy.ring_size,
        precision=strategy.precision_plugin.precision, cpu_offload_params=strategy.cpu_offload_params,
        head_chunks=strategy.options.head_chunks, gpu_memory_gib=usable_total_bytes(device) / 2**30,
        **declared_plan_flags(strategy.lightning_module.trainer.callbacks),
    )
    try:
        check_host_memory(plan, available)
    except ValueError as refusal:
        return refusal
    return None


def check_memory_plan(strategy: Any, seq_len: int, batch_size: int, *, collective: bool) -> None:
    """Raise :func:`host_memory_refusal`'s error; ``collective``: every rank agrees first and all raise together, so
    none waits in a collective for a rank that raised."""
    refusal = host_memory_refusal(strategy, seq_len, batch_size)
    if collective and not strategy.reduce_boolean_decision(refusal is None, all=True):
        raise refusal or ValueError("another rank refused the run: its host lacks the pinned memory (see its log)")
    if refusal is not None:
        raise refusal
