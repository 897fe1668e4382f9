"""The ballast protocol: run ``L`` layers of a model and hold on each GPU what the layers not run would hold there, so
the peak GPU memory is the full depth's; and the host check, the pinned host memory the full depth would need.

``--layers L --ballast auto`` allocates on each GPU a uint8 tensor the size of the sharded fp32 parameters, gradients
and AdamW moments of the layers not run, plus what each of them would keep on the GPU between its forward and backward
(the baselines' checkpointed block inputs; fpdt's attention chunks when they are not offloaded). Run one length at two
depths to show the peak does not depend on ``L``. ``--check-host`` plans (``lightning_fpdt.planner.plan_memory``) the
pinned host memory of the full depth and compares it with what the host had available when the run started.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from lightning_fpdt.flops import ModelGeometry
from lightning_fpdt.planner import OPTIMIZER_STATES, PRECISIONS, attention_geometry, parameter_counts, plan_memory
from lightning_fpdt.sequence.planning import stash_bytes

ON_OFF_AUTO = {"on": True, "off": False, "auto": "auto"}
"""The fpdt systems' ``--offload`` and ``--offload-dq`` choices as ``FPDTStrategy`` and the planner take them."""

GIB = 2**30


def full_depth(model: str) -> int:
    from bench.peers.hf_llama import named_depth  # transformers is imported only where a model is built

    return named_depth(model)


def layers_run(args: argparse.Namespace) -> int:
    return args.layers if args.layers is not None else full_depth(args.model)


def sequence_parallel_option(args: argparse.Namespace) -> Any:
    """The fpdt systems' ``--sequence-parallel-size``: ``"auto"`` or the GPUs that share one sequence."""
    return getattr(args, "sequence_parallel_size", "auto")


def ring_size_option(args: argparse.Namespace) -> Any:
    """The fpdt systems' ``--ring-size``: ``"auto"`` or the ring ranks of one sequence's group."""
    return getattr(args, "ring_size", "auto")


def count_option(args: argparse.Namespace, name: str) -> Any:
    """``ActivationOffload``'s ``keep_inputs`` or ``checkpoint_blocks`` of ``--keep-inputs`` or
    ``--checkpoint-blocks``: ``"all"``, ``"auto"`` or a count; ``"auto"`` for ``"all"`` under ``--auto-options`` (a
    count given stays)."""
    value = getattr(args, name, "all")
    if getattr(args, "auto_options", False) and value == "all":
        return "auto"
    return value if value in ("all", "auto") else int(value)


def state_bytes_per_parameter(precision: str, optimizer: str = "adamw") -> int:
    """Bytes of master weight, gradient and optimizer moments per parameter (16 for bf16-mixed AdamW)."""
    dtypes = PRECISIONS[precision]
    return dtypes["master"] + dtypes["grad"] + OPTIMIZER_STATES[optimizer] * dtypes["master"]


def kept_bytes_per_layer(system: str, geometry: ModelGeometry, *, seq_len: int, num_gpus: int, precision: str,
                         attention_offload: bool, recompute_attention: bool = False,
                         sequence_parallel_size: Any = "auto") -> int:
    """GPU bytes one block keeps from its forward to its backward (batch 1): what the ballast must also stand in for,
    for each block not run.

    ``modelparallel``: its checkpointed input, ``S·h·b`` (every GPU holds the whole sequence); ``ring``: the same for
    its ``S/W`` tokens; ``alst``: nothing (its checkpointed inputs wait in host memory); ``fpdt``, ``fpdt-hf``:
    nothing when the attention offloads (ActivationOffload keeps the block inputs in host memory, the attention its
    chunks), else the layer's attention chunks (``planning.stash_bytes``) and its output kept for the recompute,
    ``S/P·H·D·b``, as ``lightning_fpdt.planner`` counts them (``P``: ``sequence_parallel_size``, all GPUs of one node
    when ``"auto"``); nothing either when the recompute runs the attention again (only the layer in backward holds
    chunks)."""
    act = PRECISIONS[precision]["act"]
    if system == "modelparallel":
        return seq_len * geometry.hidden_size * act
    if system == "ring":
        return seq_len // num_gpus * geometry.hidden_size * act
    if system == "alst":
        return 0
    if attention_offload or recompute_attention:
        return 0
    attention = attention_geometry(geometry, act)
    sp = num_gpus if sequence_parallel_size == "auto" else sequence_parallel_size
    kept_out = seq_len // sp * geometry.num_heads * geometry.head_dim * act
    return stash_bytes(attention, batch_size=1, seq_len=seq_len, sp_size=sp) + kept_out


