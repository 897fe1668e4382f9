"""The reference Llama trained side by side by this project and by its two peers; one JSON record per run (issue 8).

    python bench/peers.py --system fpdt --model llama3-8b --layers 4 --seq-len 262144 --ballast auto --check-host
    torchrun --standalone --nproc_per_node 4 bench/peers.py --system ring --model llama3-8b --layers 4 --seq-len 262144
    python bench/peers.py --max-length --gpus 4 --system fpdt --model llama3-8b --layers 4 --seq-len 524288 \
        --ballast auto --check-host --steps 1                 # launches one torchrun per length; see bench/README.md

Systems, all on ``lightning_fpdt.models.llama.LlamaForCausalLM`` with the same initialisation (``LlamaLM``'s seeded
init) and the same random-token data (sample ``i`` drawn from a generator seeded with ``i``), AdamW, FSDP2 over all
GPUs with bf16 compute and fp32 master weights and gradient reduction (FSDP2's ``MixedPrecisionPolicy`` in all three):

- ``fpdt``: ``Trainer(strategy=FPDTStrategy(...))`` with ``ActivationOffload``, ``TiledMLP``, ``TiledLoss`` and
  ``MFUMonitor``, attention chunks offloaded to host memory (``--offload on``): every feature of this project. The
  GPUs share one sequence (Ulysses + FPDT); a step trains ``S`` tokens.
- ``modelparallel``: what a Lightning user does today: ``ModelParallelStrategy`` (data parallel only), FSDP2 and
  torch's non-reentrant activation checkpointing per block in ``configure_model``, the reference Llama's SDPA attention,
  untiled loss. Every GPU holds a whole sequence of ``S`` tokens (its own sample): a step trains ``GPUs × S`` tokens, and
  the longest sequence does not grow with the GPU count.
- ``ring``: PyTorch's context parallelism (``torch.distributed.tensor.experimental.context_parallel``: ring attention
  over SDPA, head-tail load balancing by the API) on a 1-D mesh of all GPUs, FSDP2 over the same mesh, each block
  checkpointed; a plain PyTorch loop, as its users write it. ``input_ids``, ``position_ids`` and the globally shifted
  labels are the buffers it shards. CUDA only: torch dispatches only its CUDA SDPA kernels to ring attention (on CPU
  ``aten._scaled_dot_product_flash_attention_for_cpu`` "does not have a sharding strategy registered").

Ballast protocol (DESIGN.md §8): ``--layers L --ballast auto`` runs ``L`` layers of the geometry and allocates on each
GPU a uint8 tensor the size of the sharded fp32 parameters, gradients and AdamW moments of the layers not run, plus
what each of them would keep on the GPU between its forward and backward (the baselines' checkpointed block inputs;
fpdt's attention chunks when they are not offloaded), so the peak GPU memory is that of the full depth (run two
depths to show it does not depend on ``L``). ``--check-host`` plans
(``lightning_fpdt.planner.plan_memory``) the pinned host memory of the full depth and compares it with what the host had
available when the run started. AdamW's moments are created before the first step (as its first step would create
them), so that step's peak is already the steady state's: ``--steps 1`` answers "does it fit".

Figures: step times are the median of the steps after the first (a warm-up); FLOPs in the causal convention
(``lightning_fpdt.flops.flops_per_token`` of the layers run), MFU against ``lightning_fpdt.flops.peak_flops`` of the card
(bf16). Peak GPU memory is ``torch.cuda.max_memory_allocated`` within a step, ballast included, the largest over steps
and ranks. A CUDA out-of-memory error ends the run with a record of status ``"oom"``: the ranks agree on the status
through the job's key-value store (not NCCL: a rank that ran out of memory has left the collective the others wait in).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils.data import DataLoader, Dataset

from lightning_fpdt import ActivationOffload, FPDTStrategy, MFUMonitor, TiledLoss, TiledMLP
from lightning_fpdt.flops import ModelGeometry, flops_per_token, peak_flops
from lightning_fpdt.models.llama import IGNORE_INDEX, NAMED_CONFIGS, LlamaConfig, LlamaForCausalLM, sdpa_attention
from lightning_fpdt.models.module import LlamaLM
from lightning_fpdt.planner import (
    OPTIMIZER_STATES,
    PRECISIONS,
    attention_geometry,
    available_host_memory,
    parameter_counts,
    plan_memory,
)
from lightning_fpdt.sequence.planning import stash_bytes
from lightning_fpdt.sequence.layout import SequenceLayout
from lightning_fpdt.strategy.fpdt import usable_total_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ holds scripts, not a package: its siblings
from step_profile import StepProfiler  # noqa: E402

GIB = 2**30
SYSTEMS = ("fpdt", "modelparallel", "ring")
SCRIPT = "bench/peers.py"
MULTICAST_OFF = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
"""Environment variables that keep NVLink multicast off on the lent machines (recorded with every run)."""
SEARCH_ONLY_OPTIONS = {"--max-length": 0, "--gpus": 1, "--max-seq-len": 1, "--length-multiple": 1, "--deadline-s": 1}
"""Options of the search process (with the number of values each takes), not passed on to the attempts."""

_RUN_COUNTER = itertools.count()  # names each run's keys in the store; every rank calls run() in the same order


# ---- data --------------------------------------------------------------------------------------------------------
class RandomTokens(Dataset):
    """Sample ``i``: ``seq_len`` token ids from a generator seeded with ``i`` (bench/smoke_train.py's data)."""

    def __init__(self, vocab_size: int, seq_len: int, num_samples: int) -> None:
        self.vocab_size, self.seq_len, self.num_samples = vocab_size, seq_len, num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        generator = torch.Generator().manual_seed(index)
        ids = torch.randint(0, self.vocab_size, (self.seq_len,), generator=generator)
        return {"input_ids": ids, "labels": ids}


# ---- options -----------------------------------------------------------------------------------------------------
def _auto_or_int(value: str) -> Any:
    return value if value == "auto" else int(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=SCRIPT, description="Train the reference Llama with fpdt, ModelParallelStrategy or ring context "
        "parallelism and write one JSON record per run.",
    )
    parser.add_argument("--system", choices=SYSTEMS, required=True)
    parser.add_argument("--model", default="llama3-8b", choices=sorted(NAMED_CONFIGS), help="named geometry")
    parser.add_argument("--layers", type=int, default=None, help="layers run (default: the full depth)")
    parser.add_argument("--seq-len", type=int, default=131072, help="global tokens of one sequence")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (the first is a warm-up)")
    parser.add_argument("--ballast", choices=["none", "auto"], default="none",
                        help="auto: hold the sharded states of the layers not run on each GPU")
    parser.add_argument("--check-host", action="store_true",
                        help="plan the pinned host memory of the full depth and compare it with the host's")
    parser.add_argument("--recompute-attention", action="store_true",
                        help="fpdt: ActivationOffload(recompute_attention=True), one layer's attention stash instead "
                             "of every layer's (for lengths where the full depth's stashes exceed host memory)")
    parser.add_argument("--cpu-offload-params", action="store_true",
                        help="FSDP2 CPUOffloadPolicy in every system (Llama-3-8B's states do not fit one 80 GB GPU)")
    parser.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="cap each process's GPU memory here (torch.cuda.set_per_process_memory_fraction; the "
                             "fpdt planner follows the cap): an 80 GB card's 79 GiB run on a larger card")
    parser.add_argument("--precision", choices=["bf16-mixed", "32-true"], default="bf16-mixed")
    parser.add_argument("--attention-backend", choices=["auto", "cudnn", "flash", "efficient", "math"], default="auto",
                        help="fpdt: FPDTStrategy(attention_backend=...); modelparallel, ring: sdpa_kernel(...)")
    parser.add_argument("--chunks", type=_auto_or_int, default="auto", help="fpdt: FPDT chunks per rank")
    parser.add_argument("--head-chunks", type=int, default=1,
                        help="fpdt: FPDTStrategy(head_chunks=G), attention in G head groups (lower attention peaks)")
    parser.add_argument("--offload", choices=["on", "off", "auto"], default="on", help="fpdt: attention chunk offload")
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
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "peers.jsonl"))
    parser.add_argument("--attempt-id", default=None, help=argparse.SUPPRESS)  # set by the --max-length search
    search = parser.add_argument_group("maximum-length search (run with python; it launches the attempts)")
    search.add_argument("--max-length", action="store_true",
                        help="double --seq-len until a step does not fit, then bisect once")
    search.add_argument("--gpus", type=int, default=1, help="GPUs of each attempt (torchrun when more than 1)")
    search.add_argument("--max-seq-len", type=int, default=16 * 2**20, help="stop doubling here")
    search.add_argument("--length-multiple", type=int, default=8192, help="lengths tried are multiples of this")
    search.add_argument("--deadline-s", type=float, default=3600.0,
                        help="wall time of the whole search; an attempt cut by it is recorded as 'timeout'")
    return parser


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return args


