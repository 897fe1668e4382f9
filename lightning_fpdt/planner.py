"""The memory planner: will a long-context run fit, which limit binds, what makes it fit (``lightning-fpdt plan``).

    python -m lightning_fpdt.planner --model llama3-8b --seq-len 1048576 --gpus 8 --callbacks all
    lightning-fpdt plan --model path/to/config.json --seq-len 524288 --gpus 4 --host-memory-gib 1000

:func:`plan_memory` predicts, per GPU and per host, the bytes of each part of one training step; :func:`format_plan`
prints them; :func:`check_host_memory` is what the strategy runs before any pinned buffer exists. No Lightning import
of its own: the attention sizes come from :mod:`lightning_fpdt.sequence.planning` (which ``chunks="auto"`` and
``offload="auto"`` use too); the callbacks' tile rules and the strategy's mesh sizes are imported where used.

This is a model, not a measurement. Notation (per GPU): ``W`` GPUs (FSDP2 shards over all of them), ``P`` sequence
parallel size, ``N = B·S/P`` local tokens (``S`` padded to a multiple of ``P·u``), ``h`` hidden size, ``I`` MLP width,
``V`` vocabulary, ``L`` layers, ``H``/``Hkv`` heads of width ``D``, ``b`` bytes of an activation (2 in bf16),
``A = N·h·b`` one hidden-state tensor, ``n`` tokens of one MLP or loss tile. Parameter counts: ``Θ`` all,
``Θ_block`` one block, ``Θ_rest`` the rest (embedding, lm_head unless tied, final norm: FSDP2's root unit).

Persistent (held through the backward)::

    parameters    = master·Θ/W + param·(Θ_rest + 2·Θ_block)   sharded master; gathered root unit (FSDP2 keeps the root
                                                              unsharded from forward to backward) + current and
                                                              prefetched block
    gradients     = grad·Θ/W + Θ_block·(param + reduce)       sharded; one block's unsharded grads + its reduce-scatter
                                                              copy in the reduce dtype
    optimizer     = 2·master·Θ/W                              AdamW's two moments
    checkpoints   = 2·A (ActivationOffload: current + prefetched; L·A on the host) | L·A (checkpointing on the GPU)
                    | L·(A + layer activations) (no checkpointing)
    attention     = L·(stash_bytes + kept out) on the GPU, or on the host when offloaded  (planning.stash_bytes;
                    "kept out" = N·H·D·b per layer under checkpointing or head_chunks > 1: the attention is not
                    recomputed)
    lm_head grad  = V·h·b                                     unsharded, from the loss until the root's reduce-scatter

Transient phases (one at a time; the largest counts)::

    attention forward  = norm + q, k, v, out + planning.working_set_bytes
                         head_chunks G > 1: norm + A (the output sum) + (q, k, v, out)/G + one group's working set
    MLP backward       = layer activations + 2·A + MLP work    (untiled 2·N·I·b more; tiled 6·n·I·b)
    attention backward = norm + rope + A + N·H·D·b + N·(H + 2·Hkv)·D·b + attention_backward_bytes
                                                           (grads of the residual and of the attention output,
                                                           dq, dk, dv, the FPDT backward's chunks)
                         G > 1: 2·A (output grad, the running input grad, which each group's projections add
                         into in place) + (out-sized dout and rotated dq, dq, dk, dv)/G + one group's backward
                         chunks; the groups' outputs count as kept outputs, and no layer saves out or RoPE
    loss               = final norm + tiled: A + V·h·4 + 6·n·V  |  untiled: 12·N·V (fp32 logits, log-softmax, grad)
    end of backward    = V·h·b (embedding grad) + Θ_rest·reduce·(1 + 1/W)   (the root unit's reduce-scatter)

    layer activations  = 2 norms × (N·h·4 + 2·A) + out N·H·D·b + block output A + rope + MLP (untiled 4·N·I·b)

    predicted peak per GPU = Σ persistent + max(transient phases)
    pinned host per host   = GPUs per node × (offloaded attention: L·(stash_bytes + kept out) + one layer's dout and out
                             (+ fp32 partial dQ) + offloaded block inputs L·A + CPU-offloaded parameters,
                             gradients and optimizer states)

With a ring (``ring_size = R > 1``, docs/ring.md) the attention terms use the Ulysses size ``U = P/R`` for the heads
and the ring rank's share ``S/R`` for the chunk (``planning``), the backward adds the ring's second kv share and
second fp32 dK/dV accumulator in flight, chunks are 1, and ``offload`` moves the shares to the host (no partial dQ).

Calibrated against docs/benchmarks.md (see docs/planner.md): the FPDT op alone, the tiled loss and MLP alone, and
three 4-GPU training runs of the Llama-3-8B geometry, each within 15%. It counts tensors, not the caching allocator's
fragmentation, the CUDA context, NCCL buffers or cuBLAS workspaces: keep a few GiB of headroom. Where phases overlap
only in part (the lm_head gradient does not exist yet during the loss) it counts them fully: it errs high.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal, Optional, Union

from lightning_fpdt.flops import ModelGeometry
from lightning_fpdt.models.llama import NAMED_CONFIGS, LlamaConfig
from lightning_fpdt.sequence.head_chunks import grouped_geometry
from lightning_fpdt.sequence.planning import (
    AttentionGeometry,
    choose_chunks,
    choose_offload,
    choose_offload_dq,
    stash_bytes,
    working_set_bytes,
)

GIB = 2**30

PRECISIONS: dict[str, dict[str, int]] = {
    # bytes of: the sharded master weights, the gathered compute weights, the sharded gradients, the reduce-scatter
    # copy, the activations (FSDP2 MixedPrecisionPolicy of lightning_fpdt.strategy.precision)
    "bf16-mixed": dict(master=4, param=2, grad=4, reduce=4, act=2),
    "bf16-true": dict(master=2, param=2, grad=2, reduce=2, act=2),
    "32-true": dict(master=4, param=4, grad=4, reduce=4, act=4),
}
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0}
"""Tensors of the master weights' size an optimizer keeps per parameter."""

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
ROPE_TABLES = 4
"""fp32 ``(B, N, D)`` tables a layer saves for backward: cos and sin, for q and for k."""

