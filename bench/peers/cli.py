"""The options of ``python3 -m bench.peers``, their checks, and its entry: one run or a ``--max-length`` search."""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from bench.peers.ballast import full_depth, layers_run
from bench.peers.hf_llama import GEOMETRY_NAMES, HF_GEOMETRIES
from bench.peers.records import print_record
from bench.peers.runner import dist_environment, run
from bench.peers.search import max_length_search
from bench.peers.systems import FPDT_SYSTEMS, SYSTEMS
from bench.provenance import append_record
from lightning_fpdt.models.llama import NAMED_CONFIGS
from lightning_fpdt.planner.components import expandable_segments
from lightning_fpdt.planner.features.base import all_or_count
from lightning_fpdt.planner.features.disk_tier import DISK_GBPS

PROG = "python3 -m bench.peers"


def _auto_or_int(value: str) -> Any:
    return value if value == "auto" else int(value)


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", choices=SYSTEMS, required=True)
    parser.add_argument("--model", default="llama3-8b", choices=GEOMETRY_NAMES,
                        help="named geometry; the Hugging Face ones (qwen3-4b, mixtral-8x7b, qwen2.5-0.5b, "
                             "qwen2.5-0.5b-16h) with --system fpdt-hf only")
    parser.add_argument("--layers", type=int, default=None, help="layers run (default: the full depth)")
    parser.add_argument("--seq-len", type=int, default=131072, help="global tokens of one sequence")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (the first is a warm-up)")
    parser.add_argument("--ballast", choices=["none", "auto", "full"], default="none",
                        help="auto: hold the sharded states of the layers not run on each GPU; full (fpdt, fpdt-hf, "
                             "alst): plan the full depth on this machine and hold what it keeps for the layers not "
                             "run on the GPU, in host memory and on disk (bench/peers/full_depth.py)")
    parser.add_argument("--offload-dir", default=None,
                        help="fpdt, fpdt-hf: FPDTStrategy(offload_dir=...), the disk tier's directory; with --ballast "
                             "full also where the disk bytes of the layers not run are held")
    parser.add_argument("--hold-host-gib", type=float, default=0.0,
                        help="hold this much pageable host memory through the run, as a smaller host would have "
                             "(the fpdt planner then plans with that much less; e.g. to make the disk tier spill)")
    parser.add_argument("--disk-gbps", type=float, default=DISK_GBPS,
                        help=f"--ballast full: the disk's rate the full depth is planned with (default {DISK_GBPS})")
    parser.add_argument("--check-host", action="store_true",
                        help="plan the pinned host memory of the full depth and compare it with the host's")
    parser.add_argument("--recompute-attention", action="store_true",
                        help="fpdt: ActivationOffload(recompute_attention=True), one layer's attention stash instead "
                             "of every layer's (for lengths where the full depth's stashes exceed host memory)")
    parser.add_argument("--reload-input", action="store_true",
                        help="fpdt: ActivationOffload(reload_input=True), a block's input on the host through its "
                             "backward")
    parser.add_argument("--prefetch", type=int, default=1,
                        help="fpdt: ActivationOffload(prefetch=...), block inputs brought back ahead (0: none)")
    parser.add_argument("--keep-inputs", type=all_or_count("block inputs"), default="all",
                        help="fpdt: ActivationOffload(keep_inputs=...): all (default), auto, or how many block inputs "
                             "wait for their backward (the others regenerated)")
    parser.add_argument("--checkpoint-blocks", type=all_or_count("blocks"), default="all",
                        help="fpdt: ActivationOffload(checkpoint_blocks=...): all (default), auto, or how many blocks "
                             "are checkpointed (the first ones; the others keep their activations on the GPU)")
    parser.add_argument("--auto-options", action="store_true",
                        help="fpdt, fpdt-hf: every memory option \"auto\" (chunks, offload, offload_dq, head_chunks, "
                             "ActivationOffload's recompute_attention, reload_input, prefetch, keep_inputs, "
                             "checkpoint_blocks): the strategy's choice of the fastest configuration that fits; the "
                             "option flags are ignored but a --chunks, --keep-inputs or --checkpoint-blocks count")
    parser.add_argument("--cpu-offload-params", action="store_true",
                        help="FSDP2 CPUOffloadPolicy in every system but alst; alst: ZeRO offload_optimizer to the CPU "
                             "with DeepSpeedCPUAdam, and offload_param on one GPU (Llama-3-8B's states do not fit one "
                             "80 GB GPU)")
    parser.add_argument("--host-step-after-backward", action="store_true",
                        help="fpdt, fpdt-hf with --cpu-offload-params: FPDTStrategy(host_step_in_backward=False), the "
                             "host's optimizer step after the backward instead of during it")
    parser.add_argument("--device-step-after-backward", action="store_true",
                        help="fpdt, fpdt-hf with the states on the GPU: FPDTStrategy(device_step_in_backward=False), "
                             "the optimizer step after the backward instead of in FSDP2's gradient hooks during it")
    parser.add_argument("--plan-trial", action="store_true",
                        help="fpdt, fpdt-hf: FPDTStrategy(plan_trial=True), the configurations the planner cannot tell "
                             "apart tried on the first steps (off by default here: a record times one configuration)")
    parser.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="cap each process's GPU memory here (torch.cuda.set_per_process_memory_fraction; the "
                             "fpdt planner follows the cap): an 80 GB card's 79 GiB run on a larger card")
    parser.add_argument("--precision", choices=["bf16-mixed", "32-true"], default="bf16-mixed")
    parser.add_argument("--attention-backend", choices=["auto", "cudnn", "flash", "efficient", "math"], default="auto",
                        help="fpdt, fpdt-hf: FPDTStrategy(attention_backend=...); modelparallel, ring, alst: "
                             "sdpa_kernel(...)")


