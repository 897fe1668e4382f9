"""One run of a system on every rank of the job: the device and the process group, the ballast, the system's steps,
an out-of-memory error turned into a record, and the record every rank agrees on."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import socket
from typing import Any, Optional

import torch
import torch.distributed as dist

from bench.host_readings import largest
from bench.peers.ballast import GIB, host_check, layers_run, run_ballast
from bench.peers.common import device_peaks, host_peaks
from bench.peers.full_depth import FullDepth, FullDepthRefused, HeldBallast, disk_free_bytes, full_depth_ballast
from bench.peers.hf_llama import named_geometry
from bench.peers.records import RankFigures, RunContext, agree_on_status, out_of_memory, run_record, timed
from bench.peers.systems import SYSTEM_FUNCTIONS
from bench.provenance import card_name
from lightning_fpdt.flops import peak_flops
from lightning_fpdt.offload.host_memory import peak_resident_bytes
from lightning_fpdt.planner import available_host_memory
from lightning_fpdt.planner.machine import usable_total_bytes

_RUN_COUNTER = itertools.count()  # names each run's keys in the store; every rank calls run() in the same order


def dist_environment() -> tuple[int, int, int, int]:
    """``(rank, world size, local rank, processes per node)``: from the process group when there is one (Lightning's
    teardown removes ``WORLD_SIZE`` from the environment), else from torchrun's environment (1 process without it)."""
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return rank, world_size, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_device(args: argparse.Namespace, local_rank: int) -> torch.device:
    """This rank's device, capped to ``--gpu-memory-gib`` where given."""
    if args.accelerator != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    if args.gpu_memory_gib is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_gib * GIB / total), device)
    return device


def _init_process_group(args: argparse.Namespace, device: torch.device, world_size: int) -> None:
    """Lightning reuses a process group that exists (one process: Lightning makes its own); ring needs one even on one
    GPU (its mesh, the loss's all-reduce), and so does alst (DeepSpeed wraps it)."""
    if dist.is_initialized() or not (world_size > 1 or args.system in ("ring", "alst")):
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if world_size > 1:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)


def _context(args: argparse.Namespace, device: torch.device, world_size: int, gpus_per_node: int) -> RunContext:
    full_geometry = named_geometry(args.model)
    card = card_name(device)
    cuda = device.type == "cuda"
    usable = usable_total_bytes(device) if cuda else None  # the card's, or the cap
    return RunContext(
        world_size=world_size, gpus_per_node=gpus_per_node, card=card,
        card_memory=torch.cuda.get_device_properties(device).total_memory if cuda else None,
        usable_memory=usable, memory_cap=usable if args.gpu_memory_gib is not None else None,
        full_geometry=full_geometry, geometry_run=dataclasses.replace(full_geometry, num_layers=layers_run(args)),
        peak=peak_flops(card, "bf16" if args.precision.startswith("bf16") else "fp32") if cuda else None,
    )


def _train(args: argparse.Namespace, context: RunContext, device: torch.device, info: dict[str, Any],
           ballast_size: int) -> tuple[str, Optional[str], Optional[str]]:
    """Hold the ballast and run the system: ``(status, limit, error)``; an error that is not a memory limit is
    re-raised."""
    ballast = None
    try:
        ballast = torch.empty(ballast_size, dtype=torch.uint8, device=device) if ballast_size else None
        SYSTEM_FUNCTIONS[args.system](args, device=device, world_size=context.world_size,
                                      gpus_per_node=context.gpus_per_node, info=info, peak=context.peak)
    except Exception as err:  # noqa: BLE001 - only memory errors become records; anything else is re-raised
        limit = out_of_memory(err)
        if limit is None:
            raise
        info["peak_gpu_bytes_at_oom"] = device_peaks(device)[0]
        info["peak_host_rss_bytes_at_oom"] = host_peaks(info).stop()  # the failed step's span, where one was open
        return "oom", limit, f"{type(err).__name__}: {str(err)[:600]}"
    finally:
        del ballast
    return "ok", None, None