def full_depth(model: str) -> int:
    return LlamaConfig.from_name(model).num_layers


def layers_run(args: argparse.Namespace) -> int:
    return args.layers if args.layers is not None else full_depth(args.model)


def validate(args: argparse.Namespace, world_size: int) -> None:
    """``ValueError`` for options that cannot work together, a warning for an option the system ignores."""
    full = full_depth(args.model)
    if not 1 <= layers_run(args) <= full:
        raise ValueError(f"--layers ({args.layers}) must be between 1 and the depth of {args.model} ({full})")
    if args.seq_len < 2 or args.steps < 1:
        raise ValueError(f"--seq-len ({args.seq_len}) must be at least 2 and --steps ({args.steps}) at least 1")
    if args.system == "ring":
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
    if args.gpu_memory_gib is not None and (args.gpu_memory_gib <= 0 or args.accelerator != "cuda"):
        raise ValueError(f"--gpu-memory-gib ({args.gpu_memory_gib}) caps a GPU's memory: give a positive number of "
                         "GiB on --accelerator cuda, or drop it")
    if args.cpu_offload_params and args.accelerator != "cuda":
        raise ValueError("--cpu-offload-params needs a GPU: FSDP2's CPUOffloadPolicy pins the sharded parameters for "
                         "the accelerator (_fsdp_param._init_sharded_param fails without one); drop it on CPU")
    if args.system == "fpdt" and args.ballast == "auto" and args.offload == "auto":
        raise ValueError("fpdt: --ballast auto needs --offload on or off, not auto: without offload the attention "
                         "chunks of the layers not run belong in the ballast, and auto decides only at the first "
                         "batch, after the ballast is allocated")
    if args.system == "fpdt" and args.attention_backend == "efficient":
        raise ValueError("fpdt: --attention-backend efficient is an SDPA kernel FPDT does not use; pick auto, cudnn, "
                         "flash or math")
    ignored = {
        "--chunks": (args.chunks, "auto", "fpdt"), "--offload": (args.offload, "on", "fpdt"),
        "--head-chunks": (args.head_chunks, 1, "fpdt"),
        "--rotate-method": (args.rotate_method, "allgather", "ring"),
        "--ring-kv-heads": (args.ring_kv_heads, "native", "ring"),
    }
    for option, (value, default, system) in ignored.items():
        if value != default and args.system != system:
            warnings.warn(f"{option} {value} has no effect on --system {args.system} (only on {system})")
    if args.accelerator == "cuda" and not torch.cuda.is_available():
        raise ValueError("--accelerator cuda but torch sees no CUDA device; the CPU path (--accelerator cpu) is for "
                         "the tests")