MIN_CHUNK_TOKENS = 8192
"""The search doubles chunks down to this many global tokens per chunk, not further (a choice: smaller attention
blocks were not measured; the benchmarks use 32K and 64K)."""

CALLBACK_NAMES = ("mlp", "loss", "offload", "checkpoint")
SEARCH_ORDER = ("tiled_loss", "tiled_mlp", "activation_offload", "offload", "chunks", "cpu_offload_params")
"""What the recommendation turns on, one after the other, until the run fits."""


# ---- geometry and options --------------------------------------------------------------------------------------------
def resolve_geometry(model: Any, *, num_layers: Optional[int] = None) -> ModelGeometry:
    """A :class:`ModelGeometry` from a geometry, a ``LlamaConfig`` or Hugging Face config (or a mapping of one), a
    named size (``"llama3-8b"``, ...) or the path of a Hugging Face ``config.json``; ``num_layers`` replaces the
    depth."""
    if isinstance(model, ModelGeometry):
        geometry = model
    elif isinstance(model, str):
        if model in NAMED_CONFIGS:
            geometry = ModelGeometry.from_config(LlamaConfig.from_name(model))
        elif os.path.isfile(model):
            with open(model) as f:
                try:
                    config = json.load(f)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{model} is not a JSON config file: {error}") from error
            if not isinstance(config, dict):
                raise ValueError(f"{model} holds {type(config).__name__}, not a Hugging Face config object")
            geometry = ModelGeometry.from_config(SimpleNamespace(**config))
        else:
            raise ValueError(
                f"model {model!r} is neither a named size ({sorted(NAMED_CONFIGS)}) nor a Hugging Face config.json file"
            )
    elif isinstance(model, dict):
        geometry = ModelGeometry.from_config(SimpleNamespace(**model))
    else:
        geometry = ModelGeometry.from_config(model)
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers ({num_layers}) must be positive")
        geometry = dataclasses.replace(geometry, num_layers=num_layers)
    return geometry


@dataclass(frozen=True)
class PlanOptions:
    """The options a plan is made for, with every ``"auto"`` resolved."""

    sequence_parallel_size: int
    """``P``: GPUs sharing one sequence."""
    data_parallel_size: int
    """Groups of ``P`` GPUs that see different samples."""
    chunks: int
    """FPDT chunks per rank ``u``."""
    offload: bool
    """Attention chunks (and, under checkpointing, each layer's attention output) in pinned host memory."""
    offload_dq: bool
    """The backward's fp32 partial dQ sums in host memory too."""
    activation_offload: bool
    """ActivationOffload: blocks checkpointed, their inputs in pinned host memory."""
    activation_checkpointing: bool
    """Blocks checkpointed (implied by ``activation_offload``; ``ActivationOffload(offload=False)`` alone)."""
    tiled_mlp: bool
    """TiledMLP."""
    tiled_loss: bool
    """TiledLoss."""
    cpu_offload_params: bool
    """FSDP2 CPUOffloadPolicy: sharded parameters, gradients and optimizer states in pinned host memory."""
    precision: str
    """``"bf16-mixed"``, ``"bf16-true"`` or ``"32-true"``."""
    optimizer: str
    """``"adamw"``, ``"adam"`` or ``"sgd"``."""
    recompute_attention: bool = False
    """``ActivationOffload(recompute_attention=True)``: the checkpoint recomputes the attention in backward, so only
    the layer in backward holds a stash (instead of every layer) at the price of a second attention forward."""
    ring_size: int = 1
    """``R``: ring ranks of the 2-D sequence mesh (``P = U·R``); 1: plain Ulysses/FPDT."""
    head_chunks: int = 1
    """Head groups ``G``: the attention's projections and FPDT calls run on ``H/G`` query heads at a time."""

    def __post_init__(self) -> None:
        if self.activation_offload and not self.activation_checkpointing:
            raise ValueError("activation_offload checkpoints the blocks: set activation_checkpointing=True with it")
        if self.recompute_attention and not self.activation_checkpointing:
            raise ValueError("recompute_attention needs checkpointed blocks: set activation_checkpointing=True with it")
        if self.ring_size > 1 and (self.chunks > 1 or self.offload_dq):
            raise ValueError(
                f"ring_size={self.ring_size} with chunks={self.chunks}, offload_dq={self.offload_dq}: FPDT chunks are "
                f"not composed with the ring yet and it has no partial dQ sums to offload; use chunks=1 and "
                f"offload_dq off with a ring, or ring_size=1"
            )

    def describe(self) -> str:
        def on(flag: bool) -> str:
            return "on" if flag else "off"

        checkpointing = "offload" if self.activation_offload else ("on GPU" if self.activation_checkpointing else "off")
        split = (f" (ring {self.ring_size} x ulysses {self.sequence_parallel_size // self.ring_size})"
                 if self.ring_size > 1 else "")
        return (
            f"sp={self.sequence_parallel_size}{split} dp={self.data_parallel_size} chunks={self.chunks} "
            f"offload={on(self.offload)} (dq {on(self.offload_dq)}) tiled_mlp={on(self.tiled_mlp)} "
            f"tiled_loss={on(self.tiled_loss)} checkpointing={checkpointing}"
            f"{' (attention recomputed)' if self.recompute_attention else ''} "
            f"cpu_offload_params={on(self.cpu_offload_params)} {self.precision} {self.optimizer}"
            + (f" head_chunks={self.head_chunks}" if self.head_chunks > 1 else "")
        )


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
    recommended: Optional["MemoryPlan"] = field(default=None, compare=False)
    """A plan that fits, found by the search in :data:`SEARCH_ORDER` (``None`` if this one fits or none was found)."""
    recommendation: str = ""
    """What to change, in words."""

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
        return sum(c.host_bytes for c in self.components)

    @property
    def host_bytes_per_node(self) -> int:
        return self.host_bytes_per_gpu * self.gpus_per_node

    @property
    def fits_gpu(self) -> bool:
        return self.peak_gpu_bytes <= self.gpu_memory_bytes

    @property
    def fits_host(self) -> bool:
        return self.host_memory_bytes is None or self.host_bytes_per_node <= self.host_memory_bytes

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host

    @property
    def binding_limit(self) -> Literal["gpu memory", "host memory", "fits"]:
        """The limit exceeded (by the larger ratio when both are), or ``"fits"``."""
        gpu_ratio = self.peak_gpu_bytes / self.gpu_memory_bytes
        host_ratio = self.host_bytes_per_node / self.host_memory_bytes if self.host_memory_bytes else 0.0
        if max(gpu_ratio, host_ratio) <= 1:
            return "fits"
        return "gpu memory" if gpu_ratio >= host_ratio else "host memory"

    @property
    def largest_component(self) -> Component:
        """The largest host component when host memory binds, else the largest part of the GPU peak (a persistent
        component or one of the largest phase): what to shrink first."""
        if self.binding_limit == "host memory":
            return max(self.components, key=lambda c: c.host_bytes)
        at_peak = [c for c in self.components if c.phase in (None, self.peak_phase)]
        return max(at_peak, key=lambda c: c.gpu_bytes)


