"""What one training step holds in memory, part by part: the formulas of the planner.

This is a model, not a measurement. Notation (per GPU): ``W`` GPUs (FSDP2 shards over all of them), ``P`` sequence
parallel size, ``N = B·S/P`` local tokens (``S`` padded to a multiple of ``P·u``), ``h`` hidden size, ``I`` MLP width,
``V`` vocabulary, ``L`` layers, ``H``/``Hkv`` heads of width ``D``, ``b`` bytes of an activation (2 in bf16),
``A = N·h·b`` one hidden-state tensor, ``n`` tokens of one MLP or loss tile. Parameter counts: ``Θ`` all,
``Θ_block`` one block, ``Θ_rest`` the rest (embedding, lm_head unless tied, final norm: FSDP2's root unit).

Persistent (held through the step)::

    parameters    = master·Θ/W                                sharded master
    gradients     = grad·L·Θ_block/W                          the blocks' shards (the root's: see the phases)
    optimizer     = 2·master·Θ/W                              AdamW's two moments

Gradients and optimizer states exist for the trainable parameters only: with ``trainable_parameters`` given (LoRA's
adapters, frozen parts), ``Θ_train`` spread over the blocks first takes ``Θ``'s place in those terms (and in the
gradient terms of the phases below), ``Θ_block`` becomes ``min(Θ_block, Θ_train/L)`` and ``Θ_rest`` what remains.
    checkpoints   = min(2, L)·A (ActivationOffload: current + prefetched; L·A on the host) | L·A (checkpointing on
                    the GPU) | L·(A + layer activations) (no checkpointing); with keep_inputs=k, (k + ⌈L/k⌉ - 1)·A
                    instead of L·A (the kept inputs and the largest segment regenerated at once)
    attention     = L·(stash_bytes + kept out) on the GPU, or on the host when offloaded  (planning.stash_bytes;
                    "kept out" = N·H·D·b per layer under checkpointing or head_chunks > 1: the attention is not
                    recomputed)

Transient phases (one at a time; the largest counts). Parts of the states exist in some phases only: the root unit
gathered (param·Θ_rest; FSDP2 keeps it unsharded from the forward's start to its post-backward) in every phase but
the end of the backward; the current and prefetched block, gathered (2·param·Θ_block), in the attention forward and
both backward phases; in the loss the output of the forward's last all-gather (param·Θ_block, freed at the root's
post-forward; on one GPU none); one block's unsharded gradients and their reduce-scatter copy
(Θ_block·(param + reduce)) and the lm_head gradient (V·h·b) in the backward phases; the root unit's sharded gradients
(grad·Θ_rest/W) from its reduce-scatter at the end of the backward until Lightning's ``zero_grad``, which runs after
the next step's forward and loss, and for the same reason the shard of the block whose backward comes first
(grad·Θ_block/W) outside the two backward phases. With
``accumulate_grad_batches > 1`` the batches before a window's last skip the reduce-scatter: every parameter's
unsharded gradient, reduce·Θ, in every phase instead of the shards::

    attention forward  = norm + q, k, v, out + planning.working_set_bytes
                         head_chunks G > 1: norm + A (the output sum) + (q, k, v, out)/G + one group's working set
    MLP backward       = layer activations + 2·A + MLP work    (untiled 2·N·I·b more; tiled 6·n·I·b)
    attention backward = norm + rope (+ out when the attention is recomputed) + A + N·H·D·b (+ A under
                         checkpointing) + N·(H + 2·Hkv)·D·b + attention_backward_bytes
                                                           (grads of the residual and of the attention output, a
                                                           hidden-sized output of the block's recompute, dq, dk,
                                                           dv, the FPDT backward's chunks)
                         G > 1: 2·A (output grad, the running input grad, which each group's projections add
                         into in place) + (out-sized dout and rotated dq, dq, dk, dv)/G + one group's backward
                         chunks; the groups' outputs count as kept outputs, and no layer saves out or RoPE
    loss               = final norm + tiled: A + V·h·4 + 8·n·V  |  untiled: 12·N·V (fp32 logits, log-softmax, grad)
    end of backward    = max(param·Θ_rest + V·h·b, Θ_rest·reduce·(1 + 1/W))   (the embedding's backward beside the
                         gathered root; the root unit's reduce-scatter, the gathered root and its unsharded gradients
                         freed)

    norm               = A + N·4                                (the tiled RMSNorm's output and fp32 rstd)
    layer activations  = 2 norms + A (the residual between them) + rope + out unless kept + MLP (untiled 4·N·I·b)
                         + per-head norms of q and k (Qwen3): N·(H + Hkv)·(D·b + 4), their inputs and fp32 rstd,
                         also at the attention backward (G > 1: a group's share there, none in the layer)

    predicted peak per GPU = Σ persistent + max(transient phases)
    pinned host per host   = GPUs per node × (offloaded attention: L·(stash_bytes + kept out) + one layer's dout and out
                             (+ fp32 partial dQ) + offloaded block inputs L·A (or (k + ⌈L/k⌉ - 1)·A) + CPU-offloaded
                             parameters,
                             gradients and optimizer states)

With a ring (``ring_size = R > 1``, docs/ring.md) the attention terms use the Ulysses size ``U = P/R`` for the heads
and the ring rank's share ``S/R`` for the chunk (``planning``), the backward adds the ring's second kv share and
second fp32 dK/dV accumulator in flight, chunks are 1, and ``offload`` moves the shares to the host (no partial dQ).

Calibrated against steps traced with bench/memory_trace.py (docs/planner.md): ten runs of the Llama-3-8B geometry
on H100s, 64K to 4M tokens on 1 and 4 GPUs, with and without states on the host, head groups and attention
recompute, each predicted 0-9% above its measured peak. It counts tensors, not the caching allocator's fragmentation,
the CUDA context, NCCL buffers or cuBLAS workspaces: keep a few GiB of headroom.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Literal, Optional

from lightning_fpdt.flops import ModelGeometry
from lightning_fpdt.memory.tiling import auto_loss_tiles, auto_mlp_tiles
from lightning_fpdt.planner.plan_options import PlanOptions
from lightning_fpdt.planner.rates import BUILTIN_RATES, INTER_HOST_BYTES, StepRates
from lightning_fpdt.sequence.planning import AttentionGeometry, rank_heads, stash_bytes

GIB = 2**30
GPU_CONTEXT_BYTES = 2**30
"""GPU memory a plan leaves to what it does not count: the CUDA context, cuBLAS and NCCL workspaces."""
FRAGMENTATION_FRACTION = 0.05
"""Share of the GPU a plan leaves to the caching allocator's fragmentation: blocks reserved but too small for the next
multi-GiB tensor (4.65 GiB of an H100's 79 at 524,288 tokens of a full-depth 3B model, where the plan had counted
within 1 GiB of the card); 1% with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, which maps memory as it
grows instead."""


def plannable_gpu_bytes(usable_bytes: int, *, expandable_segments: bool = False) -> int:
    """The GPU memory a plan may fill on a GPU of ``usable_bytes``: less the CUDA context and the fragmentation."""
    fragmentation = 0.01 if expandable_segments else FRAGMENTATION_FRACTION
    return int(usable_bytes * (1 - fragmentation)) - GPU_CONTEXT_BYTES


def expandable_segments() -> bool:
    """Whether this process's CUDA allocator grows its segments (``expandable_segments:True``)."""
    config = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in config.replace(" ", "").lower()