# ---- ballast and host check ----------------------------------------------------------------------------------------
def state_bytes_per_parameter(precision: str, optimizer: str = "adamw") -> int:
    """Bytes of master weight, gradient and optimizer moments per parameter (16 for bf16-mixed AdamW)."""
    dtypes = PRECISIONS[precision]
    return dtypes["master"] + dtypes["grad"] + OPTIMIZER_STATES[optimizer] * dtypes["master"]


def kept_bytes_per_layer(system: str, geometry: ModelGeometry, *, seq_len: int, num_gpus: int, precision: str,
                         attention_offload: bool, recompute_attention: bool = False) -> int:
    """GPU bytes one block keeps from its forward to its backward (batch 1): what the ballast must also stand in for,
    for each block not run.

    ``modelparallel``: its checkpointed input, ``S·h·b`` (every GPU holds the whole sequence); ``ring``: the same for
    its ``S/W`` tokens; ``fpdt``: nothing when the attention offloads (ActivationOffload keeps the block inputs in host
    memory, the attention its chunks), else the layer's attention chunks (``planning.stash_bytes``) and its output
    kept for the recompute, ``S/P·H·D·b``, as ``lightning_fpdt.planner`` counts them (``P`` = all GPUs, one node);
    nothing either when the recompute runs the attention again (only the layer in backward holds chunks)."""
    act = PRECISIONS[precision]["act"]
    if system == "modelparallel":
        return seq_len * geometry.hidden_size * act
    if system == "ring":
        return seq_len // num_gpus * geometry.hidden_size * act
    if attention_offload or recompute_attention:
        return 0
    attention = attention_geometry(geometry, act)
    kept_out = seq_len // num_gpus * geometry.num_heads * geometry.head_dim * act
    return stash_bytes(attention, batch_size=1, seq_len=seq_len, sp_size=num_gpus) + kept_out


def ballast_bytes(
    geometry: ModelGeometry, *, layers_run: int, num_gpus: int, precision: str, cpu_offload_params: bool,
    kept_per_layer: int = 0, optimizer: str = "adamw",
) -> int:
    """What the ``geometry.num_layers - layers_run`` blocks not run would hold on each GPU: their parameters,
    gradients and optimizer moments, sharded by FSDP2 over all ``num_gpus`` (none when those live in host memory),
    and what each keeps between its forward and backward (:func:`kept_bytes_per_layer`).

    The rest of a step's memory does not depend on the depth: the gathered weights of the current and the prefetched
    block, the root unit, the working set of the block computing, the loss."""
    block, _rest = parameter_counts(geometry)
    missing = geometry.num_layers - layers_run
    states = 0 if cpu_offload_params else missing * block * state_bytes_per_parameter(precision, optimizer) // num_gpus
    return states + missing * kept_per_layer


def host_check(
    args: argparse.Namespace, *, num_gpus: int, gpus_per_node: int, resolved: dict[str, Any],
    gpu_memory_bytes: Optional[int], available_bytes: Optional[int],
) -> dict[str, Any]:
    """The planner's pinned host memory per host for the *full* depth, beside what the host had when the run began.

    Only ``fpdt`` pins activations and attention chunks; the baselines pin host memory only for CPU-offloaded states.
    ``planned_peak_gpu_bytes`` (fpdt only) is the planner's GPU peak of the full depth, to set beside the measured one.
    """
    fpdt = args.system == "fpdt"
    offload = {"on": True, "off": False, "auto": "auto"}[args.offload]
    plan = plan_memory(
        geometry=args.model, seq_len=args.seq_len, num_gpus=num_gpus, gpus_per_node=gpus_per_node,
        sequence_parallel_size=resolved.get("sequence_parallel_size", "auto") if fpdt else 1,
        chunks=resolved.get("chunks", args.chunks) if fpdt else 1,
        offload=resolved.get("offload", offload) if fpdt else False,
        offload_dq=resolved.get("offload_dq", "auto") if fpdt else False,
        activation_offload=fpdt, activation_checkpointing=True, tiled_mlp=fpdt, tiled_loss=fpdt,
        precision=args.precision, cpu_offload_params=args.cpu_offload_params,
        gpu_memory_gib=(gpu_memory_bytes or 80 * GIB) / GIB,
        host_memory_gib=None if available_bytes is None else available_bytes / GIB,
        recompute_attention=fpdt and args.recompute_attention, head_chunks=args.head_chunks if fpdt else 1,
    )
    return {
        "layers": plan.geometry.num_layers,
        "needed_bytes": plan.host_bytes_per_node,
        "available_bytes": available_bytes,
        "fits": None if available_bytes is None else plan.fits_host,
        "planned_peak_gpu_bytes": plan.peak_gpu_bytes if fpdt else None,
    }


