"""What the systems share, whichever loop trains them (Lightning's Trainer, the plain PyTorch loop, DeepSpeed's): the
data, Adam's primed moments, the attention backend, the per-step readings and the profiler."""

from __future__ import annotations

import argparse
import os
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import Dataset

from bench.host_readings import ResidentPeaks, pinned_bytes
from bench.step_profile import StepProfiler
from lightning_fpdt import FPDTStrategy

HOST_PEAKS = "host_peaks"
"""``info``'s key for the run's :class:`bench.host_readings.ResidentPeaks`."""


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


def device_peaks(device: torch.device) -> tuple[Optional[int], Optional[int]]:
    """``(max allocated, max reserved)`` bytes since the last reset; ``(None, None)`` off a GPU."""
    if device.type != "cuda":
        return None, None
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


def host_peaks(info: dict[str, Any]) -> ResidentPeaks:
    """The run's reader of this process's peak resident memory per step (kept in ``info``; not a record field)."""
    if HOST_PEAKS not in info:
        info[HOST_PEAKS] = ResidentPeaks()
    return info[HOST_PEAKS]


def reset_peaks(device: torch.device, info: dict[str, Any]) -> None:
    """A step starts: new GPU peaks, and a new span of the process's peak resident memory."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    host_peaks(info).start()


def append_step(info: dict[str, Any], device: torch.device, seconds: Optional[float], loss: float, *,
                 strategy: Any = None) -> None:
    """A step ended: its time, loss, GPU peaks and peak resident memory, and the pinned bytes held now (the fpdt
    ``strategy``'s own buffers counted where it is one; the other systems pin through PyTorch's allocator only)."""
    allocated, reserved = device_peaks(device)
    info.setdefault("step_times_s", []).append(seconds)
    info.setdefault("losses", []).append(loss)
    info.setdefault("peak_gpu_bytes_per_step", []).append(allocated)
    info.setdefault("peak_reserved_bytes_per_step", []).append(reserved)
    info.setdefault("peak_host_rss_bytes_per_step", []).append(host_peaks(info).stop())
    info.update(pinned_bytes(strategy, fpdt=isinstance(strategy, FPDTStrategy)))


def step_profiler(args: argparse.Namespace, device: torch.device, info: dict[str, Any]) -> StepProfiler:
    """The run's :class:`StepProfiler` (inert without ``--profile-step``); its summary lands in ``info["profile"]``."""
    prefix = os.path.join(os.path.dirname(os.path.abspath(args.out)),
                          f"profile-{args.system}-{args.seq_len}-{args.layers or 'all'}layers")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return StepProfiler(args.profile_step, prefix, device=device, rank=rank, trace=args.profile_trace, sink=info,
                        python=args.profile_python)
