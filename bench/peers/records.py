"""The JSON record of a run: its figures, its provenance, reading it back, and the ranks' agreement on its status
(``bench.provenance.append_record`` writes it).

Figures: step times are the median of the steps after the first (a warm-up); FLOPs in the causal convention
(``lightning_fpdt.flops.flops_per_token`` of the layers run), MFU against ``lightning_fpdt.flops.peak_flops`` of the
card (bf16). Peak GPU memory is ``torch.cuda.max_memory_allocated`` within a step, ballast included, the largest over
steps and ranks. Host memory (:func:`host_figures`): each process's peak resident memory within the timed steps and
the pinned bytes it holds, the largest over the ranks, and per host the sum over its ranks; for the fpdt systems also
the plan the strategy accepted the run on. A CUDA out-of-memory error, or a host that cannot give the memory a run
needs, ends the run with a record of status ``"oom"``: the ranks agree on the status through the job's key-value
store (not NCCL: a rank that ran out of memory has left the collective the others wait in).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist

from bench.host_readings import PLAN_FIELDS, largest
from bench.provenance import launch_command, stamp
from lightning_fpdt.flops import ModelGeometry, flops_per_token
from lightning_fpdt.offload.host_memory import HostMemoryError

GIB = 2**30
MODULE = "-m bench.peers"
MULTICAST_OFF = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
"""Environment variables that turn NVLink multicast off; recorded with every run, as they change what NCCL does."""


# ---- out of memory: what it is, and agreeing on it ----------------------------------------------------------------
HOST_REFUSALS = ("pinned host memory", "GiB of host memory per host", "its host lacks the pinned memory")
"""Words of the fpdt strategy's refusal of a run whose host memory does not fit (``check_memory_plan``), old and
new wording, and of a rank told that another rank refused."""


def out_of_memory(error: BaseException) -> Optional[str]:
    """``"gpu"`` or ``"host"`` when ``error`` reports a memory limit, else ``None`` (the error is a bug: re-raise)."""
    text = str(error)
    if isinstance(error, torch.OutOfMemoryError):
        return "gpu"
    if isinstance(error, HostMemoryError):
        return "host"  # the library's host buffers: its guard refused one, or the host could not page-lock it
    if isinstance(error, ValueError) and any(words in text for words in HOST_REFUSALS):
        return "host"  # FPDTStrategy.check_memory_plan refuses a run whose host memory exceeds the host's
    if isinstance(error, RuntimeError) and ("out of memory" in text.lower() or "ALLOC_FAILED" in text):
        return "gpu"  # cuBLAS / cuDNN workspaces and NCCL buffers report it as a RuntimeError
    return None


def agree_on_status(status: str, *, key: str, timeout_s: float) -> tuple[str, list[int]]:
    """Post this rank's ``status`` ("ok" / "oom") in the job's store and read the others': the run is "oom" if any
    rank ran out of memory. Returns ``(status, ranks that posted)``.

    The store, not NCCL: when one rank runs out of memory the others may be left waiting in a collective it will never
    join; they never post, and after ``timeout_s`` the ranks that did answer without them."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return status, [0]
    store = dist.distributed_c10d._get_default_store()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    store.set(f"{key}/{rank}", status)
    posted: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        for other in range(world_size):
            if other not in posted and store.check([f"{key}/{other}"]):
                posted[other] = store.get(f"{key}/{other}").decode()
        if len(posted) == world_size or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    agreed = "ok" if len(posted) == world_size and all(s == "ok" for s in posted.values()) else "oom"
    return agreed, sorted(posted)


# ---- the record's fields -------------------------------------------------------------------------------------------
def command_line(argv: list[str], gpus_per_node: int, world_size: int) -> str:
    """The command that reproduces this run (run from the repository root), without the search's ``--attempt-id``."""
    return launch_command(MODULE, without_attempt_id(argv), gpus_per_node=gpus_per_node, world_size=world_size,
                          under_torchrun="LOCAL_WORLD_SIZE" in os.environ)