# ---- component formulas ----------------------------------------------------------------------------------------------
def parameter_counts(geometry: ModelGeometry) -> tuple[int, int]:
    """``(Θ_block, Θ_rest)``: the parameters of one block (q, k, v, o, gate, up, down, two norms) and of the rest
    (embedding, the lm_head unless tied, the final norm)."""
    g = geometry
    q_width, kv_width = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    block = 2 * g.hidden_size * q_width + 2 * g.hidden_size * kv_width + 3 * g.hidden_size * g.intermediate_size
    block += 2 * g.hidden_size
    rest = g.vocab_size * g.hidden_size * (1 if g.tie_word_embeddings else 2) + g.hidden_size
    return block, rest


def total_parameters(geometry: ModelGeometry) -> int:
    """``Θ = L·Θ_block + Θ_rest``."""
    block, rest = parameter_counts(geometry)
    return geometry.num_layers * block + rest


def attention_geometry(geometry: ModelGeometry, dtype_bytes: int = 2) -> AttentionGeometry:
    """The sizes ``lightning_fpdt.sequence.planning`` works with."""
    return AttentionGeometry(num_layers=geometry.num_layers, num_heads=geometry.num_heads,
                             num_kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim, dtype_bytes=dtype_bytes)


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
    accumulators; the fp32 partial dQ of three chunks (``offload_dq``) or of the whole local sequence. Without
    offload the chunks are in the stash (counted there) and every ``dout`` and ``out`` chunk joins them on the device. Against
    bench/attention.py this is 1–4% low; without the third chunk generations it would be 20% low.

    With a ring (``ring_size > 1``; ``u = 1``, no offload) the chunk is the ring rank's share ``B·S/R`` with
    ``h = H/U``, ``hk = max(Hkv, U)/U`` heads, and the kv share and fp32 dK/dV accumulator arriving from the previous
    ring rank are live next to the own ones (``ring_backward``). Not yet measured on a GPU.
    """
    g, b = geometry, geometry.dtype_bytes
    ulysses = sp_size // ring_size
    chunk = batch_size * math.ceil(seq_len / (num_chunks * ring_size))  # C (with a ring: the share)
    heads, kv_heads = g.num_heads // ulysses, max(g.num_kv_heads, ulysses) // ulysses
    q_chunk, kv_chunk = chunk * heads * g.head_dim, chunk * kv_heads * g.head_dim  # elements
    local_q = batch_size * seq_len // sp_size * g.num_heads * g.head_dim  # all local q elements
    q_side = 3 * q_chunk * b + chunk * heads * 4
    kernel = (2 * q_chunk * b if heads > kv_heads else 0) + 3 * q_chunk * b + 4 * q_chunk
    kv_acc = 2 * kv_chunk * 4
    if offload:
        chunks = min(3, num_chunks) * q_side + min(2, num_chunks) * 2 * kv_chunk * b
    else:
        chunks = (2 if ring_size == 1 else 1) * local_q * b  # dout (and out: FPDT all-to-alls it in backward)
    partial_dq = min(3, num_chunks) * 4 * q_chunk if offload_dq else 4 * local_q
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
    local_q = batch_size * seq_len // sp_size * g.num_heads * g.head_dim
    host = 0
    if offload:
        host += g.num_layers * stash_bytes(g, batch_size=batch_size, seq_len=seq_len, sp_size=sp_size,
                                           ring_size=ring_size)
        # kept outputs + one layer's dout (and out chunks: FPDT all-to-alls them in backward; the ring stashed its own)
        host += kept_out_layers * local_q * b + (2 if ring_size == 1 else 1) * local_q * b
    if offload_dq:
        host += 4 * local_q
    return host


def mlp_tile_tokens(num_tokens: int, intermediate_size: int, dtype_bytes: int) -> int:
    """Tokens of one ``TiledMLP(num_tiles="auto")`` tile (the callback's own rule)."""
    from lightning_fpdt.callbacks.tiled_mlp import auto_mlp_tiles  # here: that module imports Lightning, this one not

    return math.ceil(num_tokens / auto_mlp_tiles(num_tokens, intermediate_size, dtype_bytes))


def loss_tile_tokens(num_tokens: int, vocab_size: int) -> int:
    """Tokens of one ``TiledLoss(num_tiles="auto")`` tile (the callback's own rule)."""
    from lightning_fpdt.callbacks.tiled_loss import auto_loss_tiles  # here: that module imports Lightning, this one not

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


# ---- the plan --------------------------------------------------------------------------------------------------------
def _free_for_auto(
    geometry: ModelGeometry, *, precision: str, cpu_offload_params: bool, num_gpus: int, gpu_memory_bytes: int
) -> int:
    """What ``"auto"`` plans with: the free GPU memory at the first batch, once the sharded weights are there."""
    master = 0 if cpu_offload_params else PRECISIONS[precision]["master"] * total_parameters(geometry) // num_gpus
    return max(gpu_memory_bytes - master, 1)


def _resolve_options(
    geometry: ModelGeometry, *, seq_len: int, batch_size: int, num_gpus: int, gpus_per_node: int,
    sequence_parallel_size: Union[str, int], chunks: Union[str, int], offload: Union[str, bool],
    offload_dq: Union[str, bool], activation_offload: bool, activation_checkpointing: Optional[bool], tiled_mlp: bool,
    tiled_loss: bool, precision: str, optimizer: str, cpu_offload_params: bool, gpu_memory_bytes: int,
    recompute_attention: bool = False,
    ring_size: Union[str, int] = "auto",
    head_chunks: int = 1,
) -> PlanOptions:
    from lightning_fpdt.strategy.mesh import resolve_sequence_sizes  # the strategy package imports Lightning

    dp, sp, ring = resolve_sequence_sizes(
        world_size=num_gpus, devices_per_node=gpus_per_node, data_parallel_size="auto",
        sequence_parallel_size=sequence_parallel_size, ring_size=ring_size,
        heads=(geometry.num_heads, geometry.num_kv_heads), head_chunks=head_chunks,
    )
    if ring > 1:  # as the strategy resolves them ("auto" -> 1 / off: not composed with, or not needed by, the ring)
        chunks = 1 if chunks == "auto" else chunks
        offload_dq = False if offload_dq == "auto" else offload_dq
    attention = grouped_geometry(attention_geometry(geometry, PRECISIONS[precision]["act"]), head_chunks)
    free = _free_for_auto(geometry, precision=precision, cpu_offload_params=cpu_offload_params, num_gpus=num_gpus,
                          gpu_memory_bytes=gpu_memory_bytes)
    size = dict(batch_size=batch_size, seq_len=seq_len, sp_size=sp)
    if chunks == "auto":
        chunks = choose_chunks(attention, free_bytes=free, **size)
    if offload == "auto":
        offload = choose_offload(attention, free_bytes=free, ring_size=ring, **size)
    if offload_dq == "auto":
        offload_dq = offload and choose_offload_dq(attention, free_bytes=free, **size)
    return PlanOptions(
        sequence_parallel_size=sp, data_parallel_size=dp, chunks=chunks, offload=offload, offload_dq=offload_dq,
        activation_offload=activation_offload,
        activation_checkpointing=activation_offload or bool(activation_checkpointing),
        tiled_mlp=tiled_mlp, tiled_loss=tiled_loss, cpu_offload_params=cpu_offload_params, precision=precision,
        optimizer=optimizer, recompute_attention=recompute_attention, ring_size=ring, head_chunks=head_chunks,
    )


def _components(
    geometry: ModelGeometry, options: PlanOptions, *, seq_len: int, batch_size: int, num_gpus: int
) -> list[Component]:
    g, o, dtypes = geometry, options, PRECISIONS[options.precision]
    b, L, h, V = dtypes["act"], g.num_layers, g.hidden_size, g.vocab_size
    P, W = o.sequence_parallel_size, num_gpus
    N = batch_size * seq_len // P  # local tokens
    A = N * h * b  # one hidden-state tensor
    attn_width = g.num_heads * g.head_dim
    block, rest = parameter_counts(g)
    total = total_parameters(g)
    offloaded_states = o.cpu_offload_params
    G = o.head_chunks
    attention = grouped_geometry(attention_geometry(g, b), G)  # G > 1: L·G calls of one head group each
    size = dict(batch_size=batch_size, seq_len=seq_len, sp_size=P)
    ring = dict(ring_size=o.ring_size)

    def on(nbytes: int, host: bool) -> tuple[int, int]:  # (gpu, host)
        return (0, nbytes) if host else (nbytes, 0)

    items: list[Component] = []

    def add(name: str, gpu: int, host: int = 0, phase: Optional[str] = None, formula: str = "") -> None:
        items.append(Component(name, int(gpu), int(host), phase, formula))

    # ---- persistent
    master = dtypes["master"] * total // W
    gpu, host = on(master, offloaded_states)
    add("parameters", gpu + dtypes["param"] * (rest + 2 * block), host,
        formula="sharded master + gathered root unit + 2 blocks")
    sharded_grads = dtypes["grad"] * total // W
    gpu, host = on(sharded_grads, offloaded_states)
    add("gradients", gpu + block * (dtypes["param"] + dtypes["reduce"]), host,
        formula="sharded + one block unsharded + its reduce-scatter copy")
    moments = OPTIMIZER_STATES[o.optimizer] * dtypes["master"] * total // W
    add("optimizer states", *on(moments, offloaded_states), formula=f"{OPTIMIZER_STATES[o.optimizer]} x sharded master")

    # RMSNorm: fp32 copy of its input, normalised input, output. The reference Llama's norm and RoPE now run over
    # token tiles and save one fp32 per token (models/ops.py); these terms, calibrated on GPU runs of the plain forms,
    # are kept until runs of the tiled forms re-calibrate them (a conservative GPU estimate meanwhile)
    norm = N * h * 4 * (b < 4) + 2 * A
    rope = ROPE_TABLES * N * g.head_dim * 4
    mlp_saved = 0 if o.tiled_mlp else 4 * N * g.intermediate_size * b
    # what one layer's backward needs; head groups keep their outputs in the stash ("kept out") and recompute RoPE.
    # The block output A: a checkpoint's recompute no longer keeps it through the block's backward (ActivationOffload's
    # inner backward starts from gradient edges, docs/memory-1gpu.md); the term stays, as the norms' above, until GPU
    # runs of the new code re-calibrate the checkpointed phases (the calibration runs kept it)
    layer = 2 * norm + (N * attn_width * b + rope if G == 1 else 0) + A + mlp_saved
    if o.activation_offload:
        add("checkpointed block inputs", 2 * A, L * A, formula="2 on GPU (current, prefetched), L on host")
    elif o.activation_checkpointing:
        add("checkpointed block inputs", L * A, formula="L x B·S/P·hidden")
    else:
        add("activations (no checkpointing)", L * (A + layer), formula="L x (block input + layer activations)")

    # attention calls holding a stash between forward and backward: every layer's, or under attention recompute only
    # the layer in backward; with head groups, each of its G groups
    layers_stashed = 1 if o.recompute_attention else L
    stashed = layers_stashed * G
    if G > 1:  # head groups keep each group's output for their backward (the layer in backward's, under recompute)
        kept = layers_stashed
    else:
        kept = L if o.activation_checkpointing and not o.recompute_attention else 0  # first-pass outputs kept
    kept_out = kept * N * attn_width * b
    stash = stashed * stash_bytes(attention, **size, **ring)
    host_attention = attention_host_bytes(dataclasses.replace(attention, num_layers=stashed), offload=o.offload,
                                          offload_dq=o.offload_dq, kept_out_layers=kept * G, **size, **ring)
    add("attention stash", 0 if o.offload else stash + kept_out, host_attention,
        formula=("1 layer (attention recomputed)" if o.recompute_attention else "L")
        + " x planning.stash_bytes (+ kept outputs)" + (", offloaded" if o.offload else ""))
    add("lm_head gradient", V * h * b, formula="V·hidden, unsharded until the root's reduce-scatter")

    # ---- transient phases
    recompute = layer if o.activation_checkpointing else 0  # without checkpointing it is in "activations" already
    qkv_out = N * (g.num_heads + 2 * g.num_kv_heads) * g.head_dim * b + N * attn_width * b  # full width
    if G == 1:
        add("attention forward", norm + qkv_out + working_set_bytes(attention, num_chunks=o.chunks, **size, **ring),
            phase="attention forward", formula="norm + q, k, v, out + planning.working_set_bytes")
    else:
        group_working_set = working_set_bytes(attention, num_chunks=o.chunks, **size, **ring)
        add("attention forward", norm + A + qkv_out // G + group_working_set,
            phase="attention forward", formula="norm + output sum + one group's q, k, v, out and working set")
    mlp_rows = mlp_tile_tokens(N, g.intermediate_size, b) if o.tiled_mlp else N
    mlp_work = MLP_BACKWARD_BUFFERS * mlp_rows * g.intermediate_size * b - mlp_saved
    if o.tiled_mlp:  # the fp32 sums of the gate, up and down weight gradients over the tiles
        mlp_work += 3 * g.hidden_size * g.intermediate_size * MLP_GRAD_SUM_BYTES
    add("layer activations (recompute)", recompute, phase="MLP backward", formula="norms, attention out, rope, MLP")
    add("MLP backward", 2 * A + mlp_work, phase="MLP backward",
        formula=f"grads in/out + {'one tile' if o.tiled_mlp else 'all tokens'} x {MLP_BACKWARD_BUFFERS} x I"
        + (" + fp32 weight-gradient sums" if o.tiled_mlp else ""))
    add("layer activations (at attention)", (norm + rope) if o.activation_checkpointing else 0,
        phase="attention backward", formula="first norm, rope")
    backward_chunks = attention_backward_bytes(attention, num_chunks=o.chunks, offload=o.offload,
                                               offload_dq=o.offload_dq, **size, **ring)
    if G == 1:
        add("attention backward", A + N * attn_width * b + N * (g.num_heads + 2 * g.num_kv_heads) * g.head_dim * b
            + backward_chunks, phase="attention backward", formula="grads + dq, dk, dv + FPDT backward chunks")
    else:
        # a group's backward (sequence/head_chunks.py) holds no other hidden-sized tensor: the output projection
        # is differentiated by hand and the q/k/v projections' input gradients are added into dx in place; at its
        # peak (RoPE's backward of dq) the group's dout, dq and rotated dq, dk and dv are alive: (out + qkv)/G
        add("attention backward", 2 * A + (N * attn_width * b + qkv_out) // G + backward_chunks,
            phase="attention backward",
            formula="output grad + running input grad + one group's dout, dq and its rotation, dk, dv"
            " + its FPDT backward chunks")
    if o.tiled_loss:
        loss = A + V * h * 4 + LOSS_TILE_BYTES_PER_LOGIT * loss_tile_tokens(N, V) * V
        formula = "hidden grad + fp32 lm_head grad + one tile"
    else:
        loss = UNTILED_LOSS_BYTES_PER_LOGIT * N * V
        formula = "fp32 logits, log-softmax, grad"
    add("logits / loss", norm + loss, phase="loss", formula=formula)
    add("embedding gradient + root reduce-scatter", V * h * b * (not g.tie_word_embeddings)
        + rest * dtypes["reduce"] + rest * dtypes["reduce"] // W, phase="end of backward",
        formula="V·hidden + root unit in reduce dtype")
    return items


def _plan(
    geometry: ModelGeometry, model: str, *, seq_len: int, batch_size: int, num_gpus: int, gpus_per_node: int,
    options: PlanOptions, gpu_memory_bytes: int, host_memory_bytes: Optional[int],
) -> MemoryPlan:
    from lightning_fpdt.sequence.layout import SequenceLayout

    layout = SequenceLayout(options.sequence_parallel_size, 0, options.chunks, ring_size=options.ring_size)
    padded = layout.padded_length(seq_len)
    components = _components(geometry, options, seq_len=padded, batch_size=batch_size, num_gpus=num_gpus)
    return MemoryPlan(
        model=model, geometry=geometry, seq_len=seq_len, padded_seq_len=padded, batch_size=batch_size,
        num_gpus=num_gpus, gpus_per_node=gpus_per_node, options=options, components=tuple(components),
        gpu_memory_bytes=gpu_memory_bytes, host_memory_bytes=host_memory_bytes,
    )


def _recommend(plan: MemoryPlan, offload_dq: Union[str, bool]) -> tuple[Optional[MemoryPlan], str]:
    """Turn on, in :data:`SEARCH_ORDER`, what lowers GPU memory until the plan fits, then undo the changes the fit
    does not need; when only host memory binds, bring things back to the GPU instead (CPU-offloaded states, block
    inputs, attention chunks) while the GPU has room."""
    kwargs = dict(seq_len=plan.seq_len, batch_size=plan.batch_size, num_gpus=plan.num_gpus,
                  gpus_per_node=plan.gpus_per_node, gpu_memory_bytes=plan.gpu_memory_bytes,
                  host_memory_bytes=plan.host_memory_bytes)

    def replan(changes: dict[str, Any]) -> MemoryPlan:
        implied = {"activation_checkpointing": True} if changes.get("activation_offload") else {}
        options = dataclasses.replace(plan.options, **changes, **implied)  # ActivationOffload checkpoints the blocks
        if offload_dq == "auto" and options.ring_size == 1:  # re-resolved: it depends on the attention offload
            attention = grouped_geometry(attention_geometry(plan.geometry, PRECISIONS[options.precision]["act"]),
                                         options.head_chunks)
            free = _free_for_auto(plan.geometry, precision=options.precision, num_gpus=plan.num_gpus,
                                  cpu_offload_params=options.cpu_offload_params, gpu_memory_bytes=plan.gpu_memory_bytes)
            dq = options.offload and choose_offload_dq(attention, batch_size=plan.batch_size, seq_len=plan.seq_len,
                                                       sp_size=options.sequence_parallel_size, free_bytes=free)
            options = dataclasses.replace(options, offload_dq=dq)
        return _plan(plan.geometry, plan.model, options=options, **kwargs)

    def said(changes: dict[str, Any]) -> str:
        return "set " + ", ".join(f"{name}={value}" for name, value in changes.items())

    if plan.fits:
        return None, "the options as given fit"
    changes: dict[str, Any] = {}
    current = plan
    if plan.fits_gpu:  # host memory binds
        # free changes first (room on the GPU), then recomputing the attention (one layer's stash instead of L)
        for name, value in (("cpu_offload_params", False), ("activation_offload", False),
                            ("recompute_attention", True), ("offload", False)):
            if getattr(current.options, name) != value and current.options.activation_checkpointing:
                trial = replan({**changes, name: value})
                if trial.fits_gpu:
                    current, changes = trial, {**changes, name: value}
                    if current.fits:
                        return current, said(changes)
        return None, (
            f"nothing fits the host (even with {said(changes)[4:] if changes else 'the options as given'}: "
            f"{_gib(current.host_bytes_per_node)} GiB pinned per host): use more hosts (each GPU holds S/P tokens) "
            f"or a shorter sequence"
        )
    for name in SEARCH_ORDER:
        if name == "chunks" and current.options.ring_size > 1:
            continue  # not composed with the ring yet
        if name == "chunks":
            # more chunks shrink only the attention's working set: stop when that no longer lowers the peak
            chunks = current.options.chunks
            while not current.fits_gpu and plan.seq_len / (2 * chunks) >= max(
                MIN_CHUNK_TOKENS, current.options.sequence_parallel_size
            ):
                trial = replan({**changes, "chunks": 2 * chunks})
                if trial.peak_gpu_bytes >= current.peak_gpu_bytes:
                    break
                current, chunks, changes = trial, 2 * chunks, {**changes, "chunks": 2 * chunks}
        elif not getattr(current.options, name):
            changes = {**changes, name: True}
            current = replan(changes)
        if current.fits:
            break
    else:
        why = "GPU" if not current.fits_gpu else "host"
        return None, (
            f"nothing in the search fits ({said(changes) if changes else 'everything on'}: still over {why} "
            f"memory): use more GPUs (each holds S/P tokens and 1/W of the states) or a shorter sequence"
        )
    for name in list(changes)[:-1]:  # the last change made it fit; an earlier one may not be needed
        trial = replan({k: v for k, v in changes.items() if k != name})
        if trial.fits:
            current, changes = trial, {k: v for k, v in changes.items() if k != name}
    return current, said(changes)


def plan_memory(
    *,
    geometry: Any,
    seq_len: int,
    batch_size: int = 1,
    num_gpus: int,
    gpus_per_node: Optional[int] = None,
    sequence_parallel_size: Union[Literal["auto"], int] = "auto",
    ring_size: Union[Literal["auto"], int] = "auto",
    chunks: Union[Literal["auto"], int] = "auto",
    offload: Union[Literal["auto"], bool] = "auto",
    offload_dq: Union[Literal["auto"], bool] = "auto",
    activation_offload: bool,
    tiled_mlp: bool,
    tiled_loss: bool,
    activation_checkpointing: Optional[bool] = None,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    cpu_offload_params: bool = False,
    gpu_memory_gib: float = 80.0,
    host_memory_gib: Optional[float] = None,
    recompute_attention: bool = False,
    head_chunks: int = 1,
) -> MemoryPlan:
    """Predict the memory of one training step under ``strategy="fpdt"``, per GPU and per host, and recommend options.

    Args:
        geometry: a :class:`ModelGeometry`, a ``LlamaConfig`` or Hugging Face config, a named size (``"llama3-8b"``)
            or the path of a Hugging Face ``config.json``.
        seq_len: global tokens of one sequence ``S`` (padded here as the strategy pads it, to a multiple of ``P·u``).
        batch_size: sequences per data-parallel group per step.
        num_gpus: all GPUs ``W`` (FSDP2 shards the states over all of them).
        gpus_per_node: GPUs of one host (``None``: all of them); pinned host memory is needed per host.
        sequence_parallel_size, ring_size, chunks, offload, offload_dq, cpu_offload_params: as ``FPDTStrategy``
            takes them (``ring_size="auto"``: the smallest ring the heads need, 1 when ``P`` divides them);
            ``"auto"`` resolves as the strategy does, with the free memory of ``gpu_memory_gib`` minus the sharded
            weights.
        activation_offload, tiled_mlp, tiled_loss: whether the ``ActivationOffload``, ``TiledMLP``, ``TiledLoss``
            callbacks are on.
        activation_checkpointing: blocks checkpointed with their inputs on the GPU (``ActivationOffload(offload=
            False)``); ``None``: only when ``activation_offload``.
        recompute_attention: ``ActivationOffload(recompute_attention=True)``: one layer's stash instead of every
            layer's, the attention forward run twice.
        precision: ``"bf16-mixed"``, ``"bf16-true"`` or ``"32-true"``.
        optimizer: ``"adamw"``, ``"adam"`` (two moments) or ``"sgd"`` (none).
        gpu_memory_gib: memory of one GPU in GiB (about 79 for an H100 80GB, 139 for an H200).
        host_memory_gib: memory one host can pin; ``None``: not checked.
        head_chunks: head groups ``G`` (``FPDTStrategy(head_chunks=...)``): the attention phases hold one group's
            q/k/v/out (``1/G`` of the full-width buffers) and its FPDT working set, plus a hidden-sized output sum.

    Returns:
        A :class:`MemoryPlan`: components, ``peak_gpu_bytes = Σ persistent + max(transient phases)``, pinned host
        bytes per host, ``binding_limit`` and, when it does not fit, ``recommended`` (a plan that fits) and
        ``recommendation`` (the changes in words). A model, not a measurement: see the module docstring.
    """
    geometry = resolve_geometry(geometry)
    model = geometry_name(geometry)
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("num_gpus", num_gpus)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} ({value!r}) must be a positive int")
    gpus_per_node = num_gpus if gpus_per_node is None else gpus_per_node
    if gpus_per_node < 1 or num_gpus % gpus_per_node:
        raise ValueError(f"gpus_per_node ({gpus_per_node}) must divide num_gpus ({num_gpus})")
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not planned for; use one of {sorted(PRECISIONS)}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer {optimizer!r} is not planned for; use one of {sorted(OPTIMIZER_STATES)}")
    if chunks != "auto" and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"chunks must be 'auto' or a positive int, got {chunks!r}")
    for name, value in (("offload", offload), ("offload_dq", offload_dq)):
        if value not in ("auto", True, False):
            raise ValueError(f"{name} must be 'auto', True or False, got {value!r}")
    if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1:
        raise ValueError(f"head_chunks must be a positive int, got {head_chunks!r}")
    if gpu_memory_gib <= 0 or (host_memory_gib is not None and host_memory_gib <= 0):
        raise ValueError(f"gpu_memory_gib ({gpu_memory_gib}) and host_memory_gib ({host_memory_gib}) must be positive")
    gpu_bytes = int(gpu_memory_gib * GIB)
    host_bytes = None if host_memory_gib is None else int(host_memory_gib * GIB)
    options = _resolve_options(
        geometry, seq_len=seq_len, batch_size=batch_size, num_gpus=num_gpus, gpus_per_node=gpus_per_node,
        sequence_parallel_size=sequence_parallel_size, chunks=chunks, offload=offload, offload_dq=offload_dq,
        activation_offload=activation_offload, activation_checkpointing=activation_checkpointing,
        tiled_mlp=tiled_mlp, tiled_loss=tiled_loss, precision=precision, optimizer=optimizer,
        cpu_offload_params=cpu_offload_params, gpu_memory_bytes=gpu_bytes, recompute_attention=recompute_attention,
        ring_size=ring_size, head_chunks=head_chunks,
    )
    plan = _plan(geometry, model, seq_len=seq_len, batch_size=batch_size, num_gpus=num_gpus,
                 gpus_per_node=gpus_per_node, options=options, gpu_memory_bytes=gpu_bytes, host_memory_bytes=host_bytes)
    recommended, recommendation = _recommend(plan, offload_dq)
    return dataclasses.replace(plan, recommended=recommended, recommendation=recommendation)


