"""The step-time model: what a configuration costs in seconds, built from the parts of a training step at the rates of
the GPU it runs on (:class:`~lightning_fpdt.planner.rates.StepRates`: measured where the GPU was calibrated,
:mod:`lightning_fpdt.planner.calibration`, else the built-in table). ``"auto"`` takes the fastest that fits
(:mod:`lightning_fpdt.planner.search`); with calibrated rates the seconds are a prediction of the step.

Every configuration computes (:func:`base_parts`), per GPU:

- the dense layers: each layer's q, k, v, o, gate, up and down GEMMs, forward and the two backward GEMMs (the input's
  and the weight's gradient), each at the rate measured at its shape (the MLP's at a tile's rows where it is tiled);
- the attention: the FPDT schedule of each layer, ``u`` causal diagonal blocks and ``u(u-1)/2`` full blocks of
  ``C = S/u`` tokens, forward and backward, at the rates measured for those blocks (the busiest rank's heads), and
  the partial outputs' merges; at the fewest chunks and all heads at once (what more chunks or head groups add is
  theirs);
- the Ulysses all-to-alls at the measured all-to-all rate (the built-in table counts them in the attention's rate);
- the elementwise work at the measured rate of a memory-bound op: the norms, RoPE, SwiGLU and the residual adds of
  every layer (:data:`ELEMENTWISE_WIDTHS`), forward and backward; the loss's logits (:data:`LOSS_BYTES_PER_LOGIT`);
- the lm_head's GEMMs (at a loss tile's rows where the loss is tiled);
- the optimizer step on the GPU: :data:`OPTIMIZER_BYTES` per trainable parameter of the GPU's shard.

Each memory feature adds its own term (:meth:`~lightning_fpdt.planner.features.base.MemoryFeature.extra_seconds`):
what it computes again (a checkpointed block's forward, the attention's forward under ``recompute_attention``, a tiled
MLP's forward, a regenerated segment), and the copies to the host or the disk that the compute beside them does not
hide (:func:`exposed_copy_seconds`, with the measured overlap). FSDP2's all-gathers and reduce-scatters run beside the
compute and are not counted.

The network between hosts (:func:`network_seconds`): a sequence-parallel group spanning hosts pays what its traffic
between hosts adds: the bytes of the Ulysses all-to-alls that leave the host go over the network instead of NVLink, and
the ring's K/V passes go over the network when the ring crosses hosts, over NVLink otherwise, where they outlast the
ring's blocks they overlap with. On one host none of it applies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from lightning_fpdt.planner.components import loss_tile_tokens, mlp_tile_tokens
from lightning_fpdt.planner.geometry import OPTIMIZER_STATES, attention_geometry
from lightning_fpdt.planner.rates import INTER_HOST_BYTES, NVLINK_BYTES
from lightning_fpdt.planner.step_sizes import StepSizes
from lightning_fpdt.sequence.planning import MAX_CHUNK_TOKENS, grouped_geometry, rank_heads

FORWARD = ("forward",)
BACKWARD = ("input_grad", "weight_grad")
"""The GEMMs of a linear layer's backward: ``dX = dY·W`` and ``dW = dYᵀ·X``."""
ELEMENTWISE_WIDTHS = {"norms": 4, "residual adds": 6}
"""Hidden-sized elements one layer's forward reads and writes per token beside the RoPE and SwiGLU terms: two RMSNorms
(each reads its input and writes its output) and two residual adds (each reads two, writes one). RoPE moves q and k
twice, SwiGLU reads gate and up and writes their product; a backward moves twice its forward."""
MERGE_BYTES = 10
"""Bytes per element of a q chunk each merge of a block's partial output moves (the fp32 running output read and
written, the block's bf16 output read)."""
LOSS_BYTES_PER_LOGIT = 12
"""Bytes per logit the loss moves beside its GEMMs: the fp32 softmax's pass over the logits forward, and its gradient
written in bf16 (fused per tile, ``lightning_fpdt.fused.ops``)."""


def optimizer_bytes(optimizer: str) -> int:
    """Bytes per parameter an optimizer's fused step moves in fp32: the parameter and its gradient read, the parameter
    written, each state read and written (AdamW: 28)."""
    return 4 * (3 + 2 * OPTIMIZER_STATES[optimizer])


@dataclass(frozen=True)
class Gemm:
    """The GEMMs of one linear layer in a step, as many calls of ``call_rows`` rows as make ``rows``."""

    name: str
    rows: int
    inner: int
    cols: int
    call_rows: int

    @property
    def flops(self) -> float:
        return 2.0 * self.rows * self.inner * self.cols


def attention_gemms(s: StepSizes, *, groups: Optional[int] = None) -> list[Gemm]:
    """One layer's q, k, v and o projections over the GPU's ``N`` tokens; with head groups each group's are its own
    GEMMs, ``1/G`` as wide."""
    g, N = s.g, s.N
    G = s.G if groups is None else groups
    q, kv = g.num_heads * g.head_dim // G, g.num_kv_heads * g.head_dim // G
    h = g.hidden_size
    return [Gemm("q", N * G, h, q, N), Gemm("k", N * G, h, kv, N), Gemm("v", N * G, h, kv, N),
            Gemm("o", N * G, q, h, N)]


