"""What a configuration costs in step time: an estimate that ranks the runs that fit, so that ``"auto"`` takes the
fastest (:mod:`lightning_fpdt.planner.search`). Each memory feature adds its own term
(:meth:`~lightning_fpdt.planner.features.base.MemoryFeature.extra_seconds`); this module holds the rates they share
and the work every configuration does.

The rates are the calibration table of :mod:`lightning_fpdt.planner.rates`. Only the ratios matter for the ranking;
the absolute seconds are not a prediction of the step time.

The network between hosts (:func:`network_seconds`): the attention rate was measured with its all-to-alls inside
one host, over NVLink. A sequence-parallel group spanning hosts pays what its traffic between hosts adds: the bytes
of the Ulysses all-to-alls that leave the host (a Ulysses group spanning hosts) go over the network instead of NVLink,
and the ring's K/V passes go over the network when the ring crosses hosts, over NVLink otherwise, where they outlast
the ring's blocks they overlap with. On one host none of it applies, and the estimate is what it was without it.
"""

from __future__ import annotations

from typing import Optional

from lightning_fpdt.planner.rates import ATTENTION_FLOPS, INTER_HOST_BYTES, MATMUL_FLOPS, NVLINK_BYTES
from lightning_fpdt.planner.sizes import StepSizes


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


def link_rate(s: StepSizes, *, crosses_hosts: bool) -> float:
    """Bytes per second of one GPU's transfers: the run's inter-host rate when they cross hosts, NVLink's otherwise."""
    return s.inter_host_rate if crosses_hosts else NVLINK_BYTES


def ulysses_all_to_all_bytes(s: StepSizes) -> float:
    """Bytes one rank sends in a step's Ulysses all-to-alls, to the ``U - 1`` other ranks of its Ulysses group: per
    layer q, k, v and the attention output in the forward, their gradients in the backward, ``(2·H + 2·Hkv')·D·b`` per
    local token (``Hkv'``: the kv heads after replication up to ``U``), each rank keeping ``1/U`` of it."""
    ulysses = s.P // s.o.ring_size
    kv_heads = max(s.g.num_kv_heads, ulysses * s.G)
    per_token = (2 * s.g.num_heads + 2 * kv_heads) * s.g.head_dim * s.b
    return 2 * s.L * s.N * per_token * (ulysses - 1) / ulysses


def ulysses_leaving_bytes(s: StepSizes) -> float:
    """The part of :func:`ulysses_all_to_all_bytes` that leaves the host: the Ulysses group's ranks are consecutive,
    so a group of ``U`` larger than a host's ``d`` GPUs sends to ``U - d`` of its ``U - 1`` peers over the network."""
    ulysses, inside = s.P // s.o.ring_size, s.gpus_per_node
    if ulysses <= inside:
        return 0.0
    return ulysses_all_to_all_bytes(s) * (ulysses - inside) / (ulysses - 1)


def ulysses_network_seconds(s: StepSizes) -> float:
    """What the bytes of :func:`ulysses_leaving_bytes` add: they go at the inter-host rate instead of NVLink's, which
    the attention rate includes (negative for a network faster than NVLink, an NVLink domain spanning hosts)."""
    leaving = ulysses_leaving_bytes(s)
    return leaving / s.inter_host_rate - leaving / NVLINK_BYTES if leaving else 0.0


def ring_transfer_bytes(s: StepSizes) -> float:
    """Bytes one rank sends in a step's ring passes: per layer its ring share's K and V (``B·S/R`` tokens of its
    Ulysses rank's kv heads) ``R - 1`` times in the forward and again in the backward, and their fp32 gradient
    accumulators ``R`` times (docs/ring.md, "Costs"); 0 without a ring."""
    ring = s.o.ring_size
    if ring == 1:
        return 0.0
    ulysses = s.P // ring
    kv_elements = 2 * s.batch_size * (s.seq_len // ring) * max(1, s.g.num_kv_heads // ulysses) * s.g.head_dim
    return s.L * kv_elements * (2 * (ring - 1) * s.b + ring * 4)


def ring_network_seconds(s: StepSizes) -> float:
    """The ring's passes not hidden: they overlap the block computes of the ring's steps (``R - 1`` of every ``R``
    carry a transfer), so only their time beyond that compute adds to the step; at the inter-host rate when the ring
    crosses hosts (a sequence-parallel group larger than a host), at NVLink's otherwise."""
    transfer = ring_transfer_bytes(s)
    if not transfer:
        return 0.0
    ring = s.o.ring_size
    seconds = transfer / link_rate(s, crosses_hosts=s.P > s.gpus_per_node)
    return max(0.0, seconds - attention_seconds(s) * (ring - 1) / ring)


def network_seconds(s: StepSizes) -> float:
    """What the sequence-parallel layout's traffic between GPUs adds to the step (the module docstring): the Ulysses
    all-to-alls' bytes that leave the host and the ring's passes not hidden."""
    return ulysses_network_seconds(s) + ring_network_seconds(s)


def inter_host_rate(inter_host_gbps: Optional[float]) -> float:
    """Bytes per second from ``inter_host_gbps`` (GB/s per GPU; ``None``: :data:`INTER_HOST_BYTES`)."""
    if inter_host_gbps is None:
        return INTER_HOST_BYTES
    if isinstance(inter_host_gbps, bool) or not isinstance(inter_host_gbps, (int, float)) or not inter_host_gbps > 0:
        raise ValueError(
            f"inter_host_gbps ({inter_host_gbps!r}) must be a positive number of GB/s one GPU sends to other hosts: "
            f"about 50 for a 400 Gb/s InfiniBand link per GPU, 25 for 200 Gb/s; or None for the default "
            f"{INTER_HOST_BYTES / 1e9:g}"
        )
    return inter_host_gbps * 1e9
