"""The rates the step-time model (:mod:`lightning_fpdt.planner.cost`) times a step at: :class:`StepRates`, and the
built-in table it falls back to where this GPU was not calibrated (:mod:`lightning_fpdt.planner.calibration`).

The built-in table is an H100's (:data:`TABLE_CARD`), as measured for this package (docs/benchmarks.md): bf16 matmuls
at about 600 TFLOP/s in training, the FPDT attention at about 520 with its all-to-alls, pinned host-to-device copies at
about 50 GB/s, a device-to-device copy at 2.49 TB/s. The link rates are assumptions, not measured here. On another
card, and without a calibration, its seconds are an H100's: they rank configurations; a calibrated GPU's predict the
step (the measured rates replace the table's where they were measured).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Optional

TABLE_CARD = "NVIDIA H100 80GB HBM3"
"""The card the built-in table was measured on."""
MATMUL_FLOPS = 600e12
"""bf16 matmul rate of the dense layers in a training step, FLOP/s."""
ATTENTION_FLOPS = 520e12
"""The FPDT attention's forward + backward rate at long sequences, FLOP/s (its all-to-alls included)."""
FULL_SPEED_CHUNK_TOKENS = 32768
"""Global tokens per chunk from which the attention blocks run at :data:`ATTENTION_FLOPS`."""
HALVING_SLOWDOWN = 0.05
"""Share of the attention's time each halving of the chunk below :data:`FULL_SPEED_CHUNK_TOKENS` adds."""
GROUP_SLOWDOWN = 0.02
"""Share of the attention's time each head group beyond the first adds (smaller calls: +6% at ``G = 4`` on an H100);
a calibrated GPU measures its smaller calls instead."""
COPY_BYTES = 50e9
"""Pinned host <-> device copy rate, bytes/s."""
COPY_OVERLAP = 0.5
"""Share of a pinned copy's time the compute beside it hides: two H200s at 131,072 tokens (Llama-3.2-3B geometry, 8
layers) measured the attention stash offloaded 4.2% slower than kept, 0.17 s for 17 GB moved, about half the copies'
own time at :data:`COPY_BYTES` (docs/benchmarks.md)."""
ELEMENTWISE_BYTES = 2.49e12
"""Bytes per second (read plus written) of a memory-bound op: a device-to-device copy on an H100
(``bench/elementwise.py``'s floor)."""
PAGEABLE_COPY_BYTES = 19e9
"""Device-to-host copies into pageable memory, bytes/s (the gradients under host-resident states)."""
HOST_STEP_BYTES = 20e9
"""Bytes per second one rank's share of the host's cores moves through in the fused AdamW step on the CPU."""
NVLINK_BYTES = 300e9
"""Bytes per second a GPU sends to the other GPUs of its host in NCCL's collectives and point-to-point transfers (an
H100's NVLink moves 450 GB/s each way; NCCL reaches less)."""
INTER_HOST_BYTES = 40e9
"""Bytes per second a GPU sends to GPUs of other hosts: about what NCCL reaches over one 400 Gb/s InfiniBand link per
GPU (50 GB/s on the wire). The default of ``plan_memory(inter_host_gbps=None)`` and of ``lightning-fpdt plan
--inter-host-gbps`` (a run's own rate: ``ib_write_bw``, or NCCL's ``all_reduce_perf`` bus bandwidth between two
hosts). Assumptions, as :data:`NVLINK_BYTES`, not measured here: they rank layouts and ways to fit."""
GRADIENT_REDUCE_BYTES = {"host": NVLINK_BYTES, "hosts": INTER_HOST_BYTES}
"""Bytes per second a GPU sends in the gradients' reduce-scatter: over NVLink inside one host, over the network between
hosts (the run's own rate where it gives one: :func:`link_rate`). It ranks a reduce-scatter every batch against the
other ways to fit."""
GEMM_MAX_ROWS = 32768
"""A GEMM is measured, and looked up, at this many rows at most: a longer one runs at the same rate (32,768 rows of a
3,072-wide product already fill an H100's SMs hundreds of times over), its time scaled by its rows."""
BUILTIN_SOURCE = f"the built-in table (an {TABLE_CARD}'s rates, lightning_fpdt/planner/rates.py)"


