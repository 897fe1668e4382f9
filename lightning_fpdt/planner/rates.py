"""The rates the planner's cost model times a step at (:mod:`lightning_fpdt.planner.cost`): its calibration table.

The compute and copy rates are an H100's as measured for this package (docs/benchmarks.md): bf16 matmuls at about
600 TFLOP/s in training, the FPDT attention at about 520, pinned host-to-device copies at about 50 GB/s. The link
rates are assumptions, not measured here. Only the ratios matter for the ranking; the absolute seconds are not a
prediction of the step time.
"""

from __future__ import annotations

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