# ---- shared pieces of the systems ------------------------------------------------------------------------------------
def prime_adam_states(optimizer: torch.optim.Optimizer) -> None:
    """Create Adam(W)'s moments now, exactly as its first ``step`` would (zeros, step 0), so that the first step's peak
    memory is already the steady state's. Parameters that already have state are left alone."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(f"prime_adam_states: expected Adam or AdamW, got {type(optimizer).__name__}")
    scalar_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in optimizer.param_groups:
        on_device = bool(group.get("capturable")) or bool(group.get("fused"))
        for p in group["params"]:
            state = optimizer.state[p]
            if state or not p.requires_grad:
                continue
            # torch keeps `step` on the CPU unless capturable or fused (torch/optim/adam.py, _init_group)
            state["step"] = torch.zeros((), dtype=scalar_dtype, device=p.device if on_device else "cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def mixed_precision(precision: str) -> Optional[MixedPrecisionPolicy]:
    """FSDP2's policy for ``--precision``: the one ``FPDTPrecision`` uses, so all three systems compute alike."""
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def shard_with_checkpointing(
    model: LlamaForCausalLM, mesh: DeviceMesh, *, mp_policy: Optional[MixedPrecisionPolicy], cpu_offload: bool,
) -> LlamaForCausalLM:
    """The baselines' parallelization, as torchtitan and Lightning's FSDP2 guide write it: each block wrapped in torch's
    non-reentrant ``checkpoint_wrapper`` and sharded as its own FSDP2 unit, then the root (embedding, norm, lm_head)."""
    kwargs = dict(mesh=mesh, mp_policy=mp_policy or MixedPrecisionPolicy(),
                  offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
    layers = model.model.layers
    for index, layer in enumerate(layers):
        # checkpointing inside the FSDP unit (torchtitan's order): the recompute runs with the block's weights gathered
        layers[index] = checkpoint_wrapper(layer)
        fully_shard(layers[index], **kwargs)
    fully_shard(model, **kwargs)  # last: the root unit takes what the blocks left
    return model


def sdpa_expanded_kv(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, scale: Optional[float] = None) -> Tensor:
    """``sdpa_attention`` with ``k, v`` repeated to the query heads and no ``enable_gqa``, for a ring-attention kernel
    that refuses grouped-query attention (``--ring-kv-heads expand``; costs 4x the kv traffic for Llama-3-8B)."""
    groups = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(groups, dim=2)  # (B, S, Hkv, D) -> (B, S, H, D)
    v = v.repeat_interleave(groups, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                         scale=scale)  # (B, H, S, D)
    return out.transpose(1, 2)


@contextmanager
def sdpa_backend(name: str) -> Iterator[None]:
    """``torch.nn.attention.sdpa_kernel`` for ``--attention-backend`` (``auto``: torch's own choice)."""
    if name == "auto":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]
    with sdpa_kernel(backend):
        yield


def _device_peaks(device: torch.device) -> tuple[Optional[int], Optional[int]]:
    if device.type != "cuda":
        return None, None
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