MLP_BACKWARD_BUFFERS = 6
"""``intermediate``-wide buffers per token at the peak of a gated MLP's backward: gate, up, act(gate) (saved), the
product's gradient and the gradients of act(gate) and up. 4 of them are saved by the forward. Checked against
bench/memory_tiles.py: the untiled MLP at 256K tokens needs 5.7 per token, the tiled one 6.6 per tile token."""
UNTILED_LOSS_BYTES_PER_LOGIT = 12
"""fp32 logits, the saved log-softmax and its gradient at the peak of the untiled cross-entropy's backward."""
LOSS_TILE_BYTES_PER_LOGIT = 8
"""One loss tile: its fp32 logits (turned into the gradient in place) and logsumexp's fp32 temporary of the same size
(the bf16 matmul output and the gradient's bf16 copy are smaller and not alive with both). bench/memory_tiles.py on
an H100: 8.0 bytes per tile logit at 16K and at 512K tokens."""
MLP_GRAD_SUM_BYTES = 4
"""``TiledMLP`` sums each weight's gradient over the tiles in fp32 (``tiled_mlp_backward``): bytes per weight."""

@dataclass(frozen=True)
class Component:
    """One part of the memory of a step."""

    name: str
    gpu_bytes: int
    """Bytes on each GPU."""
    host_bytes: int = 0
    """Pinned host bytes for each GPU (multiply by the GPUs of a host)."""
    phase: Optional[str] = None
    """``None``: held through the backward; else the transient phase it belongs to."""
    formula: str = ""
    """How it is counted, in short."""
    pageable_bytes: int = 0
    """Host bytes for each GPU that are resident but not pinned (optimizer states stepped on the host, the process's
    own baseline)."""
    disk_bytes: int = 0
    """Bytes for each GPU in files of the disk tier (``FPDTStrategy(offload_dir=...)``; multiply by the GPUs of a
    host: they share its disk)."""