def ballast_bytes(
    geometry: ModelGeometry, *, layers_run: int, num_gpus: int, precision: str, cpu_offload_params: bool,
    kept_per_layer: int = 0, optimizer: str = "adamw", offloaded_gpu_bytes_per_parameter: int = 0,
) -> int:
    """What the ``geometry.num_layers - layers_run`` blocks not run would hold on each GPU: their parameters,
    gradients and optimizer moments, sharded over all ``num_gpus`` (with ``cpu_offload_params`` only
    ``offloaded_gpu_bytes_per_parameter``: none when everything lives in host memory, the compute-dtype parameter
    shard where only the optimizer is offloaded), and what each keeps between its forward and backward
    (:func:`kept_bytes_per_layer`).

    The rest of a step's memory does not depend on the depth: the gathered weights of the current and the prefetched
    block, the root unit, the working set of the block computing, the loss."""
    block, _rest = parameter_counts(geometry)
    missing = geometry.num_layers - layers_run
    per_parameter = offloaded_gpu_bytes_per_parameter if cpu_offload_params else state_bytes_per_parameter(
        precision, optimizer)
    states = missing * block * per_parameter // num_gpus
    return states + missing * kept_per_layer


def offloaded_gpu_bytes_per_parameter(args: argparse.Namespace, world_size: int) -> int:
    """GPU bytes per parameter that ``--cpu-offload-params`` leaves on the GPUs (before sharding): none under FSDP2's
    ``CPUOffloadPolicy`` and under ``alst`` on one GPU (ZeRO ``offload_param``); ``alst`` on several GPUs offloads
    only the optimizer, and ZeRO-3 keeps the compute-dtype parameter shard on the GPU."""
    if args.system != "alst" or world_size == 1:
        return 0
    return PRECISIONS[args.precision]["act"]


def run_ballast(args: argparse.Namespace, geometry: ModelGeometry, world_size: int) -> tuple[int, int]:
    """``(ballast bytes, of which the states of the layers not run)`` on each GPU by the formula above (both 0 without
    ``--ballast``; ``--ballast full`` holds the planner's figure on fpdt, bench/peers/full_depth.py)."""
    if args.ballast == "none":
        return 0, 0
    kept = kept_bytes_per_layer(args.system, geometry, seq_len=args.seq_len, num_gpus=world_size,
                                precision=args.precision, attention_offload=args.offload == "on",
                                recompute_attention=args.system in ("fpdt", "fpdt-hf") and args.recompute_attention,
                                sequence_parallel_size=sequence_parallel_option(args))
    common = dict(layers_run=layers_run(args), num_gpus=world_size, precision=args.precision,
                  cpu_offload_params=args.cpu_offload_params,
                  offloaded_gpu_bytes_per_parameter=offloaded_gpu_bytes_per_parameter(args, world_size))
    return ballast_bytes(geometry, kept_per_layer=kept, **common), ballast_bytes(geometry, **common)


def host_check(
    args: argparse.Namespace, *, num_gpus: int, gpus_per_node: int, resolved: dict[str, Any],
    gpu_memory_bytes: Optional[int], available_bytes: Optional[int],
) -> dict[str, Any]:
    """The planner's host memory per host for the *full* depth (pinned ``needed_bytes``; ``resident_bytes`` with the
    pageable states and the processes, what ``fits`` sets against the host), beside what the host had when the run
    began.

    Only ``fpdt`` pins activations and attention chunks; the baselines pin host memory only for CPU-offloaded states.
    ``planned_peak_gpu_bytes`` (fpdt only) is the planner's GPU peak of the full depth, to set beside the measured one.
    """
    fpdt = args.system in ("fpdt", "fpdt-hf")
    alst = args.system == "alst"  # block inputs in host memory, tiled MLP and loss, Ulysses over every GPU
    offload = ON_OFF_AUTO[args.offload]
    from bench.peers.hf_llama import named_geometry  # a Hugging Face geometry's name is not a planner size

    plan = plan_memory(
        geometry=named_geometry(args.model), seq_len=args.seq_len, num_gpus=num_gpus, gpus_per_node=gpus_per_node,
        sequence_parallel_size=resolved.get("sequence_parallel_size", sequence_parallel_option(args)) if fpdt
        else num_gpus if alst else 1,
        ring_size=resolved.get("ring_size", ring_size_option(args)) if fpdt else 1,
        chunks=resolved.get("chunks", args.chunks) if fpdt else 1,
        offload=resolved.get("offload", offload) if fpdt else False,
        offload_dq=resolved.get("offload_dq", "auto") if fpdt else False,
        activation_offload=fpdt or alst, activation_checkpointing=True, tiled_mlp=fpdt or alst,
        tiled_loss=fpdt or alst,
        precision=args.precision, cpu_offload_params=args.cpu_offload_params,
        gpu_memory_gib=(gpu_memory_bytes or 80 * GIB) / GIB,
        host_memory_gib=None if available_bytes is None else available_bytes / GIB,
        recompute_attention=fpdt and args.recompute_attention, head_chunks=args.head_chunks if fpdt else 1,
        reload_input=fpdt and args.reload_input, prefetch=args.prefetch if fpdt else 1,
    )
    return {
        "layers": plan.geometry.num_layers,
        "needed_bytes": plan.host_bytes_per_node,
        "resident_bytes": plan.host_resident_bytes_per_node,
        "available_bytes": available_bytes,
        "fits": None if available_bytes is None else plan.fits_host,
        "planned_peak_gpu_bytes": plan.peak_gpu_bytes if fpdt else None,
    }