def _add_system_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunks", type=_auto_or_int, default="auto", help="fpdt, fpdt-hf: FPDT chunks per rank")
    parser.add_argument("--sequence-parallel-size", type=_auto_or_int, default="auto",
                        help="fpdt, fpdt-hf: FPDTStrategy(sequence_parallel_size=N), N GPUs share one sequence of "
                             "--seq-len tokens and the GPUs / N groups train a sequence each (a step trains "
                             "GPUs / N sequences); auto: the strategy's choice")
    parser.add_argument("--ring-size", type=_auto_or_int, default="auto",
                        help="fpdt, fpdt-hf: FPDTStrategy(ring_size=R), ring R x Ulysses N/R over the N GPUs of one "
                             "sequence (FPDT chunks 1); auto: the strategy's choice")
    parser.add_argument("--head-chunks", type=int, default=1,
                        help="fpdt, fpdt-hf: FPDTStrategy(head_chunks=G), attention in G head groups (lower "
                             "attention peaks)")
    parser.add_argument("--offload", choices=["on", "off", "auto"], default="on",
                        help="fpdt, fpdt-hf: attention chunk offload")
    parser.add_argument("--offload-dq", choices=["on", "off", "auto"], default="auto",
                        help="fpdt, fpdt-hf: the backward's partial dQ sums in host memory too")
    parser.add_argument("--rotate-method", choices=["allgather", "alltoall"], default="allgather",
                        help="ring: how the kv shards travel (torch's set_rotate_method)")
    parser.add_argument("--ring-kv-heads", choices=["native", "expand"], default="native",
                        help="ring: native GQA (enable_gqa) or k, v repeated to the query heads before SDPA")
    parser.add_argument("--accelerator", choices=["cuda", "cpu"], default="cuda", help="cpu: the gloo tests only")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    parser.add_argument("--agree-timeout-s", type=float, default=120.0,
                        help="how long a rank waits for the others' status after an out-of-memory error")
    parser.add_argument("--profile-step", type=int, default=None,
                        help="run this step (0-based; 0 is the warm-up) under torch.profiler: device time by kernel "
                             "kind, busy fraction, top kernels (bench/step_profile.py), in the record and beside --out")
    parser.add_argument("--profile-trace", action="store_true", help="with --profile-step: a Chrome trace too")
    parser.add_argument("--profile-python", action="store_true",
                        help="with --profile-step: rank 0's host Python under cProfile too (it slows the host: the "
                             "step's gaps are then partly the profiler's)")
    parser.add_argument("--out", default="peers.jsonl", help="JSONL file the records are appended to")
    parser.add_argument("--attempt-id", default=None, help=argparse.SUPPRESS)  # set by the --max-length search