def mlp_gemms(s: StepSizes) -> list[Gemm]:
    """One layer's gate, up and down GEMMs: every token through ``experts_per_token`` MLPs, each call a tile's rows
    when tiled (an expert's share of the tokens with experts)."""
    g = s.g
    rows = s.N * g.experts_per_token
    call = rows // g.num_experts if g.num_experts > 1 else rows
    if s.o.tiled_mlp:
        call = min(call, mlp_tile_tokens(s.N, g.intermediate_size, s.b))
    h, inner = g.hidden_size, g.intermediate_size
    return [Gemm("gate", rows, h, inner, call), Gemm("up", rows, h, inner, call), Gemm("down", rows, inner, h, call)]


def head_gemm(s: StepSizes) -> Gemm:
    """The lm_head over the GPU's tokens, a loss tile's rows a call when the loss is tiled."""
    g = s.g
    call = loss_tile_tokens(s.N, g.vocab_size) if s.o.tiled_loss else s.N
    return Gemm("lm_head", s.N, g.hidden_size, g.vocab_size, call)


def gemm_seconds(s: StepSizes, gemms: list[Gemm], kinds: tuple[str, ...]) -> float:
    """The ``kinds`` GEMMs of ``gemms`` at the rates of their shapes."""
    return sum(gemm.flops / s.rates.gemm_flops(kind, gemm.call_rows, gemm.inner, gemm.cols)
               for gemm in gemms for kind in kinds)


def elementwise_forward_bytes(s: StepSizes, *, attention: bool = True, mlp: bool = True) -> float:
    """Bytes one layer's forward moves in its memory-bound ops (:data:`ELEMENTWISE_WIDTHS`)."""
    g = s.g
    per_token = (sum(ELEMENTWISE_WIDTHS.values()) * g.hidden_size + 2 * (g.num_heads + g.num_kv_heads) * g.head_dim
                 if attention else 0)
    per_token += 3 * g.intermediate_size * g.experts_per_token if mlp else 0
    return s.N * s.b * per_token


def elementwise_seconds(s: StepSizes, nbytes: float) -> float:
    return nbytes / s.rates.elementwise_bytes


def block_forward_seconds(s: StepSizes) -> float:
    """One block's forward but its attention kernels: its GEMMs and its elementwise ops."""
    return (gemm_seconds(s, attention_gemms(s) + mlp_gemms(s), FORWARD)
            + elementwise_seconds(s, elementwise_forward_bytes(s)))


def block_backward_seconds(s: StepSizes) -> float:
    """One block's backward but its attention kernels."""
    return (gemm_seconds(s, attention_gemms(s) + mlp_gemms(s), BACKWARD)
            + elementwise_seconds(s, 2 * elementwise_forward_bytes(s)))


def mlp_forward_seconds(s: StepSizes) -> float:
    """One layer's MLP forward: its GEMMs and SwiGLU."""
    return gemm_seconds(s, mlp_gemms(s), FORWARD) + elementwise_seconds(s, elementwise_forward_bytes(
        s, attention=False))