@dataclass(frozen=True)
class MemoryPlan:
    """Predicted memory of one training step, per GPU and per host (see the module docstring for the model)."""

    model: str
    geometry: ModelGeometry
    seq_len: int
    padded_seq_len: int
    batch_size: int
    num_gpus: int
    gpus_per_node: int
    options: PlanOptions
    components: tuple[Component, ...]
    gpu_memory_bytes: int
    host_memory_bytes: Optional[int]
    """Memory the processes of one host may hold (pinned and pageable); ``None``: not checked."""
    disk_memory_bytes: Optional[int] = None
    """Free space of the disk tier's directory on one host; ``None``: no disk tier (a plan with disk bytes does not
    fit)."""
    disk_bytes_per_second: float = 0.0
    """The disk's read and write rate per host the plan was made with (its disk tier's time)."""
    inter_host_bytes_per_second: float = INTER_HOST_BYTES
    """The rate one GPU sends to other hosts at, the plan was made with (the network's time)."""
    layouts: tuple[tuple[int, Optional[float]], ...] = field(default=(), compare=False)
    """``(ring_size, seconds)`` of each layout the search compared for a group spanning hosts: the step-time estimate
    of the fastest plan that fits with that ring (``None``: none fits); empty where the layout was not searched."""
    recommended: Optional["MemoryPlan"] = field(default=None, compare=False)
    """A plan that fits, found by the search in :data:`SEARCH_ORDER` (``None`` if this one fits or none was found)."""
    recommendation: str = ""
    """What to change, in words."""
    rates: StepRates = field(default=BUILTIN_RATES, compare=False)
    """The rates its step was timed at (:mod:`lightning_fpdt.planner.cost`)."""

    def component(self, name: str) -> Component:
        """The component called ``name``."""
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"no component {name!r}; the plan has {[c.name for c in self.components]}")

    @property
    def local_tokens(self) -> int:
        return self.batch_size * self.padded_seq_len // self.options.sequence_parallel_size

    @property
    def persistent_gpu_bytes(self) -> int:
        return sum(c.gpu_bytes for c in self.components if c.phase is None)

    @property
    def phase_bytes(self) -> dict[str, int]:
        """GPU bytes of each transient phase."""
        phases: dict[str, int] = {}
        for c in self.components:
            if c.phase is not None:
                phases[c.phase] = phases.get(c.phase, 0) + c.gpu_bytes
        return phases

    @property
    def peak_phase(self) -> str:
        phases = self.phase_bytes
        return max(phases, key=phases.__getitem__)

    @property
    def peak_gpu_bytes(self) -> int:
        """Σ persistent + the largest transient phase."""
        return self.persistent_gpu_bytes + max(self.phase_bytes.values())

    @property
    def host_bytes_per_gpu(self) -> int:
        """Pinned host bytes of one GPU's process."""
        return sum(c.host_bytes for c in self.components)

    @property
    def host_bytes_per_node(self) -> int:
        """Pinned host bytes of one host."""
        return self.host_bytes_per_gpu * self.gpus_per_node

    @property
    def host_resident_bytes_per_gpu(self) -> int:
        """All host memory one GPU's process holds at the step's peak: pinned, pageable and its baseline."""
        return sum(c.host_bytes + c.pageable_bytes for c in self.components)

    @property
    def host_resident_bytes_per_node(self) -> int:
        """All host memory the processes of one host hold at the step's peak: what is checked against the host."""
        return self.host_resident_bytes_per_gpu * self.gpus_per_node

    @property
    def disk_bytes_per_gpu(self) -> int:
        """Bytes of one GPU's process in files of the disk tier."""
        return sum(c.disk_bytes for c in self.components)

    @property
    def disk_bytes_per_node(self) -> int:
        """Bytes of the processes of one host in files of the disk tier: what is checked against its free space."""
        return self.disk_bytes_per_gpu * self.gpus_per_node

    @property
    def fits_gpu(self) -> bool:
        return self.peak_gpu_bytes <= self.gpu_memory_bytes

    @property
    def fits_disk(self) -> bool:
        return self.disk_bytes_per_node == 0 or (self.disk_memory_bytes is not None
                                                 and self.disk_bytes_per_node <= self.disk_memory_bytes)

    @property
    def fits_host(self) -> bool:
        return self.host_memory_bytes is None or self.host_resident_bytes_per_node <= self.host_memory_bytes

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host and self.fits_disk

    @property
    def binding_limit(self) -> Literal["gpu memory", "host memory", "disk space", "fits"]:
        """The limit exceeded (by the largest ratio when several are), or ``"fits"``."""
        gpu_ratio = self.peak_gpu_bytes / self.gpu_memory_bytes
        host_ratio = self.host_resident_bytes_per_node / self.host_memory_bytes if self.host_memory_bytes else 0.0
        disk_ratio = 0.0
        if self.disk_bytes_per_node:
            disk_ratio = self.disk_bytes_per_node / self.disk_memory_bytes if self.disk_memory_bytes else math.inf
        if max(gpu_ratio, host_ratio, disk_ratio) <= 1:
            return "fits"
        if gpu_ratio >= max(host_ratio, disk_ratio):
            return "gpu memory"
        return "host memory" if host_ratio >= disk_ratio else "disk space"

    @property
    def largest_component(self) -> Component:
        """The largest host (disk) component when host memory (disk space) binds, else the largest part of the GPU
        peak (a persistent component or one of the largest phase): what to shrink first."""
        if self.binding_limit == "host memory":
            return max(self.components, key=lambda c: c.host_bytes + c.pageable_bytes)
        if self.binding_limit == "disk space":
            return max(self.components, key=lambda c: c.disk_bytes)
        at_peak = [c for c in self.components if c.phase in (None, self.peak_phase)]
        return max(at_peak, key=lambda c: c.gpu_bytes)


