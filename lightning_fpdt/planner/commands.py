"""``lightning-fpdt plan``: print the memory plan of a long-context run; ``lightning-fpdt calibrate``: measure this
GPU's rates for the step-time model (docs/planner.md).

    lightning-fpdt plan --model llama3-8b --seq-len 1048576 --gpus 8 --callbacks all
    python -m lightning_fpdt.planner --model path/to/config.json --seq-len 524288 --gpus 4 --host-memory-gib 1000
    lightning-fpdt calibrate --model llama3-3b --seq-len 65536 131072
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Optional, Union

import torch

from lightning_fpdt.models.llama import NAMED_CONFIGS
from lightning_fpdt.planner.arguments import python_arguments, yaml_arguments
from lightning_fpdt.planner.calibration import Calibration, cached_rates, current_key, needed_shapes
from lightning_fpdt.planner.components import GIB, MemoryPlan, expandable_segments, plannable_gpu_bytes
from lightning_fpdt.planner.features import FEATURES
from lightning_fpdt.planner.features.base import auto_or_int
from lightning_fpdt.planner.features.disk_tier import DISK_GBPS
from lightning_fpdt.planner.geometry import OPTIMIZER_STATES, PRECISIONS, resolve_geometry
from lightning_fpdt.planner.host import gib
from lightning_fpdt.planner.layout_summary import describe_layout
from lightning_fpdt.planner.machine import machine_limits
from lightning_fpdt.planner.measure import all_to_all_bytes, clock_for
from lightning_fpdt.planner.plan import plan_memory, timed_sizes
from lightning_fpdt.planner.rates import INTER_HOST_BYTES
from lightning_fpdt.planner.request import PlanRequest
from lightning_fpdt.planner.search import batch_tokens, seconds_per_million_tokens, step_estimate

CALLBACK_NAMES = ("mlp", "loss", "offload", "checkpoint")


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a table (component, phase, GPU GiB, pinned and pageable host GiB, and disk GiB when the plan has a
    disk tier), the peaks, the binding limit, the recommendation and the options as a user writes them."""
    o = plan.options
    disk = plan.disk_memory_bytes is not None or plan.disk_bytes_per_node > 0
    width = 93 + 10 * disk
    lines = [
        f"memory plan: {plan.model}, S = {plan.seq_len:,} tokens"
        + (f" (padded to {plan.padded_seq_len:,})" if plan.padded_seq_len != plan.seq_len else "")
        + f", batch {plan.batch_size}, {plan.num_gpus} GPU(s), {plan.gpus_per_node} per host",
        f"  {plan.local_tokens:,} tokens per GPU, "
        + (f"{plan.padded_seq_len // o.ring_size:,} tokens per ring share; " if o.ring_size > 1 else
           f"{plan.padded_seq_len // o.chunks:,} global tokens per chunk; ")
        + f"{plan.geometry.num_layers} layers",
        f"  options: {o.describe()}",
        "",
        f"  {'component':<42} {'phase':<20} {'GPU GiB':>9} {'pinned':>9} {'pageable':>9}"
        + (f" {'disk':>9}" if disk else ""),
    ]
    for c in plan.components:
        lines.append(f"  {c.name:<42} {c.phase or 'persistent':<20} {gib(c.gpu_bytes):>9} {gib(c.host_bytes):>9} "
                     f"{gib(c.pageable_bytes):>9}" + (f" {gib(c.disk_bytes):>9}" if disk else ""))
    lines.append("  " + "-" * width)
    phases = plan.phase_bytes
    lines.append(f"  {'persistent':<63} {gib(plan.persistent_gpu_bytes):>9}")
    lines.append(f"  {'largest transient phase: ' + plan.peak_phase:<63} {gib(phases[plan.peak_phase]):>9}")
    lines.append(f"  {'predicted peak per GPU':<63} {gib(plan.peak_gpu_bytes):>9}   "
                 f"of {plan.gpu_memory_bytes / GIB:.1f} GiB")
    host_limit = "not checked" if plan.host_memory_bytes is None else f"of {plan.host_memory_bytes / GIB:.1f} GiB"
    lines.append(f"  {'host memory per host (' + str(plan.gpus_per_node) + ' GPUs), pinned':<63} {'':>9} "
                 f"{gib(plan.host_bytes_per_node):>9}")
    lines.append(f"  {'host memory per host, all resident':<63} {'':>9} {'':>9} "
                 f"{gib(plan.host_resident_bytes_per_node):>9}   {host_limit}")
    if disk:
        disk_limit = "no disk tier" if plan.disk_memory_bytes is None else f"of {plan.disk_memory_bytes / GIB:.1f} GiB"
        lines.append(f"  {'disk per host (offload_dir)':<63} {'':>9} {'':>9} {'':>9} "
                     f"{gib(plan.disk_bytes_per_node):>9}   {disk_limit}")
    largest = plan.largest_component
    where = {"host memory": largest.host_bytes + largest.pageable_bytes,
             "disk space": largest.disk_bytes}.get(plan.binding_limit, largest.gpu_bytes)
    verdict = plan.binding_limit
    if verdict == "fits" and plan.host_memory_bytes is None and plan.host_bytes_per_node:
        verdict = (f"fits the GPU memory; the host's not checked ({gib(plan.host_resident_bytes_per_node)} GiB per "
                   f"host, {gib(plan.host_bytes_per_node)} GiB pinned: pass --host-memory-gib N, or auto for this "
                   f"machine)")
    lines += ["", f"binding limit: {verdict} (largest component: {largest.name}, {gib(where)} GiB)"]
    lines.append(f"recommendation: {plan.recommendation}")
    chosen = plan if plan.recommended is None else plan.recommended
    if plan.recommended is not None:
        r = plan.recommended
        lines.append(f"  -> {r.options.describe()}")
        lines.append(f"  -> predicted peak {gib(r.peak_gpu_bytes)} GiB per GPU, host "
                     f"{gib(r.host_resident_bytes_per_node)} "
                     f"GiB per host ({gib(r.host_bytes_per_node)} pinned)"
                     + (f", {gib(r.disk_bytes_per_node)} GiB per host on disk" if r.disk_bytes_per_node else ""))
    lines.append(describe_layout(chosen))
    if chosen.fits:
        estimate = step_estimate(chosen)
        total = sum(seconds for _, seconds in estimate)
        accumulate = chosen.options.accumulate_grad_batches
        lines += ["", f"step time by the cost model, {'recommended' if chosen is not plan else 'these'} options: "
                      f"{total:,.1f} s per batch of {batch_tokens(chosen):,} tokens"
                      + (f" ({accumulate * total:,.1f} s per optimizer step of {accumulate} batches)"
                         if accumulate > 1 else "")
                      + f", {seconds_per_million_tokens(chosen):,.1f} s per million tokens",
                  f"  (rates: {chosen.rates.source}: "
                  + ("a prediction of the step on that GPU)" if chosen.rates.calibrated else
                     "not measured on the run's GPU: the figures rank configurations, they do not predict a run's "
                     "time; `lightning-fpdt calibrate` measures a GPU)")]
        lines += [f"  {what:<90} {seconds:>9,.1f} s" for what, seconds in estimate]
        lines += ["", "as arguments:", *("  " + line for line in python_arguments(chosen).splitlines()),
                  "as YAML:", *("  " + line for line in yaml_arguments(chosen).splitlines())]
    lines.append("(a model, not a measurement; the GPU it fills is the card less the CUDA context and the allocator's "
                 "fragmentation: see docs/planner.md)")
    return "\n".join(lines)