def _add_search_options(parser: argparse.ArgumentParser) -> None:
    search = parser.add_argument_group("maximum-length search (run with python3; it launches the attempts)")
    search.add_argument("--max-length", action="store_true",
                        help="double --seq-len until a step does not fit, then bisect once")
    search.add_argument("--gpus", type=int, default=1, help="GPUs of each attempt (torchrun when more than 1)")
    search.add_argument("--max-seq-len", type=int, default=16 * 2**20, help="stop doubling here")
    search.add_argument("--length-multiple", type=int, default=8192, help="lengths tried are multiples of this")
    search.add_argument("--deadline-s", type=float, default=3600.0,
                        help="wall time of the whole search; an attempt cut by it is recorded as 'timeout'")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Train the reference Llama with fpdt, ModelParallelStrategy or ring context "
        "parallelism, or its geometry as a Hugging Face Llama with fpdt (fpdt-hf) or DeepSpeed's ALST recipe (alst), "
        "and write one JSON record per run.",
    )
    _add_run_options(parser)
    _add_system_options(parser)
    _add_search_options(parser)
    return parser


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return args


def _check_ring(args: argparse.Namespace, world_size: int) -> None:
    if args.seq_len % (2 * world_size):
        raise ValueError(
            f"ring: --seq-len ({args.seq_len}) must be a multiple of 2 x GPUs = {2 * world_size}: below that "
            "context_parallel silently drops its head-tail load balancing; pick "
            f"{math.ceil(args.seq_len / (2 * world_size)) * 2 * world_size}"
        )
    if args.accelerator != "cuda":
        raise ValueError(
            "ring: torch's context parallelism dispatches only the CUDA SDPA kernels (flash, efficient, cuDNN) to "
            "ring attention; on CPU it fails in aten._scaled_dot_product_flash_attention_for_cpu. Run it on GPUs"
        )


def _check_memory_options(args: argparse.Namespace) -> None:
    if args.gpu_memory_gib is not None and (args.gpu_memory_gib <= 0 or args.accelerator != "cuda"):
        raise ValueError(f"--gpu-memory-gib ({args.gpu_memory_gib}) caps a GPU's memory: give a positive number of "
                         "GiB on --accelerator cuda, or drop it")
    if args.cpu_offload_params and args.accelerator != "cuda":
        raise ValueError("--cpu-offload-params needs a GPU: FSDP2's CPUOffloadPolicy pins the sharded parameters for "
                         "the accelerator (_fsdp_param._init_sharded_param fails without one); drop it on CPU")
    if args.ballast == "full" and args.system not in (*FPDT_SYSTEMS, "alst"):
        raise ValueError(f"--ballast full plans the host and disk memory of fpdt, fpdt-hf and alst; --system "
                         f"{args.system} keeps its block inputs on the GPU: use --ballast auto")
    if args.offload_dir is not None and args.system not in FPDT_SYSTEMS:
        raise ValueError(f"--offload-dir is FPDTStrategy's disk tier: --system {args.system} has none; drop it")
    if args.system in FPDT_SYSTEMS and args.ballast == "auto" and args.offload == "auto":
        raise ValueError(f"{args.system}: --ballast auto needs --offload on or off, not auto: without offload the "
                         "attention chunks of the layers not run belong in the ballast, and auto decides only at the "
                         "first batch, after the ballast is allocated")


def _warn_ignored(args: argparse.Namespace) -> None:
    ignored = {
        "--chunks": (args.chunks, "auto", FPDT_SYSTEMS), "--offload": (args.offload, "on", FPDT_SYSTEMS),
        "--head-chunks": (args.head_chunks, 1, FPDT_SYSTEMS), "--offload-dq": (args.offload_dq, "auto", FPDT_SYSTEMS),
        "--recompute-attention": (args.recompute_attention, False, FPDT_SYSTEMS),
        "--reload-input": (args.reload_input, False, FPDT_SYSTEMS), "--prefetch": (args.prefetch, 1, FPDT_SYSTEMS),
        "--rotate-method": (args.rotate_method, "allgather", ("ring",)),
        "--ring-kv-heads": (args.ring_kv_heads, "native", ("ring",)),
    }
    for option, (value, default, systems) in ignored.items():
        if value != default and args.system not in systems:
            warnings.warn(f"{option} {value} has no effect on --system {args.system} (only on {', '.join(systems)})")