def gemm_key(kind: str, rows: int, inner: int, cols: int) -> str:
    """The calibration's name of a GEMM: ``kind`` (``forward``, ``input_grad``, ``weight_grad``) of ``X (rows, inner)``
    by a weight ``(cols, inner)``, ``rows`` capped at :data:`GEMM_MAX_ROWS`."""
    return f"{kind}:{min(rows, GEMM_MAX_ROWS)}x{inner}x{cols}"


def attention_key(kind: str, *, causal: bool, batch: int, heads: int, kv_heads: int, tokens: int,
                  head_dim: int) -> str:
    """The calibration's name of one attention block: ``kind`` (``forward``, ``backward``) of ``q (batch, heads,
    tokens, head_dim)`` against as many keys of ``kv_heads``, causal (a diagonal block) or not."""
    return f"{kind}:{'causal' if causal else 'full'}:b{batch}h{heads}k{kv_heads}d{head_dim}:t{tokens}"


def attention_block_flops(kind: str, *, causal: bool, batch: int, heads: int, tokens: int, head_dim: int) -> float:
    """FLOPs of one attention block as the MFU counts them: a full block's forward ``4·B·h·C²·D`` (scores and output),
    half of it causal; a backward twice its forward."""
    flops = 4 * batch * heads * tokens * tokens * head_dim * (0.5 if causal else 1.0)
    return flops * (2 if kind == "backward" else 1)


