"""The measurements of a calibration (:mod:`lightning_fpdt.planner.calibration`), on the device the tensors are on:
GEMMs and attention blocks at given shapes, page-locked copies alone and beside a GEMM, a memory-bound op, the
all-to-all of a process group, a disk. Plain torch.

Each measurement is a short bounded loop (:func:`time_calls`): a warm-up call, then a few timed calls, stopping once
they have taken :data:`MAX_SECONDS`; on a GPU timed with CUDA events (:class:`DeviceClock`), on the CPU (the tests)
with the host's clock. The result is the median call.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any, Callable, Protocol

import torch
from torch import Tensor

from lightning_fpdt.sequence.kernels import make_kernel

WARMUP_CALLS = 1
TIMED_CALLS = 3
MAX_SECONDS = 1.5
"""Timed calls of one measurement stop once they have taken this long (at least one is timed)."""
COPY_BYTES = 256 * 2**20
"""Bytes of the copies measured: large enough that the copy engines run at their rate (50 GB/s: 5 ms)."""
ELEMENTWISE_ELEMENTS = 64 * 2**20
"""bf16 elements of each operand of the memory-bound op measured (128 MiB)."""
ALL_TO_ALL_BYTES = 64 * 2**20
"""Bytes one rank sends in the all-to-all measured."""
DISK_BYTES = 256 * 2**20
"""Bytes written to and read from the disk measured."""


class Clock(Protocol):
    """Marks a point of the device's work and tells the seconds between two marks (waiting for the later one)."""

    def mark(self) -> Any: ...

    def seconds(self, start: Any, end: Any) -> float: ...


class DeviceClock:
    """CUDA events recorded on the current stream: what the device spent between two marks."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class HostClock:
    """The host's monotonic clock (the CPU's work is done when the call returns)."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start


def clock_for(device: torch.device) -> Clock:
    return DeviceClock() if device.type == "cuda" else HostClock()


def time_calls(fn: Callable[[], Any], *, clock: Clock, warmup: int = WARMUP_CALLS, calls: int = TIMED_CALLS,
               max_seconds: float = MAX_SECONDS) -> float:
    """Median seconds of one call of ``fn``: ``warmup`` calls untimed, then up to ``calls`` timed ones, stopping early
    once they have taken ``max_seconds`` (at least one is timed)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    while len(times) < max(1, calls):
        start = clock.mark()
        fn()
        times.append(clock.seconds(start, clock.mark()))
        if sum(times) >= max_seconds:
            break
    return statistics.median(times)


def fit_rate(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """``(latency, rate)`` of ``seconds = latency + size / rate``, least squares over two or more measurements (a
    single one: no latency); ``ValueError`` where the times do not grow with the size."""
    if len(sizes) != len(seconds) or not sizes:
        raise ValueError(f"fit_rate needs as many sizes as times, at least one: got {len(sizes)} and {len(seconds)}")
    if len(sizes) == 1:
        return 0.0, sizes[0] / seconds[0]
    mean_size, mean_time = statistics.fmean(sizes), statistics.fmean(seconds)
    spread = sum((x - mean_size) ** 2 for x in sizes)
    slope = sum((x - mean_size) * (t - mean_time) for x, t in zip(sizes, seconds)) / spread if spread else 0.0
    if slope <= 0:
        raise ValueError(f"the times {seconds} do not grow with the sizes {sizes}: no rate to fit")
    return max(0.0, mean_time - slope * mean_size), 1.0 / slope


def gemm_flops(kind: str, rows: int, inner: int, cols: int, *, device: torch.device, dtype: torch.dtype,
               clock: Clock) -> float:
    """FLOP/s of one linear layer's ``kind`` GEMM at ``X (rows, inner)``, a weight ``(cols, inner)``: ``forward``
    ``X·Wᵀ``, ``input_grad`` ``dY·W``, ``weight_grad`` ``dYᵀ·X``."""
    x = torch.randn(rows, inner, device=device, dtype=dtype)
    w = torch.randn(cols, inner, device=device, dtype=dtype)
    dy = torch.randn(rows, cols, device=device, dtype=dtype)
    products = {"forward": lambda: x @ w.t(), "input_grad": lambda: dy @ w, "weight_grad": lambda: dy.t() @ x}
    if kind not in products:
        raise ValueError(f"GEMM kind {kind!r}: one of {sorted(products)}")
    return 2.0 * rows * inner * cols / time_calls(products[kind], clock=clock)


def attention_seconds(kind: str, *, causal: bool, batch: int, heads: int, kv_heads: int, tokens: int,
                      head_dim: int, device: torch.device, dtype: torch.dtype, clock: Clock,
                      backend: str = "auto") -> float:
    """Seconds of one attention block's ``kind`` (``forward``, or ``backward`` fed the forward's output and
    log-sum-exp) through the package's block kernel (``lightning_fpdt.sequence.kernels``), ``q (B, h, C, D)``."""
    kernel = make_kernel(backend, device, dtype)
    q = torch.randn(batch, heads, tokens, head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, tokens, head_dim, device=device, dtype=dtype) for _ in range(2))
    scale = head_dim ** -0.5
    out, lse = kernel.forward(q, k, v, causal=causal, scale=scale)
    if kind == "forward":
        return time_calls(lambda: kernel.forward(q, k, v, causal=causal, scale=scale), clock=clock)
    if kind != "backward":
        raise ValueError(f"attention kind {kind!r}: forward or backward")
    dout = torch.randn_like(out)
    return time_calls(lambda: kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=scale), clock=clock)