def geometry_name(geometry: ModelGeometry) -> str:
    """``llama3-8b (4 layers)`` for a named geometry at another depth, else the sizes."""
    for name in NAMED_CONFIGS:
        named = ModelGeometry.from_config(LlamaConfig.from_name(name))
        if dataclasses.replace(named, num_layers=geometry.num_layers) == geometry:
            return name if named.num_layers == geometry.num_layers else f"{name} ({geometry.num_layers} layers)"
    g = geometry
    return (f"{g.num_layers} layers, hidden {g.hidden_size}, heads {g.num_heads}/{g.num_kv_heads}x{g.head_dim}, "
            f"MLP {g.intermediate_size}, vocab {g.vocab_size}")


# ---- output and the host check ---------------------------------------------------------------------------------------
def _gib(nbytes: Optional[int]) -> str:
    return "-" if nbytes is None else f"{nbytes / GIB:.2f}"


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a table (component, phase, GPU GiB, host GiB), the peak, the binding limit and the recommendation."""
    o, g = plan.options, plan.geometry
    lines = [
        f"memory plan: {plan.model}, S = {plan.seq_len:,} tokens"
        + (f" (padded to {plan.padded_seq_len:,})" if plan.padded_seq_len != plan.seq_len else "")
        + f", batch {plan.batch_size}, {plan.num_gpus} GPU(s), {plan.gpus_per_node} per host",
        f"  {plan.local_tokens:,} tokens per GPU, "
        + (f"{plan.padded_seq_len // o.ring_size:,} tokens per ring share; " if o.ring_size > 1 else
           f"{plan.padded_seq_len // o.chunks:,} global tokens per chunk; ")
        + f"{g.num_layers} layers",
        f"  options: {o.describe()}",
        "",
        f"  {'component':<42} {'phase':<20} {'GPU GiB':>9} {'host GiB':>9}",
    ]
    for c in plan.components:
        lines.append(f"  {c.name:<42} {c.phase or 'persistent':<20} {_gib(c.gpu_bytes):>9} {_gib(c.host_bytes):>9}")
    lines.append("  " + "-" * 83)
    phases = plan.phase_bytes
    lines.append(f"  {'persistent':<63} {_gib(plan.persistent_gpu_bytes):>9}")
    lines.append(f"  {'largest transient phase: ' + plan.peak_phase:<63} {_gib(phases[plan.peak_phase]):>9}")
    lines.append(f"  {'predicted peak per GPU':<63} {_gib(plan.peak_gpu_bytes):>9}   "
                 f"of {plan.gpu_memory_bytes / GIB:.1f} GiB")
    host_limit = "not checked" if plan.host_memory_bytes is None else f"of {plan.host_memory_bytes / GIB:.1f} GiB"
    lines.append(f"  {'pinned host memory per host (' + str(plan.gpus_per_node) + ' GPUs)':<63} "
                 f"{'':>9} {_gib(plan.host_bytes_per_node):>9}   {host_limit}")
    largest = plan.largest_component
    where = largest.host_bytes if plan.binding_limit == "host memory" else largest.gpu_bytes
    lines += ["", f"binding limit: {plan.binding_limit} (largest component: {largest.name}, {_gib(where)} GiB)"]
    lines.append(f"recommendation: {plan.recommendation}")
    if plan.recommended is not None:
        r = plan.recommended
        lines.append(f"  -> {r.options.describe()}")
        lines.append(f"  -> predicted peak {_gib(r.peak_gpu_bytes)} GiB per GPU, pinned host "
                     f"{_gib(r.host_bytes_per_node)} GiB per host")
    lines.append("(a model, not a measurement: keep a few GiB of headroom; see docs/planner.md)")
    return "\n".join(lines)


def available_host_memory() -> Optional[int]:
    """Bytes of memory this host can still give (``MemAvailable`` of /proc/meminfo; psutil elsewhere), or ``None``."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file says kB and means KiB
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def check_host_memory(plan: MemoryPlan, available_bytes: Optional[int]) -> None:
    """``ValueError`` with the numbers when the pinned host memory the plan needs per host exceeds ``available_bytes``
    (pinned memory cannot be swapped: exhausting it takes the machine down, not just the job). ``None``: unknown, no
    check."""
    if available_bytes is None or plan.host_bytes_per_node <= available_bytes:
        return
    parts = ", ".join(f"{c.name} {_gib(c.host_bytes)}" for c in plan.components if c.host_bytes)
    fix = plan.recommendation if plan.recommended is not None else (
        "fewer GPUs' worth of tokens per host: more hosts, a shorter sequence, or less offload "
        "(ActivationOffload(offload=False), offload=False) if the GPUs have room"
    )
    raise ValueError(
        f"this run needs {_gib(plan.host_bytes_per_node)} GiB of pinned host memory per host "
        f"({plan.gpus_per_node} GPUs x {_gib(plan.host_bytes_per_gpu)} GiB: {parts} GiB) but the host has "
        f"{_gib(available_bytes)} GiB available; pinned-memory exhaustion takes the machine down, so the run is "
        f"refused. S = {plan.seq_len:,}, {plan.options.describe()}. Fix: {fix}"
    )


