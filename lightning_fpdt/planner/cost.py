"""What a configuration costs in step time: an estimate that ranks the runs that fit, so that ``"auto"`` takes the
fastest (:mod:`lightning_fpdt.planner.search`). Each memory feature adds its own term
(:meth:`~lightning_fpdt.planner.features.base.MemoryFeature.extra_seconds`); this module holds the rates they share
and the work every configuration does.

The rates are an H100's as measured for this package (docs/benchmarks.md): bf16 matmuls at about 600 TFLOP/s in
training, the FPDT attention at about 520, pinned host-to-device copies at about 50 GB/s. Only the ratios matter for
the ranking; the absolute seconds are not a prediction of the step time.
"""

from __future__ import annotations

from lightning_fpdt.planner.sizes import StepSizes

MATMUL_FLOPS = 600e12
"""bf16 matmul rate of the dense layers in a training step, FLOP/s."""
ATTENTION_FLOPS = 520e12
"""The FPDT attention's forward + backward rate at long sequences, FLOP/s."""
COPY_BYTES = 50e9
"""Pinned host <-> device copy rate, bytes/s."""
PAGEABLE_COPY_BYTES = 19e9
"""Device-to-host copies into pageable memory, bytes/s (the gradients under host-resident states)."""
HOST_STEP_BYTES = 20e9
"""Bytes per second one rank's share of the host's cores moves through in the fused AdamW step on the CPU."""
GRADIENT_REDUCE_BYTES = {"host": 300e9, "hosts": 40e9}
"""Bytes per second a GPU sends in the gradients' reduce-scatter: over NVLink inside one host (an H100's NVLink moves
450 GB/s each way; NCCL's reduce-scatter reaches less), and between hosts about what one 400 Gb/s InfiniBand link a
GPU gives. Assumptions, not measured here: they rank a reduce-scatter every batch against the other ways to fit."""


def dense_forward_seconds(s: StepSizes, parameters: int) -> float:
    """One forward of ``parameters`` weights over the GPU's ``N`` tokens."""
    return 2 * parameters * s.N / MATMUL_FLOPS


def attention_seconds(s: StepSizes) -> float:
    """The causal attention's forward and backward over the GPU's share of heads and tokens (``6·L·S·d_attn``
    per token, as the MFU counts it), for the busiest rank's heads when ``P`` does not divide them (the others wait
    for it at the next all-to-all)."""
    return 6 * s.L * s.seq_len * s.attention_heads * s.g.head_dim * s.N / ATTENTION_FLOPS


def attention_forward_seconds(s: StepSizes) -> float:
    """The attention's forward alone: a third of forward + backward (the backward is two forwards' work)."""
    return attention_seconds(s) / 3


def base_seconds(s: StepSizes) -> float:
    """What every configuration computes: the dense layers' forward and backward and the attention's."""
    return 3 * dense_forward_seconds(s, s.g.nonembedding_parameters) + attention_seconds(s)