# ---- component formulas --------------------------------------------------------------------------------------
def attention_backward_bytes(
    geometry: AttentionGeometry, *, batch_size: int, seq_len: int, sp_size: int, num_chunks: int, offload: bool,
    offload_dq: bool, ring_size: int = 1,
) -> int:
    """GPU bytes of the FPDT backward of one layer beyond its inputs and outputs (``fpdt_backward``).

    Per chunk of ``C = B·S/u`` tokens after the all-to-all (``h = H/P``, ``hk = max(Hkv, P)/P`` heads), when
    offloaded: the q side (q, out, dout + fp32 lse) of three chunks (the one computing, the one prefetched, and the
    previous one, released but not reusable yet: allocated on the copy stream, it waits for the compute stream to
    finish reading it) and two kv pairs; the kernel's kv expanded to ``h`` heads (GQA), its ``dq, dk, dv`` and an
    fp32 dQ accumulator (flash attention's backward keeps one; assumed of cuDNN's too); the fp32 ``dK, dV``
    accumulators; the fp32 partial dQ of three chunks (``offload_dq``) or, on the device, of the ``u - 1`` chunks
    before the one in the kernel. Without offload the chunks are in the stash (counted there) and every ``dout`` and
    ``out`` chunk joins them on the device. Against bench/attention.py this is 1–4% low; without the third chunk
    generations it would be 20% low.

    With a ring (``ring_size > 1``; ``u = 1``, no offload) the chunk is the ring rank's share ``B·S/R`` with
    ``h = H/U``, ``hk = max(Hkv, U)/U`` heads, and the kv share and fp32 dK/dV accumulator arriving from the previous
    ring rank are live next to the own ones (``ring_backward``). The ring's terms have no GPU measurement behind them.
    """
    g, b = geometry, geometry.dtype_bytes
    ulysses = sp_size // ring_size
    chunk = batch_size * math.ceil(seq_len / (num_chunks * ring_size))  # C (with a ring: the share)
    heads, kv_heads = rank_heads(g, ulysses)  # the busiest rank's: ⌈H/U⌉ when U does not divide the heads
    q_chunk, kv_chunk = chunk * heads * g.head_dim, chunk * kv_heads * g.head_dim  # elements
    local_q = batch_size * seq_len // sp_size * heads * ulysses * g.head_dim  # all local q elements, head-sharded
    q_side = 3 * q_chunk * b + chunk * heads * 4
    kernel = (2 * q_chunk * b if heads > kv_heads else 0) + 3 * q_chunk * b + 4 * q_chunk
    kv_acc = 2 * kv_chunk * 4
    if offload:
        chunks = min(3, num_chunks) * q_side + min(2, num_chunks) * 2 * kv_chunk * b
    else:
        chunks = (2 if ring_size == 1 else 1) * local_q * b  # dout (and out: FPDT all-to-alls it in backward)
    # the partial dQ sums of the chunks before the one in the kernel (the kernel's own fp32 accumulator, counted in
    # `kernel`, has the size of the sum the chunk's result becomes)
    if offload_dq:
        partial_dq = min(3, num_chunks) * 4 * q_chunk
    else:  # the ring keeps its share's fp32 dQ sum for all its steps
        partial_dq = 4 * local_q if ring_size > 1 else (num_chunks - 1) * 4 * q_chunk
    ring_in_flight = 2 * kv_chunk * b + kv_acc if ring_size > 1 else 0  # the next kv share and dK/dV accumulator
    return chunks + partial_dq + kernel + kv_acc + ring_in_flight