# ---- command line ----------------------------------------------------------------------------------------------------
def _auto_or_int(value: str) -> Union[str, int]:
    return value if value == "auto" else int(value)


def _switch(value: str) -> Union[str, bool]:
    choices = {"auto": "auto", "on": True, "off": False}
    if value not in choices:
        raise argparse.ArgumentTypeError(f"choose auto, on or off, not {value!r}")
    return choices[value]


def _host_memory(value: str) -> Union[str, float]:
    return value if value == "auto" else float(value)


def _callbacks(value: str) -> set[str]:
    if value == "all":
        return {"mlp", "loss", "offload"}
    if value == "none":
        return set()
    chosen = {name.strip() for name in value.split(",") if name.strip()}
    unknown = chosen - set(CALLBACK_NAMES)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown callbacks {sorted(unknown)}: use all, none or a comma list of {', '.join(CALLBACK_NAMES)}"
        )
    return chosen


def main(argv: Optional[list[str]] = None) -> int:
    """``lightning-fpdt plan``: print the memory plan. Exit status 0 if it fits, 1 if not, 2 for a bad option."""
    parser = argparse.ArgumentParser(
        prog="lightning-fpdt plan", description="Predict the GPU and host memory of a long-context fpdt run.",
    )
    parser.add_argument("--model", default="llama3-8b",
                        help=f"a named size ({', '.join(NAMED_CONFIGS)}) or a Hugging Face config.json")
    parser.add_argument("--layers", type=int, default=None, help="override the number of layers")
    parser.add_argument("--seq-len", type=int, required=True, help="global tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per data-parallel group")
    parser.add_argument("--gpus", type=int, default=1, help="all GPUs of the run")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per host (default: all)")
    parser.add_argument("--sp", type=_auto_or_int, default="auto", help="sequence_parallel_size")
    parser.add_argument("--ring-size", type=_auto_or_int, default="auto",
                        help="ring ranks R of the sequence mesh (sp = ulysses x R; auto: the smallest the heads need)")
    parser.add_argument("--chunks", type=_auto_or_int, default="auto", help="FPDT chunks per rank")
    parser.add_argument("--head-chunks", type=int, default=1,
                        help="head groups G: attention projections and FPDT calls per group of H/G query heads")
    parser.add_argument("--offload", type=_switch, default="auto", help="attention chunk offload: auto, on, off")
    parser.add_argument("--offload-dq", type=_switch, default="auto", help="partial dQ offload: auto, on, off")
    parser.add_argument("--callbacks", type=_callbacks, default=_callbacks("all"),
                        help="all, none, or a comma list of mlp, loss, offload, checkpoint (checkpointing on the GPU)")
    parser.add_argument("--precision", default="bf16-mixed", choices=sorted(PRECISIONS))
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATES))
    parser.add_argument("--cpu-offload-params", action="store_true", help="FSDP2 CPUOffloadPolicy")
    parser.add_argument("--recompute-attention", action="store_true",
                        help="ActivationOffload(recompute_attention=True): one layer's attention stash instead of all")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0,
                        help="GiB of one GPU (an H100 80GB reports ~79, an H200 ~139)")
    parser.add_argument("--host-memory-gib", type=_host_memory, default=None,
                        help="memory one host can pin, or 'auto' for this machine's available memory")
    args = parser.parse_args(argv)
    host = args.host_memory_gib
    if host == "auto":
        available = available_host_memory()
        host = None if available is None else available / GIB
    try:
        plan = plan_memory(
            geometry=resolve_geometry(args.model, num_layers=args.layers), seq_len=args.seq_len,
            batch_size=args.batch_size, num_gpus=args.gpus, gpus_per_node=args.gpus_per_node,
            sequence_parallel_size=args.sp, ring_size=args.ring_size, chunks=args.chunks, offload=args.offload,
            offload_dq=args.offload_dq,
            activation_offload="offload" in args.callbacks, activation_checkpointing="checkpoint" in args.callbacks,
            tiled_mlp="mlp" in args.callbacks, tiled_loss="loss" in args.callbacks, precision=args.precision,
            optimizer=args.optimizer, cpu_offload_params=args.cpu_offload_params, gpu_memory_gib=args.gpu_memory_gib,
            host_memory_gib=host, recompute_attention=args.recompute_attention, head_chunks=args.head_chunks,
        )
    except ValueError as error:
        print(f"lightning-fpdt plan: {error}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