def without_attempt_id(argv: list[str]) -> list[str]:
    """The command line as a person would type it: the search's internal ``--attempt-id`` left out."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--attempt-id":
            skip = True
        elif not arg.startswith("--attempt-id="):
            out.append(arg)
    return out


def timed(per_step: list[Any], profile_step: Optional[int] = None) -> list[Any]:
    """The entries of ``per_step`` (one per step) of the timed steps: those after the first (a warm-up) but the
    profiled one (the profiler slows the step it records and holds memory of its own); where that leaves none, the
    steps after the first, else all (a run of one step)."""
    after_warm_up = [v for i, v in enumerate(per_step) if i > 0 and i != profile_step]
    return after_warm_up or per_step[1:] or per_step


def summarize(info: dict[str, Any], *, geometry_run: ModelGeometry, seq_len: int, world_size: int,
              peak: Optional[float], profile_step: Optional[int] = None) -> dict[str, Any]:
    """Median step time (of the steps after the first, when there are any, and not the profiled one: the profiler
    slows the step it records, more so the more kernels a step launches), tokens/s, TFLOP/s per GPU, MFU."""
    times = [t for t in info.get("step_times_s", []) if t is not None]
    if not times:
        return dict(step_time_s=None, timed_steps=0, tokens_per_s=None, tflops_per_gpu=None, mfu=None)
    chosen = timed(times, profile_step)
    step_time = statistics.median(chosen)
    tokens = info["tokens_per_step"]
    flops = tokens * flops_per_token(geometry_run, seq_len, "causal")
    tflops = flops / step_time / world_size / 1e12
    return dict(
        step_time_s=step_time, timed_steps=len(chosen) if len(times) > 1 else 0,
        tokens_per_s=tokens / step_time, tflops_per_gpu=tflops, mfu=None if peak is None else tflops * 1e12 / peak,
    )


def options(args: argparse.Namespace, info: dict[str, Any]) -> dict[str, Any]:
    """The options that shape what a system does, as it resolved them."""
    common = {"precision": args.precision, "cpu_offload_params": args.cpu_offload_params,
              "attention_backend": args.attention_backend, "ballast": args.ballast}
    if args.system in ("fpdt", "fpdt-hf"):
        return {**common, "offload": info.get("offload", args.offload), "offload_dq": info.get("offload_dq"),
                "sequence_parallel_size": getattr(args, "sequence_parallel_size", "auto"),
                "ring_size": getattr(args, "ring_size", "auto"),
                "callbacks": ["ActivationOffload", "TiledMLP", "TiledLoss", "MFUMonitor"],
                "recompute_attention": args.recompute_attention, "head_chunks": args.head_chunks,
                "reload_input": args.reload_input, "prefetch": args.prefetch,
                "keep_inputs": getattr(args, "keep_inputs", "all"),
                "checkpoint_blocks": getattr(args, "checkpoint_blocks", "all"),
                "auto_options": getattr(args, "auto_options", False),
                "offload_dir": getattr(args, "offload_dir", None) is not None,
                **({"full_depth_arguments": args.full_depth_arguments}
                   if hasattr(args, "full_depth_arguments") else {}),
                "host_step": ("after backward" if args.host_step_after_backward else "in backward")
                if args.cpu_offload_params else None,
                **({"device_step": "after backward"} if getattr(args, "device_step_after_backward", False) else {}),
                **({"plan_trial": True} if getattr(args, "plan_trial", False) else {}),
                "model_code": "transformers" if args.system == "fpdt-hf" else "lightning_fpdt"}
    if args.system == "alst":
        return {**common, "model_code": "transformers", "zero_stage": 3, "sequence_parallel": "ulysses",
                "core_attention": "sdpa", "tiled_mlp": True, "loss": "TiledFusedLogitsLoss",
                "activation_checkpointing": "non-reentrant, inputs offloaded to host",
                "offload_optimizer": args.cpu_offload_params, "offload_param": info.get("offload_param", False),
                "optimizer": info.get("optimizer"), "gradient_reduction": info.get("gradient_reduction")}
    baseline = {**common, "activation_checkpointing": "checkpoint_wrapper (non-reentrant)", "loss": "untiled"}
    if args.system == "ring":
        baseline.update(rotate_method=args.rotate_method, kv_heads=args.ring_kv_heads, load_balance="head-tail")
    return baseline


@dataclasses.dataclass
class RankFigures:
    """One rank's memory figures, gathered from every rank for the record (bytes; ``None`` where unknown)."""

    peak_gpu: Optional[int]
    """``torch.cuda.max_memory_allocated`` within a step, the largest over the steps."""
    peak_reserved: Optional[int]
    lifetime_rss: Optional[int]
    """The process's peak resident memory since it started (model construction included)."""
    step_rss: Optional[int]
    """The process's peak resident memory within the timed steps (:func:`timed`)."""
    rss_reading: Optional[str]
    """How ``step_rss`` was read: ``"peak"`` or ``"sampled"`` (bench/host_readings.py)."""
    pinned: Optional[int]
    """Pinned host bytes at the end of the last step (``bench.host_readings.pinned_bytes``)."""
    pinned_caching_allocator: Optional[int]
    """The part of ``pinned`` in PyTorch's caching host allocator."""