def _reset_peaks(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _append_step(info: dict[str, Any], device: torch.device, seconds: Optional[float], loss: float) -> None:
    allocated, reserved = _device_peaks(device)
    info.setdefault("step_times_s", []).append(seconds)
    info.setdefault("losses", []).append(loss)
    info.setdefault("peak_gpu_bytes_per_step", []).append(allocated)
    info.setdefault("peak_reserved_bytes_per_step", []).append(reserved)


# ---- the Lightning systems: fpdt and modelparallel -----------------------------------------------------------------
class ModelParallelLlamaLM(LlamaLM):
    """The reference Llama as a Lightning user parallelizes it for ``ModelParallelStrategy``: FSDP2 and activation
    checkpointing per block in ``configure_model`` (:func:`shard_with_checkpointing`), SDPA, untiled loss."""

    def __init__(self, name: str, *, precision: str, cpu_offload_params: bool, **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self.bench_precision, self.bench_cpu_offload = precision, cpu_offload_params

    def configure_model(self) -> None:
        if isinstance(self.model, FSDPModule):
            return
        shard_with_checkpointing(self.model, self.device_mesh["data_parallel"],
                                 mp_policy=mixed_precision(self.bench_precision), cpu_offload=self.bench_cpu_offload)


class _KeepOffloadedParams(ModelParallelStrategy):
    """``ModelParallelStrategy`` moves the whole module to the GPU after ``configure_model`` (``model_to_device``),
    which would undo FSDP2's ``CPUOffloadPolicy``; FSDP2 has already put every parameter where it belongs."""

    def model_to_device(self) -> None:
        pass


class _StepLog(L.Callback):
    """Primes AdamW's moments, and keeps each step's time, loss and peak GPU memory in ``info`` as the run goes (an
    out-of-memory error then still leaves the steps done). Placed after ``MFUMonitor``, whose step times it copies."""

    def __init__(self, info: dict[str, Any], monitor: MFUMonitor, seq_len: int, profiler: StepProfiler) -> None:
        self.info, self.monitor, self.seq_len, self.profiler = info, monitor, seq_len, profiler
        self._primed = False

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if not self._primed:
            # here, not at on_train_start: the fpdt strategy measures the free GPU memory its "auto" options plan
            # with when it shards the first batch (batch_to_device, just before this hook), without the moments, as
            # in any run of it
            self._primed = True
            for optimizer in trainer.optimizers:
                prime_adam_states(optimizer)
            strategy = trainer.strategy
            if isinstance(strategy, FPDTStrategy):
                offload = strategy.offload_for(self.seq_len)
                self.info.update(
                    chunks=strategy.num_chunks_for(self.seq_len), offload=offload,
                    offload_dq=strategy.offload_dq_for(self.seq_len, 1, offload),
                    sequence_parallel_size=strategy.sequence_parallel_size,
                    data_parallel_size=strategy.data_parallel_size,
                )
            else:
                self.info.update(sequence_parallel_size=1, data_parallel_size=trainer.world_size)
        _reset_peaks(trainer.strategy.root_device)
        self.profiler.start(idx)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           idx: int) -> None:
        self.profiler.stop(idx)
        record = self.monitor.step_records[-1] if self.monitor.step_records else None
        # the strategy's loss (under fpdt the sequence group's token mean); callbacks run before the module's own hook
        loss = outputs["loss"].detach().float().item() * trainer.accumulate_grad_batches
        _append_step(self.info, trainer.strategy.root_device, record and record.step_time_s, loss)
        self.info["tokens_per_step"] = record.tokens if record else None


def train_lightning(args: argparse.Namespace, *, device: torch.device, world_size: int, gpus_per_node: int,
                    info: dict[str, Any], peak: Optional[float]) -> None:
    """``fpdt`` or ``modelparallel``: ``args.steps`` steps of ``Trainer.fit``."""
    layers = layers_run(args)
    if args.system == "fpdt":
        module = LlamaLM(args.model, lr=args.lr, seed=args.seed, num_layers=layers)
        strategy = FPDTStrategy(chunks=args.chunks, offload={"on": True, "off": False, "auto": "auto"}[args.offload],
                                attention_backend=args.attention_backend, head_chunks=args.head_chunks,
                                cpu_offload_params=args.cpu_offload_params)
        callbacks: list[L.Callback] = [ActivationOffload(recompute_attention=args.recompute_attention), TiledMLP(),
                                       TiledLoss()]
        precision = args.precision  # FPDTPrecision: FSDP2 MixedPrecisionPolicy, no autocast
    else:
        module = ModelParallelLlamaLM(args.model, precision=args.precision, cpu_offload_params=args.cpu_offload_params,
                                      lr=args.lr, seed=args.seed, num_layers=layers)
        strategy_class = _KeepOffloadedParams if args.cpu_offload_params else ModelParallelStrategy
        strategy = strategy_class(data_parallel_size=world_size, tensor_parallel_size=1)
        callbacks = []
        precision = "32-true"  # bf16 comes from FSDP2's MixedPrecisionPolicy in configure_model, as in fpdt
    monitor = MFUMonitor(peak_flops=peak)
    trainer = L.Trainer(
        strategy=strategy, accelerator="gpu" if device.type == "cuda" else "cpu", devices=gpus_per_node,
        num_nodes=world_size // gpus_per_node, precision=precision, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[*callbacks, monitor, _StepLog(info, monitor, args.seq_len, step_profiler(args, device, info))],
    )
    vocab = LlamaConfig.from_name(args.model).vocab_size
    # Lightning shards the samples over the data-parallel ranks: under modelparallel rank r trains samples r, r + W, ...
    loader = DataLoader(RandomTokens(vocab, args.seq_len, args.steps * world_size), batch_size=1, shuffle=False)
    with sdpa_backend(args.attention_backend if args.system != "fpdt" else "auto"):
        trainer.fit(module, loader)


# ---- the ring system: a plain PyTorch loop ---------------------------------------------------------------------------
def train_ring(args: argparse.Namespace, *, device: torch.device, world_size: int, gpus_per_node: int,
               info: dict[str, Any], peak: Optional[float]) -> None:
    """``ring``: ``args.steps`` steps of context-parallel training on a 1-D mesh of all GPUs (torchtitan's recipe)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("cp",))
    model = LlamaLM(args.model, seed=args.seed, num_layers=layers_run(args)).model  # the Lightning systems' init
    for module in model.modules():
        if hasattr(module, "attention_fn"):
            # sdpa_attention calls F.scaled_dot_product_attention(..., is_causal=True) on (B, H, S, D): the call the
            # context_parallel dispatcher intercepts
            module.attention_fn = sdpa_expanded_kv if args.ring_kv_heads == "expand" else sdpa_attention
    shard_with_checkpointing(model, mesh, mp_policy=mixed_precision(args.precision), cpu_offload=args.cpu_offload_params)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)  # LlamaLM's optimizer
    prime_adam_states(optimizer)
    set_rotate_method(args.rotate_method)
    info.update(sequence_parallel_size=world_size, data_parallel_size=1, tokens_per_step=args.seq_len)
    profiler = step_profiler(args, device, info)
    dataset = RandomTokens(LlamaConfig.from_name(args.model).vocab_size, args.seq_len, args.steps)
    global_targets = args.seq_len - 1  # the last token has nothing to predict
    with sdpa_backend(args.attention_backend):
        for step in range(args.steps):
            input_ids = dataset[step]["input_ids"][None].to(device)  # (1, S), sample `step` as in the other systems
            position_ids = torch.arange(args.seq_len, device=device)[None]  # (1, S)
            targets = SequenceLayout.shift_labels(input_ids)  # (1, S): shifted on the whole sequence, then sharded
            buffers = [input_ids, position_ids, targets]
            _reset_peaks(device)
            profiler.start(step)
            start = time.perf_counter()
            with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
                # the buffers are now this rank's (1, S/W) load-balanced shards
                local_mean = model(input_ids, position_ids=position_ids, shift_labels=targets)
                count = (targets != IGNORE_INDEX).sum()
                # FSDP2 averages gradients over the W ranks: scaled so the average is the global token mean's gradient
                (local_mean * count * world_size / global_targets).backward()
            optimizer.step()
            optimizer.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
            profiler.stop(step)
            loss_sum = (local_mean.detach().float() * count).reshape(1)
            dist.all_reduce(loss_sum)
            _append_step(info, device, seconds, loss_sum.item() / global_targets)


def step_profiler(args: argparse.Namespace, device: torch.device, info: dict[str, Any]) -> StepProfiler:
    """The run's :class:`StepProfiler` (inert without ``--profile-step``); its summary lands in ``info["profile"]``."""
    prefix = os.path.join(os.path.dirname(os.path.abspath(args.out)),
                          f"profile-{args.system}-{args.seq_len}-{args.layers or 'all'}layers")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return StepProfiler(args.profile_step, prefix, device=device, rank=rank, trace=args.profile_trace, sink=info)


SYSTEM_FUNCTIONS: dict[str, Callable[..., None]] = {
    "fpdt": train_lightning, "modelparallel": train_lightning, "ring": train_ring,
}


# ---- out of memory: what it is, and agreeing on it ----------------------------------------------------------------
def out_of_memory(error: BaseException) -> Optional[str]:
    """``"gpu"`` or ``"host"`` when ``error`` reports a memory limit, else ``None`` (the error is a bug: re-raise)."""
    text = str(error)
    if isinstance(error, torch.OutOfMemoryError):
        return "gpu"
    if isinstance(error, ValueError) and "pinned host memory" in text:
        return "host"  # FPDTStrategy.check_memory_plan refuses a run whose pinned memory exceeds the host's
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


# ---- one run -------------------------------------------------------------------------------------------------------
def dist_environment() -> tuple[int, int, int, int]:
    """``(rank, world size, local rank, processes per node)``: from the process group when there is one (Lightning's
    teardown removes ``WORLD_SIZE`` from the environment), else from torchrun's environment (1 process without it)."""
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return rank, world_size, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))