# ---- command line ----------------------------------------------------------------------------------------------------
def _host_memory(value: str) -> Union[str, float]:
    return value if value == "auto" else float(value)


def _callbacks(value: str) -> set[str]:
    if value == "all":
        return {"mlp", "loss", "offload"}
    if value == "none":
        return set()
    chosen = {name.strip() for name in value.split(",") if name.strip()}
    unknown = chosen - set(CALLBACK_NAMES)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown callbacks {sorted(unknown)}: use all, none or a comma list of {', '.join(CALLBACK_NAMES)}"
        )
    return chosen


def main(argv: Optional[list[str]] = None) -> int:
    """``lightning-fpdt plan``: print the memory plan. Exit status 0 if it fits, 1 if not, 2 for a bad option."""
    parser = argparse.ArgumentParser(
        prog="lightning-fpdt plan", description="Predict the GPU and host memory of a long-context fpdt run.",
    )
    parser.add_argument("--model", default="llama3-8b",
                        help=f"a named size ({', '.join(NAMED_CONFIGS)}) or a Hugging Face config.json")
    parser.add_argument("--layers", type=int, default=None, help="override the number of layers")
    parser.add_argument("--seq-len", type=int, required=True, help="global tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per data-parallel group")
    parser.add_argument("--gpus", type=int, default=1, help="all GPUs of the run")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per host (default: all)")
    parser.add_argument("--sp", type=auto_or_int, default="auto", help="sequence_parallel_size")
    parser.add_argument("--ring-size", type=auto_or_int, default="auto",
                        help="ring ranks R of the sequence mesh (sp = ulysses x R; auto: the smallest the heads need, "
                             "or for an sp spanning hosts the fastest layout that fits)")
    parser.add_argument("--callbacks", type=_callbacks, default=_callbacks("all"),
                        help="all, none, or a comma list of mlp, loss, offload, checkpoint (checkpointing on the GPU)")
    parser.add_argument("--precision", default="bf16-mixed", choices=sorted(PRECISIONS))
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATES))
    parser.add_argument("--trainable-parameters", type=int, default=None,
                        help="parameters that train (LoRA's adapters: peft's print_trainable_parameters); only they "
                             "have gradients and optimizer states (default: all)")
    parser.add_argument("--accumulate-grad-batches", type=int, default=1,
                        help="Trainer(accumulate_grad_batches=...): batches per optimizer step")
    for feature in FEATURES:  # each memory feature's options
        for flag in feature.flags:
            flag.add_to(parser)
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0,
                        help="GiB of one GPU (an H100 80GB reports ~79, an H200 ~139); the plan fills it less the CUDA "
                             "context and the allocator's fragmentation, as the strategy does")
    parser.add_argument("--expandable-segments", action="store_true",
                        help="plan as with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less fragmentation; also "
                             "read from the environment)")
    parser.add_argument("--host-memory-gib", type=_host_memory, default=None,
                        help="memory the processes of one host may hold (pinned and pageable), or 'auto' for this "
                             "machine's available memory")
    parser.add_argument("--host-baseline-gib", type=float, default=None,
                        help="resident memory of one process before the step's buffers (default: the planner's "
                             "estimate)")
    parser.add_argument("--disk-gib", type=float, default=None,
                        help="free space of the disk tier's directory on one host (FPDTStrategy(offload_dir=...)): "
                             "block inputs beyond the host's memory may go there; default: no disk tier")
    parser.add_argument("--disk-gbps", type=float, default=DISK_GBPS,
                        help=f"the disk's read and write rate in GB/s, shared by the GPUs of a host (default "
                             f"{DISK_GBPS}: a local NVMe measured with dd)")
    parser.add_argument("--card", default=None,
                        help="the GPU model the plan is for, as torch names it (\"NVIDIA H200\"): its step is timed "
                             "at that GPU's cached calibration (lightning-fpdt calibrate); default: this machine's "
                             "GPU, else the built-in table")
    parser.add_argument("--inter-host-gbps", type=float, default=None,
                        help=f"GB/s one GPU sends to GPUs of other hosts (default {INTER_HOST_BYTES / 1e9:g}: what "
                             f"NCCL reaches over a 400 Gb/s InfiniBand link per GPU); the step-time estimate charges "
                             f"the traffic leaving a host at it, and --ring-size auto picks the fastest layout by it")
    args = parser.parse_args(argv)
    here = this_machine(card=args.card, gpus_per_node=args.gpus_per_node or args.gpus)
    host = args.host_memory_gib
    if host == "auto" or (host is None and here is None):
        # this machine's memory, less the reserve the strategy leaves (planner/machine.py)
        host = machine_limits(num_gpus=args.gpus, gpus_per_node=args.gpus_per_node or args.gpus).host_memory_gib
    try:
        plan = plan_memory(
            geometry=resolve_geometry(args.model, num_layers=args.layers), seq_len=args.seq_len,
            batch_size=args.batch_size, num_gpus=args.gpus, gpus_per_node=args.gpus_per_node,
            sequence_parallel_size=args.sp, ring_size=args.ring_size,
            activation_offload="offload" in args.callbacks, activation_checkpointing="checkpoint" in args.callbacks,
            tiled_mlp="mlp" in args.callbacks, tiled_loss="loss" in args.callbacks, precision=args.precision,
            optimizer=args.optimizer,
            gpu_memory_gib=plannable_gpu_bytes(int(args.gpu_memory_gib * GIB), expandable_segments=(
                args.expandable_segments or expandable_segments())) / GIB,
            host_memory_gib=host, host_baseline_gib=args.host_baseline_gib, disk_memory_gib=args.disk_gib,
            disk_gbps=args.disk_gbps, accumulate_grad_batches=args.accumulate_grad_batches,
            trainable_parameters=args.trainable_parameters, inter_host_gbps=args.inter_host_gbps,
            rates=cached_rates(args.card,
                               group_size=args.sp if args.sp != "auto" else (args.gpus_per_node or args.gpus)),
            **{flag.option: getattr(args, flag.option) for feature in FEATURES for flag in feature.flags},
        )
    except ValueError as error:
        print(f"lightning-fpdt plan: {error}", file=sys.stderr)
        return 2
    if here is not None and host is None and "not checked" in plan.recommendation:
        plan = dataclasses.replace(plan, recommendation=plan.recommendation.replace(
            "(give host_memory_gib to check it)", f"(the plan is not for this machine: {here}; pass "
                                                  f"--host-memory-gib N)"))
    print(format_plan(plan))
    return 0 if plan.fits else 1