def _all_known(values: list[Any]) -> bool:
    return bool(values) and all(v is not None for v in values)


def host_figures(rank_figures: list[RankFigures], *, world_size: int, gpus_per_node: int) -> dict[str, Any]:
    """The host memory of a run from every rank's figures.

    Per process, as the planner's ``_per_gpu`` figures count it: ``peak_host_rss_bytes`` is the largest over the
    ranks of each process's peak resident memory within the timed steps, and ``pinned_host_bytes`` the largest over
    the ranks of the pinned bytes each held at the end of its last step (``None`` if a rank could not say), with
    ``pinned_host_bytes_caching_allocator`` the largest share of them in PyTorch's caching host allocator. Per host,
    as ``_per_node`` counts it: ``peak_host_rss_bytes_per_node`` is the largest over the hosts of the sum of their
    ranks' peaks (ranks ``n·G ... n·G + G - 1`` on host ``n`` of ``G`` GPUs; the ranks' peaks need not coincide, so
    an upper bound of what the host's processes held at once), ``None`` where not every rank answered. The per-rank
    lists keep each rank's figure. ``host_peak_rss_bytes`` (records before these fields) sums over the ranks each
    process's peak since it started, model construction included."""
    step_rss = [f.step_rss for f in rank_figures]
    lifetime = [f.lifetime_rss for f in rank_figures]
    pinned = [f.pinned for f in rank_figures]
    readings = {f.rss_reading for f in rank_figures if f.step_rss is not None}
    per_node = None
    if len(rank_figures) == world_size and _all_known(step_rss):
        per_node = max(sum(step_rss[start:start + gpus_per_node]) for start in range(0, world_size, gpus_per_node))
    return {
        "peak_host_rss_bytes": largest(step_rss), "peak_host_rss_bytes_per_rank": step_rss,
        "peak_host_rss_bytes_per_node": per_node,
        "host_rss_reading": None if not readings else "peak" if readings == {"peak"} else "sampled",
        "pinned_host_bytes": max(pinned) if _all_known(pinned) else None, "pinned_host_bytes_per_rank": pinned,
        "pinned_host_bytes_caching_allocator": largest(f.pinned_caching_allocator for f in rank_figures),
        "host_peak_rss_bytes": sum(lifetime) if _all_known(lifetime) else None,
    }


def memory_figures(info: dict[str, Any], rank_figures: list[RankFigures], ballast: tuple[int, int], *,
                   world_size: int, gpus_per_node: int) -> dict[str, Any]:
    """Peak GPU memory over steps and ranks and the ballast in it; the host's memory (:func:`host_figures`)."""
    peak_per_rank = [f.peak_gpu for f in rank_figures]
    peak_gpu = max(peak_per_rank) if all(p is not None for p in peak_per_rank) else None
    nbytes, state_bytes = ballast
    return {
        "peak_gpu_bytes": peak_gpu, "peak_gpu_bytes_per_rank": peak_per_rank,
        "peak_reserved_bytes": largest(f.peak_reserved for f in rank_figures),
        "peak_gpu_bytes_at_oom": info.get("peak_gpu_bytes_at_oom"),
        "ballast_bytes": nbytes, "ballast_state_bytes": state_bytes, "ballast_activation_bytes": nbytes - state_bytes,
        "peak_gpu_bytes_minus_ballast": None if peak_gpu is None else peak_gpu - nbytes,
        **host_figures(rank_figures, world_size=world_size, gpus_per_node=gpus_per_node),
        "peak_host_rss_bytes_at_oom": info.get("peak_host_rss_bytes_at_oom"),
    }