def attention_blocks(s: StepSizes, *, chunks: Optional[int] = None,
                     groups: Optional[int] = None) -> list[tuple[int, dict[str, Any]]]:
    """One layer's attention blocks on the busiest rank, for one head group: ``(count, shape)`` of its causal diagonal
    blocks and of its full ones (the FPDT schedule of ``u`` chunks, a ring's ``R`` shares: ``u·R`` pieces of
    ``S/(u·R)`` tokens), each shape the keywords of :meth:`StepRates.attention_seconds` but its kind. ``chunks``,
    ``groups``: instead of the plan's."""
    u = s.o.chunks if chunks is None else chunks
    G = s.G if groups is None else groups
    heads, kv_heads = rank_heads(grouped_geometry(attention_geometry(s.g, s.b), G), s.P // s.o.ring_size)
    pieces = u * s.o.ring_size
    shape = dict(batch=s.batch_size, heads=heads, kv_heads=kv_heads, tokens=max(1, s.seq_len // pieces),
                 head_dim=s.g.head_dim)
    return [(pieces, dict(shape, causal=True)), (pieces * (pieces - 1) // 2, dict(shape, causal=False))]


def layer_attention_seconds(s: StepSizes, kind: str, *, chunks: Optional[int] = None,
                            groups: Optional[int] = None) -> float:
    """One layer's attention ``kind`` (``forward`` or ``backward``) on the busiest rank: its blocks
    (:func:`attention_blocks`; a ring's rank computes ``1/R`` of them), each group of heads in turn, and the partial
    outputs' merges. ``chunks``, ``groups``: instead of the plan's."""
    u = s.o.chunks if chunks is None else chunks
    G = s.G if groups is None else groups
    g = s.g
    key = ("layer attention", kind, u, G, s.o.ring_size, s.P, s.b, s.batch_size, s.seq_len, g.num_heads,
           g.num_kv_heads, g.head_dim)
    return s.rates.remembered(key, lambda: _layer_attention_seconds(s, kind, u, G))


def _layer_attention_seconds(s: StepSizes, kind: str, u: int, G: int) -> float:  # noqa: N803 (the sheet's symbol)
    blocks = attention_blocks(s, chunks=u, groups=G)
    seconds = sum(count * s.rates.attention_seconds(kind, **shape) for count, shape in blocks if count)
    count, full = blocks[1]
    merges = count * MERGE_BYTES * full["batch"] * full["tokens"] * full["heads"] * full["head_dim"]
    return G * (seconds + elementwise_seconds(s, merges)) / s.o.ring_size


def fewest_chunks(s: StepSizes) -> int:
    """The chunks the attention runs fastest with: the fewest ``"auto"`` starts from (1 with a ring)."""
    return 1 if s.o.ring_size > 1 else max(1, math.ceil(s.seq_len / MAX_CHUNK_TOKENS))


def attention_seconds(s: StepSizes, *, chunks: Optional[int] = None, groups: Optional[int] = None) -> float:
    """Every layer's attention forward and backward (the plan's chunks and head groups unless given)."""
    return s.L * sum(layer_attention_seconds(s, kind, chunks=chunks, groups=groups) for kind in ("forward",
                                                                                                   "backward"))


def attention_forward_seconds(s: StepSizes) -> float:
    """Every layer's attention forward, as the plan runs it."""
    return s.L * layer_attention_seconds(s, "forward")


def all_to_all_seconds(s: StepSizes) -> float:
    """The Ulysses all-to-alls at the measured rate; 0 where the rates count them in the attention's."""
    rate = s.rates.all_to_all_bytes
    return ulysses_all_to_all_bytes(s) / rate if rate else 0.0


def loss_seconds(s: StepSizes) -> float:
    """The lm_head's GEMMs, forward and backward, and the logits' elementwise work."""
    head = head_gemm(s)
    return gemm_seconds(s, [head], FORWARD + BACKWARD) + elementwise_seconds(
        s, LOSS_BYTES_PER_LOGIT * s.N * s.g.vocab_size)


def optimizer_seconds(s: StepSizes) -> float:
    """The optimizer's step on the GPU over its shard of the trainable parameters (on the host: the host states')."""
    if s.o.cpu_offload_params:
        return 0.0
    return elementwise_seconds(s, optimizer_bytes(s.o.optimizer) * s.trainable_parameters / s.W)


def base_parts(s: StepSizes) -> list[tuple[str, float]]:
    """What every configuration computes, part by part (the module docstring)."""
    gemms = attention_gemms(s, groups=1) + mlp_gemms(s)
    return [
        ("dense layers: q, k, v, o, gate, up, down GEMMs, forward and backward",
         s.L * gemm_seconds(s, gemms, FORWARD + BACKWARD)),
        ("attention kernels, forward and backward" + (", and the all-to-alls" if s.rates.all_to_all_bytes else ""),
         attention_seconds(s, chunks=fewest_chunks(s), groups=1) + all_to_all_seconds(s)),
        ("norms, RoPE, SwiGLU, residual adds", s.L * elementwise_seconds(s, 3 * elementwise_forward_bytes(s))),
        ("lm_head and loss", loss_seconds(s)),
        ("optimizer step", optimizer_seconds(s)),
    ]


def base_seconds(s: StepSizes) -> float:
    """What every configuration computes (:func:`base_parts`)."""
    return sum(seconds for _, seconds in base_parts(s))


def compute_seconds(s: StepSizes) -> float:
    """The step's compute beside which its copies run: every layer's forward and backward and the attention."""
    return s.L * (block_forward_seconds(s) + block_backward_seconds(s)) + attention_seconds(s)


def copy_seconds(s: StepSizes, nbytes: float) -> float:
    """Page-locked copies of ``nbytes`` between host and device, alone."""
    return nbytes / s.rates.copy_bytes


def exposed_copy_seconds(s: StepSizes, nbytes: float, beside: float) -> float:
    """What copies of ``nbytes`` add to a step where ``beside`` seconds of compute run next to them: the share the
    measured overlap leaves, or all that outlasts the compute."""
    copies = copy_seconds(s, nbytes)
    return max(copies - beside, copies * (1 - s.rates.copy_overlap))


def link_rate(s: StepSizes, *, crosses_hosts: bool) -> float:
    """Bytes per second of one GPU's transfers: the run's inter-host rate when they cross hosts, inside a host the
    measured all-to-all rate, else NVLink's."""
    return s.inter_host_rate if crosses_hosts else (s.rates.all_to_all_bytes or NVLINK_BYTES)


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
    """What the bytes of :func:`ulysses_leaving_bytes` add: they go at the inter-host rate instead of NVLink's
    (negative for a network faster than NVLink, an NVLink domain spanning hosts)."""
    leaving = ulysses_leaving_bytes(s)
    return leaving / s.inter_host_rate - leaving / link_rate(s, crosses_hosts=False) if leaving else 0.0


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