def _train_full_depth(args: argparse.Namespace, context: RunContext, device: torch.device, info: dict[str, Any],
                      available_host: Optional[int]) -> tuple[str, Optional[str], Optional[str], tuple[int, int],
                                                               Optional[FullDepth]]:
    """``--ballast full``: plan the full depth on this machine, hold what it keeps for the layers not run (GPU, host,
    disk) while the run trains with the full plan's options, then give it back: ``(status, limit, error, (GPU
    ballast, of which states), the ballast)``. A full depth the machine cannot hold as planned is an out-of-memory
    record (``FullDepthRefused``), with nothing held and no ballast."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        full = full_depth_ballast(args, context.full_geometry, world_size=context.world_size,
                                  gpus_per_node=context.gpus_per_node, gpu_memory_bytes=context.usable_memory,
                                  available_host=available_host, disk_free=disk_free_bytes(args.offload_dir))
    except FullDepthRefused as refused:
        return "oom", refused.limit, f"planned: {refused}", (0, 0), None
    if full.plan is not None:
        args.full_depth_arguments = full.strategy_arguments()
    held = HeldBallast(full, device=device, offload_dir=args.offload_dir, rank=rank)
    args.at_first_batch = held.hold_disk  # the disk's share once the strategy's setup and first-batch checks ran
    try:
        status, limit, error = _train(args, context, device, info, 0)
        if status == "ok" and held.disk_bytes and not held.disk_held:
            raise RuntimeError(f"--ballast full: {args.system} trained without taking the disk ballast's blocks")
    finally:
        held.release()
    return status, limit, error, (full.gpu_bytes, run_ballast(args, context.full_geometry, context.world_size)[1]), full


def _rank_figures(status: str, info: dict[str, Any], world_size: int, profile_step: Optional[int]) -> list[Any]:
    """Every rank's :class:`RankFigures`; only this rank's when a rank failed, as collectives are then unsafe."""
    peaks = [p for p in info.get("peak_gpu_bytes_per_step", []) if p is not None]
    reserved = [p for p in info.get("peak_reserved_bytes_per_step", []) if p is not None]
    host = host_peaks(info)
    mine = RankFigures(
        peak_gpu=max(peaks) if peaks else None, peak_reserved=max(reserved) if reserved else None,
        # since the process started: the larger of what the spans saw and the high-water mark since the last of them
        lifetime_rss=largest([host.lifetime_peak, peak_resident_bytes()]),
        step_rss=largest(timed(info.get("peak_host_rss_bytes_per_step", []), profile_step)),
        rss_reading=host.reading, pinned=info.get("pinned_host_bytes"),
        pinned_caching_allocator=info.get("pinned_host_bytes_caching_allocator"),
    )
    if status != "ok" or world_size == 1:
        return [mine]
    figures: list[Any] = [None] * world_size
    dist.all_gather_object(figures, mine)
    return figures


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train ``args.system`` for ``args.steps`` steps on every rank of this job and return the run's record (the same
    status on every rank). ``args`` as ``cli.validate`` accepts them. Initialises the process group under torchrun;
    reuses one that exists (the tests' pool)."""
    _rank, world_size, local_rank, gpus_per_node = dist_environment()
    device = prepare_device(args, local_rank)
    _init_process_group(args, device, world_size)
    key = f"bench_peers/{args.attempt_id or 'run'}/{next(_RUN_COUNTER)}"
    # --hold-host-gib: a smaller host, held (touched) before anything is planned
    held_host = torch.ones(int(args.hold_host_gib * GIB), dtype=torch.uint8) if args.hold_host_gib else None
    available_host = available_host_memory()  # before this run pins anything
    context = _context(args, device, world_size, gpus_per_node)
    info: dict[str, Any] = {}
    if args.ballast == "full":
        status, limit, error, ballast, full = _train_full_depth(args, context, device, info, available_host)
    else:
        ballast, full = run_ballast(args, context.full_geometry, world_size), None
        status, limit, error = _train(args, context, device, info, ballast[0])
    status, answered = agree_on_status(status, key=key, timeout_s=args.agree_timeout_s)
    record = run_record(args, context, info, status=status, limit=limit, error=error, answered=answered,
                        rank_figures=_rank_figures(status, info, world_size, args.profile_step), ballast=ballast)
    del held_host
    record["held_host_bytes"] = int(args.hold_host_gib * GIB)
    if full is not None:
        record["full_depth"] = full.record(record.get("step_time_s"))
    if args.check_host:
        record["host_check"] = host_check(args, num_gpus=world_size, gpus_per_node=gpus_per_node, resolved=info,
                                          gpu_memory_bytes=context.usable_memory, available_bytes=available_host)
    return record