def attention_host_bytes(
    geometry: AttentionGeometry, *, batch_size: int, seq_len: int, sp_size: int, offload: bool, offload_dq: bool,
    kept_out_layers: int = 0, ring_size: int = 1,
) -> int:
    """Pinned host bytes of the FPDT stash pool for one GPU: every layer's chunks (``stash_bytes``), the attention
    outputs kept for checkpoint recomputes (``kept_out_layers`` of them), one layer's ``dout`` and ``out`` chunks
    (all-to-all'd in its backward) and fp32 partial dQ sums (the pool reuses buffers across layers)."""
    g, b = geometry, geometry.dtype_bytes
    local_q = batch_size * seq_len // sp_size * g.num_heads * g.head_dim  # a sequence-sharded output
    ulysses = sp_size // ring_size
    heads_q = batch_size * seq_len // sp_size * rank_heads(g, ulysses)[0] * ulysses * g.head_dim  # head-sharded
    host = 0
    if offload:
        host += g.num_layers * stash_bytes(g, batch_size=batch_size, seq_len=seq_len, sp_size=sp_size,
                                           ring_size=ring_size)
        # kept outputs + one layer's dout (and out chunks: FPDT all-to-alls them in backward; the ring stashed its own)
        host += kept_out_layers * local_q * b + (2 if ring_size == 1 else 1) * heads_q * b
    if offload_dq:
        host += 4 * heads_q
    return host


def mlp_tile_tokens(num_tokens: int, intermediate_size: int, dtype_bytes: int) -> int:
    """Tokens of one ``TiledMLP(num_tiles="auto")`` tile (the transform's own rule)."""
    return math.ceil(num_tokens / auto_mlp_tiles(num_tokens, intermediate_size, dtype_bytes))


def loss_tile_tokens(num_tokens: int, vocab_size: int) -> int:
    """Tokens of one ``TiledLoss(num_tiles="auto")`` tile (the transform's own rule)."""
    return math.ceil(num_tokens / auto_loss_tiles(num_tokens, vocab_size))


def mlp_op_bytes(
    num_tokens: int, hidden_size: int, intermediate_size: int, *, tiled: bool, dtype_bytes: int = 2
) -> int:
    """Peak bytes of one gated MLP's forward + backward beyond its input and output gradient (bench/memory_tiles.py's
    "peak"): output, input gradient, weight gradients and the intermediates (all tokens, or one tile)."""
    rows = mlp_tile_tokens(num_tokens, intermediate_size, dtype_bytes) if tiled else num_tokens
    io = 2 * num_tokens * hidden_size * dtype_bytes + 3 * hidden_size * intermediate_size * dtype_bytes
    sums = 3 * hidden_size * intermediate_size * MLP_GRAD_SUM_BYTES if tiled else 0
    return io + sums + MLP_BACKWARD_BUFFERS * rows * intermediate_size * dtype_bytes


def loss_op_bytes(num_tokens: int, hidden_size: int, vocab_size: int, *, tiled: bool, dtype_bytes: int = 2) -> int:
    """Peak bytes of the causal-LM loss's forward + backward beyond its inputs (bench/memory_tiles.py's "peak").

    Tiled: the hidden-state gradient, the fp32 lm_head gradient accumulator and the larger of one tile's logits and
    the lm_head gradient returned in the weight's dtype. Untiled: fp32 logits, log-softmax and gradient."""
    if not tiled:
        return UNTILED_LOSS_BYTES_PER_LOGIT * num_tokens * vocab_size
    tile = LOSS_TILE_BYTES_PER_LOGIT * loss_tile_tokens(num_tokens, vocab_size) * vocab_size
    grads = num_tokens * hidden_size * dtype_bytes + vocab_size * hidden_size * 4
    return grads + max(tile, vocab_size * hidden_size * dtype_bytes)