def _check_sequence_parallel(args: argparse.Namespace, world_size: int) -> None:
    ring = getattr(args, "ring_size", "auto")
    if ring != "auto" and args.system not in FPDT_SYSTEMS:
        raise ValueError(f"--ring-size {ring} is FPDTStrategy's option: --system {args.system} fixes its own layout; "
                         "drop it, or run --system fpdt or fpdt-hf")
    size = getattr(args, "sequence_parallel_size", "auto")
    if size == "auto":
        return
    if args.system not in FPDT_SYSTEMS:
        raise ValueError(f"--sequence-parallel-size {size} is FPDTStrategy's option: --system {args.system} fixes its "
                         "own (ring and alst share one sequence over every GPU, modelparallel gives each GPU its own); "
                         "drop it, or run --system fpdt or fpdt-hf")
    if size < 1 or world_size % size:
        raise ValueError(f"--sequence-parallel-size ({size}) must divide the GPU count ({world_size}): the GPUs form "
                         f"GPUs / N data-parallel groups of N; pick one of "
                         f"{[n for n in range(1, world_size + 1) if world_size % n == 0]} or auto")


def _check_alst(args: argparse.Namespace, world_size: int) -> None:
    if args.accelerator != "cuda":
        raise ValueError("alst: DeepSpeed's recipe runs ZeRO-3 and its offloads on GPUs; run it with --accelerator "
                         "cuda (the CPU path is for the fpdt and modelparallel tests)")
    if world_size == 1 and "TORCHELASTIC_RUN_ID" in os.environ:
        raise ValueError("alst on one GPU: start it with python3 -m bench.peers, not torchrun: under torchrun with one "
                         "process DeepSpeed's run never finished its first step; started with python3 the same run "
                         "completes")
    if args.seq_len % world_size:
        raise ValueError(f"alst: --seq-len ({args.seq_len}) must be a multiple of the GPU count ({world_size}): "
                         "UlyssesSPDataLoaderAdapter shards each sample evenly; pick "
                         f"{math.ceil(args.seq_len / world_size) * world_size}")
    if not expandable_segments():
        raise ValueError("alst: start it with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in its environment "
                         "(the recipe's allocator setting, read when CUDA starts): without it the GPU memory "
                         "fragments and a length that fits runs out of memory (4 H100s, 1,310,720 tokens: 12.9 GiB "
                         "reserved but unallocated at the failure)")


def validate(args: argparse.Namespace, world_size: int) -> None:
    """``ValueError`` for options that cannot work together, a warning for an option the system ignores."""
    if args.model in HF_GEOMETRIES and args.system != "fpdt-hf":
        raise ValueError(f"--model {args.model} is a Hugging Face {HF_GEOMETRIES[args.model][0]} geometry: run it with "
                         f"--system fpdt-hf, or pick one of {sorted(NAMED_CONFIGS)}")
    full = full_depth(args.model)
    if not 1 <= layers_run(args) <= full:
        raise ValueError(f"--layers ({args.layers}) must be between 1 and the depth of {args.model} ({full})")
    if args.seq_len < 2 or args.steps < 1:
        raise ValueError(f"--seq-len ({args.seq_len}) must be at least 2 and --steps ({args.steps}) at least 1")
    _check_sequence_parallel(args, world_size)
    if args.system == "ring":
        _check_ring(args, world_size)
    if args.system == "alst":
        _check_alst(args, world_size)
    _check_memory_options(args)
    if args.system in FPDT_SYSTEMS and args.attention_backend == "efficient":
        raise ValueError(f"{args.system}: --attention-backend efficient is an SDPA kernel FPDT does not use; pick "
                         "auto, cudnn, flash or math")
    _warn_ignored(args)
    if args.accelerator == "cuda" and not torch.cuda.is_available():
        raise ValueError("--accelerator cuda but torch sees no CUDA device; the CPU path (--accelerator cpu) is for "
                         "the tests")


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.max_length:
        max_length_search(args)
        return
    validate(args, dist_environment()[1])
    record = run(args)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == min(record["ranks_answered"]):
        append_record(args.out, record)
        print_record(record)
    if record["status"] != "ok":
        # skip the process group's teardown: a rank still stuck in a collective would hang it. A non-zero exit when a
        # rank never answered makes torchrun end that rank.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if len(record["ranks_answered"]) == record["gpus"] else 3)
    if dist.is_initialized():
        dist.destroy_process_group()