def command_line(argv: list[str], gpus_per_node: int, world_size: int) -> str:
    """The command that reproduces this run (run from the repository root)."""
    tail = f"{SCRIPT} {shlex.join(argv)}"
    if world_size == 1 and "LOCAL_WORLD_SIZE" not in os.environ:
        return f"python {tail}"
    nodes = f"--nnodes {world_size // gpus_per_node} " if world_size != gpus_per_node else "--standalone "
    return f"torchrun {nodes}--nproc_per_node {gpus_per_node} {tail}"


def summarize(info: dict[str, Any], *, geometry_run: ModelGeometry, seq_len: int, world_size: int,
              peak: Optional[float], profile_step: Optional[int] = None) -> dict[str, Any]:
    """Median step time (of the steps after the first, when there are any, and not the profiled one: the profiler
    slows the step it records, more so the more kernels a step launches), tokens/s, TFLOP/s per GPU, MFU."""
    times = [t for t in info.get("step_times_s", []) if t is not None]
    if not times:
        return dict(step_time_s=None, timed_steps=0, tokens_per_s=None, tflops_per_gpu=None, mfu=None)
    after_warm_up = [t for i, t in enumerate(times) if i > 0 and i != profile_step]
    timed = after_warm_up or times[1:] or times
    step_time = statistics.median(timed)
    tokens = info["tokens_per_step"]
    flops = tokens * flops_per_token(geometry_run, seq_len, "causal")
    tflops = flops / step_time / world_size / 1e12
    return dict(
        step_time_s=step_time, timed_steps=len(timed) if len(times) > 1 else 0,
        tokens_per_s=tokens / step_time, tflops_per_gpu=tflops, mfu=None if peak is None else tflops * 1e12 / peak,
    )


def _without_attempt_id(argv: list[str]) -> list[str]:
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _host_peak_rss() -> Optional[int]:
    """Peak resident set size of this process (VmHWM), in bytes."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train ``args.system`` for ``args.steps`` steps on every rank of this job and return the run's record (the same
    status on every rank). Initialises the process group under torchrun; reuses one that exists (the tests' pool)."""
    _rank, world_size, local_rank, gpus_per_node = dist_environment()
    validate(args, world_size)
    device = torch.device("cuda", local_rank) if args.accelerator == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if args.gpu_memory_gib is not None:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_gib * GIB / total), device)
    if not dist.is_initialized() and (world_size > 1 or args.system == "ring"):
        # Lightning reuses it (one process: Lightning makes its own); ring needs one even on one GPU (mesh, all-reduce)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if world_size > 1:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    key = f"bench_peers/{args.attempt_id or 'run'}/{next(_RUN_COUNTER)}"
    available_host = available_host_memory()  # before this run pins anything
    full_geometry = ModelGeometry.from_config(LlamaConfig.from_name(args.model))
    geometry_run = dataclasses.replace(full_geometry, num_layers=layers_run(args))
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_flops(card, "bf16" if args.precision.startswith("bf16") else "fp32") if device.type == "cuda" else None
    card_memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    usable_memory = usable_total_bytes(device) if device.type == "cuda" else None  # the card's, or the cap

    info: dict[str, Any] = {}
    status, limit, error, ballast = "ok", None, None, None
    nbytes = state_ballast = 0
    if args.ballast == "auto":
        kept = kept_bytes_per_layer(args.system, full_geometry, seq_len=args.seq_len, num_gpus=world_size,
                                    precision=args.precision, attention_offload=args.offload == "on",
                                    recompute_attention=args.system == "fpdt" and args.recompute_attention)
        common = dict(layers_run=layers_run(args), num_gpus=world_size, precision=args.precision,
                      cpu_offload_params=args.cpu_offload_params)
        nbytes = ballast_bytes(full_geometry, kept_per_layer=kept, **common)
        state_ballast = ballast_bytes(full_geometry, **common)
    try:
        ballast = torch.empty(nbytes, dtype=torch.uint8, device=device) if nbytes else None
        SYSTEM_FUNCTIONS[args.system](args, device=device, world_size=world_size, gpus_per_node=gpus_per_node,
                                      info=info, peak=peak)
    except Exception as err:  # noqa: BLE001 - only memory errors become records; anything else is re-raised
        limit = out_of_memory(err)
        if limit is None:
            raise
        status, error = "oom", f"{type(err).__name__}: {str(err)[:600]}"
        info["peak_gpu_bytes_at_oom"] = _device_peaks(device)[0]
    del ballast
    status, answered = agree_on_status(status, key=key, timeout_s=args.agree_timeout_s)

    peaks = [p for p in info.get("peak_gpu_bytes_per_step", []) if p is not None]
    reserved = [p for p in info.get("peak_reserved_bytes_per_step", []) if p is not None]
    mine = (max(peaks) if peaks else None, max(reserved) if reserved else None, _host_peak_rss())
    rank_figures: list[Any] = [mine]
    if status == "ok" and world_size > 1:  # every rank finished: collectives are safe again
        rank_figures = [None] * world_size
        dist.all_gather_object(rank_figures, mine)
    peak_per_rank = [f[0] for f in rank_figures]
    peak_gpu = max(peak_per_rank) if all(p is not None for p in peak_per_rank) else None
    rss = [f[2] for f in rank_figures]

    record: dict[str, Any] = {
        "kind": "run", "system": args.system, "status": status, "limit": limit, "error": error,
        "card": card, "card_memory_bytes": card_memory, "gpu_memory_cap_bytes": usable_memory if
        args.gpu_memory_gib is not None else None, "gpus": world_size, "gpus_per_node": gpus_per_node,
        "model": args.model, "geometry": dataclasses.asdict(full_geometry), "layers": layers_run(args),
        "full_layers": full_geometry.num_layers, "seq_len": args.seq_len, "batch_size": 1,
        "chunks": info.get("chunks"), "sequence_parallel_size": info.get("sequence_parallel_size"),
        "data_parallel_size": info.get("data_parallel_size"),
        "options": {
            "precision": args.precision, "cpu_offload_params": args.cpu_offload_params,
            "attention_backend": args.attention_backend, "ballast": args.ballast,
            **({"offload": info.get("offload", args.offload), "offload_dq": info.get("offload_dq"),
                "callbacks": ["ActivationOffload", "TiledMLP", "TiledLoss", "MFUMonitor"],
                "recompute_attention": args.recompute_attention, "head_chunks": args.head_chunks}
               if args.system == "fpdt" else {"activation_checkpointing": "checkpoint_wrapper (non-reentrant)",
                                              "loss": "untiled"}),
            **({"rotate_method": args.rotate_method, "kv_heads": args.ring_kv_heads, "load_balance": "head-tail"}
               if args.system == "ring" else {}),
        },
        "steps": args.steps, "steps_done": len(info.get("step_times_s", [])),
        "step_times_s": info.get("step_times_s", []), "tokens_per_step": info.get("tokens_per_step"),
        **summarize(info, geometry_run=geometry_run, seq_len=args.seq_len, world_size=world_size, peak=peak,
                    profile_step=args.profile_step),
        "profile_step": args.profile_step,
        "flop_convention": "causal", "flops_per_token": flops_per_token(geometry_run, args.seq_len, "causal"),
        "peak_flops": peak,
        "losses": info.get("losses", []), "first_loss": (info.get("losses") or [None])[0],
        "profile": info.get("profile"),
        "peak_gpu_bytes": peak_gpu, "peak_gpu_bytes_per_rank": peak_per_rank,
        "peak_reserved_bytes": max((f[1] for f in rank_figures if f[1] is not None), default=None),
        "peak_gpu_bytes_at_oom": info.get("peak_gpu_bytes_at_oom"),
        "ballast_bytes": nbytes, "ballast_state_bytes": state_ballast,
        "ballast_activation_bytes": nbytes - state_ballast,
        "peak_gpu_bytes_minus_ballast": None if peak_gpu is None else peak_gpu - nbytes,
        "host_peak_rss_bytes": sum(rss) if all(r is not None for r in rss) else None,
        "host_check": None, "ranks_answered": answered, "attempt": args.attempt_id,
        "command": command_line(_without_attempt_id(args.argv), gpus_per_node, world_size),
        "env": {name: os.environ[name] for name in (*MULTICAST_OFF, "CUDA_VISIBLE_DEVICES") if name in os.environ},
        "torch": torch.__version__, "lightning": L.__version__,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if args.check_host:
        record["host_check"] = host_check(args, num_gpus=world_size, gpus_per_node=gpus_per_node, resolved=info,
                                          gpu_memory_bytes=usable_memory, available_bytes=available_host)
    return record


def append_record(path: str, record: dict[str, Any]) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


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
          f"ballast_gib={gib(record['ballast_bytes'])} first_loss={record['first_loss']}", flush=True)