@dataclasses.dataclass
class RunContext:
    """Where a run ran and what its job looked like: the record's provenance and its divisor for per-GPU figures."""

    world_size: int
    gpus_per_node: int
    card: str
    card_memory: Optional[int]
    usable_memory: Optional[int]  # the card's, or the cap: what the fpdt planner plans with
    memory_cap: Optional[int]
    full_geometry: ModelGeometry
    geometry_run: ModelGeometry
    peak: Optional[float]


def run_record(args: argparse.Namespace, context: RunContext, info: dict[str, Any], *, status: str,
               limit: Optional[str], error: Optional[str], answered: list[int], rank_figures: list[RankFigures],
               ballast: tuple[int, int]) -> dict[str, Any]:
    """The record of one run, the same on every rank that answered (the host check is added by the caller)."""
    command = command_line(args.argv, context.gpus_per_node, context.world_size)
    provenance = stamp("run", card=context.card, gpus=context.world_size, command=command)
    geometry_run = context.geometry_run
    return {
        "kind": "run", "system": args.system, "status": status, "limit": limit, "error": error,
        "card": context.card, "card_memory_bytes": context.card_memory, "gpu_memory_cap_bytes": context.memory_cap,
        "gpus": context.world_size, "gpus_per_node": context.gpus_per_node,
        "model": args.model, "geometry": dataclasses.asdict(context.full_geometry), "layers": geometry_run.num_layers,
        "full_layers": context.full_geometry.num_layers, "seq_len": args.seq_len, "batch_size": 1,
        "chunks": info.get("chunks"), "sequence_parallel_size": info.get("sequence_parallel_size"),
        "data_parallel_size": info.get("data_parallel_size"), "options": options(args, info),
        "steps": args.steps, "steps_done": len(info.get("step_times_s", [])),
        "step_times_s": info.get("step_times_s", []), "tokens_per_step": info.get("tokens_per_step"),
        **summarize(info, geometry_run=geometry_run, seq_len=args.seq_len, world_size=context.world_size,
                    peak=context.peak, profile_step=args.profile_step),
        "profile_step": args.profile_step,
        "flop_convention": "causal", "flops_per_token": flops_per_token(geometry_run, args.seq_len, "causal"),
        "peak_flops": context.peak,
        "losses": info.get("losses", []), "first_loss": (info.get("losses") or [None])[0],
        "profile": info.get("profile"),
        **memory_figures(info, rank_figures, ballast, world_size=context.world_size,
                         gpus_per_node=context.gpus_per_node),
        # the plan the fpdt strategy accepted the run on, for the layers run (the ballast is not in it)
        **{name: info.get(name) for name in PLAN_FIELDS},
        "host_check": None, "ranks_answered": answered, "attempt": args.attempt_id,
        "command": command, "commit": provenance["commit"],
        "env": {name: os.environ[name] for name in (*MULTICAST_OFF, "CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF")
                if name in os.environ},
        "torch": provenance["torch"], "lightning": L.__version__, "time": provenance["time"],
    }


# ---- reading ---------------------------------------------------------------------------------------------------------
def read_attempt(path: str, attempt_id: str) -> Optional[dict[str, Any]]:
    """The last run record of ``path`` written by the search's attempt ``attempt_id`` (``None`` if it wrote none)."""
    if not os.path.exists(path):
        return None
    found = None
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("kind") == "run" and record.get("attempt") == attempt_id:
                found = record
    return found


def print_record(record: dict[str, Any]) -> None:
    def gib(value: Optional[int]) -> str:
        return "-" if value is None else f"{value / GIB:.1f}"

    mfu = record.get("mfu")
    print(f"RESULT system={record['system']} status={record['status']} card={record['card']!r} gpus={record['gpus']} "
          f"layers={record['layers']}/{record['full_layers']} S={record['seq_len']} chunks={record['chunks']} "
          f"step_s={record['step_time_s'] and round(record['step_time_s'], 3)} "
          f"tokens_per_s={record['tokens_per_s'] and round(record['tokens_per_s'])} "
          f"tflops_per_gpu={record['tflops_per_gpu'] and round(record['tflops_per_gpu'], 1)} "
          f"mfu={'-' if mfu is None else f'{100 * mfu:.1f}%'} peak_gib={gib(record['peak_gpu_bytes'])} "
          f"ballast_gib={gib(record['ballast_bytes'])} host_rss_gib={gib(record.get('peak_host_rss_bytes'))} "
          f"pinned_gib={gib(record.get('pinned_host_bytes'))} first_loss={record['first_loss']}", flush=True)