@dataclass(frozen=True)
class StepRates:
    """The rates a step is timed at: measured ones (``gemms``, ``attention`` and the scalar fields of a calibrated GPU,
    :meth:`lightning_fpdt.planner.calibration.Calibration.rates`) or the built-in table's (the defaults)."""

    source: str = field(default=BUILTIN_SOURCE, compare=False)
    """Where the rates come from, in words: a calibration file, or the built-in table (a description: rates of the
    same figures are equal wherever their file is)."""
    calibrated: bool = False
    matmul_flops: float = MATMUL_FLOPS
    """FLOP/s of a GEMM whose shape was not measured."""
    attention_flops: float = ATTENTION_FLOPS
    """FLOP/s of an attention block whose shape was not measured (and no other of its heads)."""
    copy_bytes: float = COPY_BYTES
    """Pinned host <-> device bytes per second, the slower direction."""
    copy_overlap: float = COPY_OVERLAP
    """Share of a copy's time hidden by the compute beside it."""
    elementwise_bytes: float = ELEMENTWISE_BYTES
    pageable_copy_bytes: float = PAGEABLE_COPY_BYTES
    host_step_bytes: float = HOST_STEP_BYTES
    all_to_all_bytes: Optional[float] = None
    """Bytes per second one rank sends in the Ulysses all-to-all; ``None``: counted in the attention's rate (the
    table's, measured with its all-to-alls)."""
    gemms: tuple[tuple[str, float], ...] = ()
    """``(gemm_key, FLOP/s)`` measured."""
    attention: tuple[tuple[str, float], ...] = ()
    """``(attention_key, seconds)`` measured."""

    @cached_property
    def _gemms(self) -> dict[str, float]:
        return dict(self.gemms)

    @cached_property
    def _attention(self) -> dict[str, float]:
        return dict(self.attention)

    @cached_property
    def _gemm_rows(self) -> dict[str, list[tuple[int, float]]]:
        """Measured rates by ``kind:inner x cols``, sorted by rows."""
        found: dict[str, list[tuple[int, float]]] = {}
        for key, rate in self.gemms:
            kind, shape = key.split(":")
            rows, inner, cols = shape.split("x")
            found.setdefault(f"{kind}:{inner}x{cols}", []).append((int(rows), rate))
        return {name: sorted(rows) for name, rows in found.items()}

    @cached_property
    def _attention_shapes(self) -> dict[tuple[str, bool, int], list[tuple[dict[str, int], float]]]:
        """Measured blocks by ``(kind, causal, head_dim)``: each block's sizes and seconds."""
        found: dict[tuple[str, bool, int], list[tuple[dict[str, int], float]]] = {}
        for key, seconds in self.attention:
            kind, causal, shape, tokens = key.split(":")
            batch, rest = shape[1:].split("h")
            heads, rest = rest.split("k")
            kv_heads, head_dim = rest.split("d")
            sizes = dict(batch=int(batch), heads=int(heads), kv_heads=int(kv_heads), tokens=int(tokens[1:]))
            found.setdefault((kind, causal == "causal", int(head_dim)), []).append((sizes, seconds))
        return found

    @cached_property
    def _looked_up(self) -> dict[tuple[Any, ...], float]:
        """The times and rates already worked out at these rates (:meth:`remembered`)."""
        return {}

    def remembered(self, key: tuple[Any, ...], work_out: Callable[[], float]) -> float:
        """``work_out()``, once for each ``key`` at these rates: a search asks the same shapes of thousands of
        configurations. ``key`` names everything the answer depends on but the rates."""
        value = self._looked_up.get(key)
        if value is None:
            value = self._looked_up[key] = work_out()
        return value

    def gemm_flops(self, kind: str, rows: int, inner: int, cols: int) -> float:
        """FLOP/s of a GEMM: measured at its shape, else at the nearest measured row count of its ``inner x cols``,
        else :attr:`matmul_flops`."""
        return self.remembered(("gemm", kind, rows, inner, cols), lambda: self._gemm_flops(kind, rows, inner, cols))

    def attention_seconds(self, kind: str, *, causal: bool, batch: int, heads: int, kv_heads: int, tokens: int,
                          head_dim: int) -> float:
        """Seconds of one attention block: measured at its shape; else the nearest measured block of its kind (by
        tokens, heads and batch), scaled by the FLOPs; else the FLOPs at :attr:`attention_flops`, slowed by
        :data:`HALVING_SLOWDOWN` for each halving of ``tokens`` below :data:`FULL_SPEED_CHUNK_TOKENS` (the table's
        rule)."""
        shape = dict(causal=causal, batch=batch, heads=heads, kv_heads=kv_heads, tokens=tokens, head_dim=head_dim)
        return self.remembered(("attention", kind, *shape.values()), lambda: self._attention_seconds(kind, **shape))

    def _gemm_flops(self, kind: str, rows: int, inner: int, cols: int) -> float:
        rate = self._gemms.get(gemm_key(kind, rows, inner, cols))
        if rate is not None:
            return rate
        measured = self._gemm_rows.get(f"{kind}:{inner}x{cols}")
        if not measured:
            return self.matmul_flops
        return _nearest(measured, min(rows, GEMM_MAX_ROWS))

    def _attention_seconds(self, kind: str, *, causal: bool, batch: int, heads: int, kv_heads: int, tokens: int,
                           head_dim: int) -> float:
        shape = dict(causal=causal, batch=batch, heads=heads, kv_heads=kv_heads, tokens=tokens, head_dim=head_dim)
        seconds = self._attention.get(attention_key(kind, **shape))
        if seconds is not None:
            return seconds
        flops = attention_block_flops(kind, causal=causal, batch=batch, heads=heads, tokens=tokens, head_dim=head_dim)
        measured = self._attention_shapes.get((kind, causal, head_dim))
        if measured:
            def distance(sizes: dict[str, int]) -> float:
                return (abs(math.log(sizes["tokens"] / tokens)) + abs(math.log(sizes["heads"] / heads))
                        + abs(math.log(sizes["batch"] / batch)))

            near, near_seconds = min(measured, key=lambda pair: distance(pair[0]))
            near_flops = attention_block_flops(kind, causal=causal, batch=near["batch"], heads=near["heads"],
                                               tokens=near["tokens"], head_dim=head_dim)
            return near_seconds * flops / near_flops
        slowdown = 1 + HALVING_SLOWDOWN * max(0.0, math.log2(FULL_SPEED_CHUNK_TOKENS / tokens))
        return flops / self.attention_flops * slowdown


def _nearest(measured: list[tuple[int, float]], rows: int) -> float:
    """The rate measured at the row count nearest to ``rows`` (by ratio)."""
    index = bisect.bisect_left(measured, (rows, 0.0))
    near = measured[max(0, index - 1):index + 1]
    return min(near, key=lambda pair: abs(math.log(pair[0] / rows)))[1]


BUILTIN_RATES = StepRates()
"""The built-in table's rates."""
