"""What to change when a plan does not fit: the search of the planner's recommendation."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

from lightning_fpdt.planner.components import MemoryPlan, build_plan
from lightning_fpdt.planner.host import gib
from lightning_fpdt.planner.options import free_for_auto, planned_attention
from lightning_fpdt.sequence.options import FPDTOptions

MIN_CHUNK_TOKENS = 8192
"""The search doubles chunks down to this many global tokens per chunk, not further (a choice: smaller attention
blocks were not measured; the benchmarks use 32K and 64K)."""

SEARCH_ORDER = ("tiled_loss", "tiled_mlp", "activation_offload", "offload", "reload_input", "input_prefetch", "chunks",
                "cpu_offload_params")
"""What the recommendation turns on, one after the other, until the run fits (``input_prefetch``: turned off,
``ActivationOffload(prefetch=0)``). The block-input options come before more chunks: they cost one host-to-device
copy of a block input per block, which long sequences do not notice, where smaller chunks slow every attention
call."""


def recommend(plan: MemoryPlan, offload_dq: Union[str, bool]) -> tuple[Optional[MemoryPlan], str]:
    """Turn on, in :data:`SEARCH_ORDER`, what lowers GPU memory until the plan fits, then undo the changes the fit
    does not need; when only host memory binds, bring things back to the GPU instead (CPU-offloaded states, block
    inputs, attention chunks) while the GPU has room."""
    kwargs = dict(seq_len=plan.seq_len, batch_size=plan.batch_size, num_gpus=plan.num_gpus,
                  gpus_per_node=plan.gpus_per_node, gpu_memory_bytes=plan.gpu_memory_bytes,
                  host_memory_bytes=plan.host_memory_bytes)

    def replan(changes: dict[str, Any]) -> MemoryPlan:
        implied = {"activation_checkpointing": True} if changes.get("activation_offload") else {}
        options = dataclasses.replace(plan.options, **changes, **implied)  # ActivationOffload checkpoints the blocks
        if offload_dq == "auto" and options.ring_size == 1:  # re-resolved: it depends on the attention offload
            free = free_for_auto(plan.geometry, precision=options.precision, num_gpus=plan.num_gpus,
                                 cpu_offload_params=options.cpu_offload_params, gpu_memory_bytes=plan.gpu_memory_bytes)
            attention = FPDTOptions(chunks=options.chunks, offload=options.offload, head_chunks=options.head_chunks)
            resolved = attention.resolve(planned_attention(plan.geometry, options.precision, options.head_chunks),
                                         batch_size=plan.batch_size, seq_len=plan.seq_len,
                                         sp_size=options.sequence_parallel_size, free_bytes=free)
            options = dataclasses.replace(options, offload_dq=resolved.offload_dq)
        return build_plan(plan.geometry, plan.model, options=options, **kwargs)

    def said(changes: dict[str, Any]) -> str:
        return "set " + ", ".join(f"{name}={value}" for name, value in changes.items())

    if plan.fits:
        return None, "the options as given fit"
    changes: dict[str, Any] = {}
    current = plan
    if plan.fits_gpu:  # host memory binds
        # free changes first (room on the GPU), then recomputing the attention (one layer's stash instead of L)
        for name, value in (("cpu_offload_params", False), ("activation_offload", False),
                            ("recompute_attention", True), ("offload", False)):
            if getattr(current.options, name) != value and current.options.activation_checkpointing:
                trial = replan({**changes, name: value})
                if trial.fits_gpu:
                    current, changes = trial, {**changes, name: value}
                    if current.fits:
                        return current, said(changes)
        return None, (
            f"nothing fits the host (even with {said(changes)[4:] if changes else 'the options as given'}: "
            f"{gib(current.host_bytes_per_node)} GiB pinned per host): use more hosts (each GPU holds S/P tokens) "
            f"or a shorter sequence"
        )
    for name in SEARCH_ORDER:
        if name == "chunks" and current.options.ring_size > 1:
            continue  # not composed with the ring yet
        if name == "chunks":
            # more chunks shrink only the attention's working set: stop when that no longer lowers the peak
            chunks = current.options.chunks
            while not current.fits_gpu and plan.seq_len / (2 * chunks) >= max(
                MIN_CHUNK_TOKENS, current.options.sequence_parallel_size
            ):
                trial = replan({**changes, "chunks": 2 * chunks})
                if trial.peak_gpu_bytes >= current.peak_gpu_bytes:
                    break
                current, chunks, changes = trial, 2 * chunks, {**changes, "chunks": 2 * chunks}
        elif name == "input_prefetch":
            if current.options.input_prefetch:
                changes = {**changes, name: False}
                current = replan(changes)
        elif not getattr(current.options, name):
            changes = {**changes, name: True}
            current = replan(changes)
        if current.fits:
            break
    else:
        why = "GPU" if not current.fits_gpu else "host"
        return None, (
            f"nothing in the search fits ({said(changes) if changes else 'everything on'}: still over {why} "
            f"memory): use more GPUs (each holds S/P tokens and 1/W of the states) or a shorter sequence"
        )
    for name in list(changes)[:-1]:  # the last change made it fit; an earlier one may not be needed
        trial = replan({k: v for k, v in changes.items() if k != name})
        if trial.fits:
            current, changes = trial, {k: v for k, v in changes.items() if k != name}
    return current, said(changes)