# ---- maximum-length search -----------------------------------------------------------------------------------------
def search_lengths(attempt: Callable[[int], bool], start: int, *, multiple: int, max_len: int) -> dict[str, Any]:
    """Double from ``start`` while ``attempt(S)`` fits (halve first when ``start`` does not), then try once the
    midpoint between the longest fit and the shortest failure, rounded down to ``multiple``.

    Returns ``{"max_fit", "min_fail", "tried": [(S, fits), ...]}``; ``max_fit`` is ``None`` when nothing fit."""
    if start < multiple or start % multiple:
        raise ValueError(f"the first length ({start}) must be a positive multiple of --length-multiple ({multiple})")
    tried: list[tuple[int, bool]] = []

    def check(seq_len: int) -> bool:
        fits = attempt(seq_len)
        tried.append((seq_len, fits))
        return fits

    max_fit: Optional[int] = None
    min_fail: Optional[int] = None
    seq_len = start
    if check(seq_len):
        max_fit = seq_len
        while 2 * seq_len <= max_len:
            seq_len *= 2
            if not check(seq_len):
                min_fail = seq_len
                break
            max_fit = seq_len
    else:
        min_fail = seq_len
        while seq_len // 2 >= multiple and seq_len // 2 % multiple == 0:
            seq_len //= 2
            if check(seq_len):
                max_fit = seq_len
                break
            min_fail = seq_len
    if max_fit is not None and min_fail is not None:
        middle = (max_fit + min_fail) // 2 // multiple * multiple
        if max_fit < middle < min_fail:
            if check(middle):
                max_fit = middle
            else:
                min_fail = middle
    return {"max_fit": max_fit, "min_fail": min_fail, "tried": tried}


def attempt_argv(argv: list[str], seq_len: int, attempt_id: str) -> list[str]:
    """The search's own argv without its search options, with ``--seq-len seq_len --attempt-id attempt_id``."""
    drop = dict(SEARCH_ONLY_OPTIONS, **{"--seq-len": 1, "--attempt-id": 1})
    out: list[str] = []
    skip = 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in drop:
            skip = drop[name] if "=" not in arg else 0
            continue
        out.append(arg)
    return [*out, "--seq-len", str(seq_len), "--attempt-id", attempt_id]


def host_limit(args: argparse.Namespace, *, available_bytes: int, gpu_memory_bytes: Optional[int]) -> int:
    """The longest multiple of ``--length-multiple`` up to ``--max-seq-len`` whose full depth's planned pinned host
    memory fits ``available_bytes`` (0 if none does): a planner bisection, no run."""
    def fits(seq_len: int) -> bool:
        trial = argparse.Namespace(**{**vars(args), "seq_len": seq_len})
        return bool(host_check(trial, num_gpus=args.gpus, gpus_per_node=args.gpus, resolved={},
                               gpu_memory_bytes=gpu_memory_bytes, available_bytes=available_bytes)["fits"])

    low, high = 0, args.max_seq_len // args.length_multiple  # in multiples; fits(low) holds, by convention for 0
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle * args.length_multiple):
            low = middle
        else:
            high = middle - 1
    return low * args.length_multiple