def this_machine(*, card: Optional[str], gpus_per_node: int) -> Optional[str]:
    """``None`` when a plan of ``gpus_per_node`` GPUs of ``card`` (``None``: unnamed) is for the machine the command
    runs on, else why not: no CUDA device here, fewer GPUs here, another card named."""
    if not torch.cuda.is_available():
        return "it has no CUDA device"
    here = torch.cuda.device_count()
    if gpus_per_node > here:
        return f"{gpus_per_node} GPUs per host planned, it has {here}"
    name = torch.cuda.get_device_name(0)
    if card is not None and card != name:
        return f"{card} named, it has {name}"
    return None


def calibrate_main(argv: Optional[list[str]] = None) -> int:
    """``lightning-fpdt calibrate``: measure this GPU's rates (and, for ``--model`` at each ``--seq-len``, the shapes
    its plans time), cache them, print them. Exit 1 without a CUDA device. Under ``torchrun`` every rank measures the
    all-to-all of all of them; rank 0 the rest."""
    parser = argparse.ArgumentParser(
        prog="lightning-fpdt calibrate",
        description="Measure this GPU's GEMM, attention, copy and memory-bound rates for the step-time model, once; "
                    "cached in $XDG_CACHE_HOME/lightning_fpdt (docs/planner.md).")
    parser.add_argument("--model", default=None, help="a named size or a Hugging Face config.json whose shapes to "
                                                      "measure (default: the machine's rates only)")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--seq-len", type=int, nargs="*", default=[], help="the lengths whose shapes to measure")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--gpus", type=int, default=None, help="GPUs of the run (default: this job's processes)")
    parser.add_argument("--callbacks", type=_callbacks, default=_callbacks("all"))
    parser.add_argument("--offload-dir", default=None, help="measure this directory's disk too")
    parser.add_argument("--again", action="store_true", help="measure everything again (the cache is replaced)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("lightning-fpdt calibrate: no CUDA device here; plans use the built-in table "
              "(lightning_fpdt/planner/rates.py)", file=sys.stderr)
        return 1
    import torch.distributed as dist

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl")
    calibration = Calibration.load(current_key(device))
    if args.again:
        calibration.data = Calibration.empty(calibration.key)
    requests = [PlanRequest.of(geometry=resolve_geometry(args.model, num_layers=args.layers), seq_len=seq_len,
                               batch_size=args.batch_size, num_gpus=args.gpus or world, chunks="auto",
                               head_chunks="auto", activation_offload="offload" in args.callbacks,
                               activation_checkpointing="checkpoint" in args.callbacks,
                               tiled_mlp="mlp" in args.callbacks, tiled_loss="loss" in args.callbacks)
                for seq_len in args.seq_len] if args.model else []
    shapes = needed_shapes(s for request in requests for s in timed_sizes(request))
    started = time.monotonic()
    group = dist.group.WORLD if world > 1 else None
    if rank == 0:
        left = calibration.measure(device, shapes=shapes, group=group, offload_dir=args.offload_dir)
    elif group is not None:  # the all-to-all needs every rank; rank 0 keeps its figure
        all_to_all_bytes(group, device, clock=clock_for(device))
    seconds = time.monotonic() - started
    if rank == 0:
        calibration.save()
        print(calibration.table())
        print(f"\ncalibrated in {seconds:.1f} s"
              + (f"; {len(left)} shapes left for their next use (the time bound)" if len(left) else ""))
    if world > 1:
        dist.destroy_process_group()
    return 0