def _host_buffer(nbytes: int, device: torch.device) -> Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


def copy_rates(device: torch.device, *, clock: Clock, nbytes: int = COPY_BYTES) -> dict[str, float]:
    """Page-locked copies: ``{"host_to_device": B/s, "device_to_host": B/s}``, each fitted over ``nbytes / 4`` and
    ``nbytes`` (:func:`fit_rate`: the rate without the per-copy latency)."""
    rates = {}
    for name, to_device in (("host_to_device", True), ("device_to_host", False)):
        sizes, seconds = [], []
        for size in (nbytes // 4, nbytes):
            host, dev = _host_buffer(size, device), torch.empty(size, dtype=torch.uint8, device=device)
            copy = (lambda: dev.copy_(host, non_blocking=True)) if to_device else \
                (lambda: host.copy_(dev, non_blocking=True))
            sizes.append(float(size))
            seconds.append(time_calls(copy, clock=clock))
        try:
            rates[name] = fit_rate(sizes, seconds)[1]
        except ValueError:  # too fast to tell the sizes apart (a CPU's memcpy): the larger copy's own rate
            rates[name] = sizes[-1] / seconds[-1]
    return rates


def copy_overlap(device: torch.device, *, clock: Clock, nbytes: int = COPY_BYTES, gemm_size: int = 8192) -> float:
    """The share of a page-locked copy's time hidden by a GEMM running on another stream: the copies (``nbytes`` each
    way) and a GEMM loop timed alone, then together, ``(copy + gemm - both) / copy``, in [0, 1]. The GEMM loop is
    sized to last longer than the copies. On the CPU (no streams) 0."""
    if device.type != "cuda":
        return 0.0
    up, down = _host_buffer(nbytes, device), _host_buffer(nbytes, device)
    dev_up, dev_down = (torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2))
    a = torch.randn(gemm_size, gemm_size, device=device, dtype=torch.bfloat16)
    side = torch.cuda.Stream(device)

    def copies() -> None:
        dev_up.copy_(up, non_blocking=True)
        down.copy_(dev_down, non_blocking=True)

    copy = time_calls(copies, clock=clock)
    one = time_calls(lambda: a @ a, clock=clock)
    repeats = max(1, int(2 * copy / one) + 1)

    def gemms() -> None:
        for _ in range(repeats):
            a @ a

    compute = time_calls(gemms, clock=clock)

    def both() -> None:
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            copies()
        gemms()
        torch.cuda.current_stream(device).wait_stream(side)

    together = time_calls(both, clock=clock)
    return min(1.0, max(0.0, (copy + compute - together) / copy))


def elementwise_bytes(device: torch.device, *, clock: Clock, elements: int = ELEMENTWISE_ELEMENTS) -> float:
    """Bytes per second (read plus written) of a memory-bound op: ``c = a + b`` in bf16."""
    a, b, c = (torch.empty(elements, device=device, dtype=torch.bfloat16).normal_() for _ in range(3))
    return 3 * elements * 2 / time_calls(lambda: torch.add(a, b, out=c), clock=clock)


def all_to_all_bytes(group: Any, device: torch.device, *, clock: Clock, nbytes: int = ALL_TO_ALL_BYTES) -> float:
    """Bytes per second one rank sends to the others of ``group`` in ``all_to_all_single`` (``nbytes`` in all, each
    rank keeping ``1/P`` of it). Collective: every rank of the group calls it."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if size < 2:
        raise ValueError("all_to_all_bytes measures a process group of 2 or more ranks")
    send = torch.empty(nbytes // size * size, dtype=torch.uint8, device=device)
    receive = torch.empty_like(send)
    seconds = time_calls(lambda: dist.all_to_all_single(receive, send, group=group), clock=clock)
    return send.numel() * (size - 1) / size / seconds


def disk_bytes(directory: str, *, nbytes: int = DISK_BYTES) -> float:
    """Bytes per second of the disk under ``directory``: a file of ``nbytes`` written and synced, its pages dropped
    from the page cache, read back (the slower of the two)."""
    block = os.urandom(1 << 20)
    pieces = max(1, nbytes // len(block))
    descriptor, path = tempfile.mkstemp(prefix="fpdt-calibration-", dir=directory)
    try:
        start = time.perf_counter()
        for _ in range(pieces):
            os.write(descriptor, block)
        os.fsync(descriptor)
        write = time.perf_counter() - start
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(descriptor, 0, os.SEEK_SET)
        start = time.perf_counter()
        while os.read(descriptor, len(block)):
            pass
        read = time.perf_counter() - start
    finally:
        os.close(descriptor)
        os.remove(path)
    return pieces * len(block) / max(write, read)