def _read_attempt(path: str, attempt_id: str) -> Optional[dict[str, Any]]:
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


def _run_attempt(command: list[str], *, timeout_s: float, grace_s: float = 60.0) -> tuple[Optional[int], str]:
    """Run one attempt, its output echoed; ``(exit code or None if cut by the timeout, the output's tail)``.

    Cut: SIGTERM first, which torchrun passes on to its workers (they run in sessions of their own, out of reach of
    a signal to torchrun's process group), SIGKILL to the attempt's group after ``grace_s``. The output goes through
    a file, not a pipe, so a worker that outlives torchrun cannot keep this process waiting for its end."""
    with tempfile.TemporaryFile(mode="w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            rc: Optional[int] = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
            process.terminate()
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # the group this function started (start_new_session)
                process.wait()
        log.seek(0)
        output = log.read()
    sys.stdout.write(output)
    sys.stdout.flush()
    return rc, output[-2000:]


def max_length_search(args: argparse.Namespace) -> dict[str, Any]:
    """Each attempt in a fresh process (a CUDA out-of-memory error can leave a process unable to go on), one record
    per attempt in ``args.out`` and a ``"max_length"`` summary record at the end."""
    if "WORLD_SIZE" in os.environ:
        raise ValueError("--max-length launches its own torchrun per attempt: start it with python, not torchrun")
    if args.gpus < 1 or args.length_multiple < 1:
        raise ValueError(f"--gpus ({args.gpus}) and --length-multiple ({args.length_multiple}) must be positive")
    if args.system == "ring" and args.length_multiple % (2 * args.gpus):
        raise ValueError(f"ring: --length-multiple ({args.length_multiple}) must be a multiple of 2 x GPUs "
                         f"({2 * args.gpus}) so every length tried keeps the load balancing")
    started = time.monotonic()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    records: dict[int, dict[str, Any]] = {}

    def attempt(seq_len: int) -> bool:
        attempt_id = f"{args.system}-{args.gpus}gpu-{seq_len}-{stamp}"
        child = attempt_argv(args.argv, seq_len, attempt_id)
        launcher = [sys.executable] if args.gpus == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}"]
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers.py")
        remaining = args.deadline_s - (time.monotonic() - started)
        rc, tail = None, ""
        if remaining > 0:
            print(f"max-length: S={seq_len} ({remaining:.0f} s left)", flush=True)
            rc, tail = _run_attempt([*launcher, script, *child], timeout_s=remaining)
        record = _read_attempt(args.out, attempt_id)
        if record is None:  # crashed or cut by the deadline before writing: record why
            record = {"kind": "run", "system": args.system, "status": "timeout" if rc is None else "error",
                      "seq_len": seq_len, "gpus": args.gpus, "model": args.model, "layers": layers_run(args),
                      "full_layers": full_depth(args.model), "attempt": attempt_id, "rc": rc, "error": tail,
                      "command": command_line(child, args.gpus, args.gpus)}
            append_record(args.out, record)
        records[seq_len] = record
        return record.get("status") == "ok"  # the GPU limit; the host's is planned below

    start = max(args.length_multiple, args.seq_len // args.length_multiple * args.length_multiple)
    result = search_lengths(attempt, start, multiple=args.length_multiple, max_len=args.max_seq_len)
    failed = records.get(result["min_fail"]) if result["min_fail"] is not None else None
    fitted = records.get(result["max_fit"]) if result["max_fit"] is not None else None
    checked = [r for r in records.values() if (r.get("host_check") or {}).get("available_bytes")]
    host_max = None
    if checked:  # --check-host: the host's own limit for the full depth, from the planner
        host_max = host_limit(args, available_bytes=checked[-1]["host_check"]["available_bytes"],
                              gpu_memory_bytes=checked[-1].get("card_memory_bytes"))
    gpu_max = result["max_fit"]
    overall = gpu_max if host_max is None or gpu_max is None else min(gpu_max, host_max)
    if host_max is not None and gpu_max is not None and host_max < gpu_max:
        limited_by = "host (planned, full depth)"
    else:
        limited_by = None if failed is None else (failed.get("limit") or failed["status"])
    summary = {
        "kind": "max_length", "system": args.system, "model": args.model, "layers": layers_run(args),
        "full_layers": full_depth(args.model), "gpus": args.gpus,
        "card": next((r["card"] for r in records.values() if r.get("card")), None),
        "gpu_memory_cap_bytes": next((r["gpu_memory_cap_bytes"] for r in records.values()
                                      if r.get("gpu_memory_cap_bytes")), None),
        "ballast": args.ballast, "max_seq_len": overall, "max_seq_len_gpu": gpu_max,
        "first_failed_seq_len": result["min_fail"], "host_max_seq_len": host_max,
        "host_available_bytes": checked[-1]["host_check"]["available_bytes"] if checked else None,
        "limited_by": limited_by, "peak_gpu_bytes_at_max": fitted and fitted.get("peak_gpu_bytes"),
        "tried": [{"seq_len": s, "fits": fits, "status": records[s]["status"]} for s, fits in result["tried"]],
        "attempts": [records[s].get("attempt") for s, _ in result["tried"]],
        "command": f"python {SCRIPT} {shlex.join(args.argv)}",
        "elapsed_s": time.monotonic() - started,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    append_record(args.out, summary)
    print(f"MAX_LENGTH system={args.system} gpus={args.gpus} max_seq_len={overall} (gpu {gpu_max}, first failed "
          f"{result['min_fail']}; host {host_max}) limited_by={limited_by}", flush=True)
    return summary


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.max_length:
        max_length_search(args)
        return
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


if __name__ == "__main__":
    main()
