"""What a one-GPU training step holds at its peak, counted on the CPU (docs/planner.md).

The step is the reference Llama on the real code path of a one-GPU long-context run: the FPDT attention with ``u``
chunks offloaded to the host (partial dQ too), ``ActivationOffload(recompute_attention=True)``, ``TiledMLP`` and
``TiledLoss``, installed in the strategy's order, bf16 weights (what FSDP2's ``MixedPrecisionPolicy`` computes with),
forward and backward of one batch. :class:`PhaseBytes` (a :class:`LiveBytes`) counts the live tensor bytes op by op
and keeps the peak of each phase of the step with what was alive at it. Host buffers (the attention's chunk stash,
the offloaded block inputs) come from ``HostBufferPool.acquire`` and are left out, as a GPU's count would not see
them; what the stash copies back (its ``prefetch``) is counted, as on the GPU.

Scaling: the tile sizes of the code (RMSNorm, RoPE, TiledMLP, TiledLoss) are set so that a run of ``seq_len`` tokens
cuts its sequence into the same fraction per tile as Llama-3-8B at ``reference_len`` tokens would
(:func:`scaled_tiles`), and the chunk count is the reference's: every activation term is then a fixed multiple of
``A`` (one hidden-sized bf16 tensor of the run), the unit the report uses, and the reference's bytes are those
multiples of its own ``A`` (8 GiB at 1M tokens of Llama-3-8B). ``--narrow`` divides the widths and head counts by a
factor and keeps ``head_dim``: every per-token ratio (q, k, v, the MLP's width, the log-sum-exp per head) stays the
8B one, at a fraction of the CPU time. The weight-shaped terms (weights' gradients and their fp32 sums) are left out
of the activation count: they do not grow with the sequence, and FSDP2 moves each block's gradients to the host
after its backward, which this single process does not. Not counted either: what FSDP2 itself allocates (unsharded
bf16 parameters, reduce-scatter buffers) and the CUDA allocator's rounding and caching.

Run ``PYTHONPATH=. python -m tests.step_memory --help``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightning_fpdt.callbacks.activation_offload import ActivationOffload
from lightning_fpdt.fused import ops
from lightning_fpdt.integrations import SequenceParallelContext, apply_tiled_loss, install_reference_llama
from lightning_fpdt.memory import apply_tiled_mlp, find_blocks, tiling
from lightning_fpdt.models.llama import LlamaConfig, LlamaForCausalLM
from lightning_fpdt.offload.host_stash import HostBufferPool
from lightning_fpdt.sequence import FPDTAttention
from tests.live_bytes import Allocation, LiveBytes

# Phases, by the innermost function of the package on the Python stack that names one (checked in this order).
_PHASE_FUNCTIONS = (
    ("fpdt_backward", "attention backward"),
    ("tiled_mlp_backward", "MLP backward"),
    ("rms_norm_backward", "RMSNorm backward"),
    ("tiled_cross_entropy_forward", "loss"),
    ("fpdt_forward", "attention forward"),
    ("rotary_forward", "RoPE"),
    ("tiled_mlp_forward", "MLP forward"),
    ("rms_norm_forward", "RMSNorm forward"),
)


def _phase() -> str:
    """``"<pass> / <phase>"`` of the op running now, from the Python stack: the pass is the first forward, a block's
    recompute in backward (``recompute``) or its backward proper (``backward``), with the block's index."""
    frame, names, block, recompute = sys._getframe(2), [], None, None
    while frame is not None:
        code = frame.f_code
        if "/lightning_fpdt/" in code.co_filename:
            names.append(code.co_name)
            if code.co_name == "backward" and code.co_filename.endswith("block_offload.py") and block is None:
                ctx = frame.f_locals.get("ctx")
                block = getattr(getattr(ctx, "block", None), "key", None)
                recompute = "torch.autograd.backward" not in _source_line(frame)
        frame = frame.f_back
    inner = next((label for name, label in _PHASE_FUNCTIONS if name in names), None)
    if block is None:
        where = "forward" if torch._C._current_graph_task_id() == -1 else "backward (outside the blocks)"
        return f"{where} / {inner or 'other'}"
    where = f"block {block} {'recompute' if recompute else 'backward'}"
    return f"{where} / {inner or 'autograd (linear, add, view grads)'}"


def _source_line(frame: Any) -> str:
    import linecache

    return linecache.getline(frame.f_code.co_filename, frame.f_lineno)


class PhaseBytes(LiveBytes):
    """:class:`LiveBytes` that also counts the activations alone (every allocation not shaped like a parameter: the
    weights' gradients and their fp32 sums do not grow with the sequence, and FSDP2 moves a block's gradients to the
    host after its backward, which this single process does not) and keeps the activation peak of each phase of the
    step (:func:`_phase`) and what was alive at it, in ``phases``: ``{phase: (activation bytes, allocations, op,
    site)}``; ``activation_peak`` is the highest of them."""

    def __init__(self, parameter_shapes: set[tuple[int, ...]]) -> None:
        super().__init__()
        self.parameter_shapes = parameter_shapes
        self.activation = 0
        self.phases: dict[str, tuple[int, list[Allocation], str, str]] = {}
        self._frees = 0
        self._counted: set[int] = set()  # ptrs of the live activations

    def is_activation(self, a: Allocation) -> bool:
        return tuple(a.shape) not in self.parameter_shapes and a.nbytes > 1024

    @property
    def activation_peak(self) -> tuple[str, tuple[int, list[Allocation], str, str]]:
        return max(self.phases.items(), key=lambda kv: kv[1][0])

    def _free(self, ptr: int) -> None:
        self._frees += 1
        if ptr in self._counted:
            self._counted.discard(ptr)
            self.activation -= self._live[ptr].nbytes
        super()._free(ptr)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        count, frees = len(self._live), self._frees
        out = super().__torch_dispatch__(func, types, args, kwargs)
        fresh = len(self._live) - count + self._frees - frees  # allocations of this op: the newest entries
        if self._paused or fresh <= 0:
            return out
        grew = False
        for ptr, a in list(self._live.items())[-fresh:]:
            if self.is_activation(a):
                self._counted.add(ptr)
                self.activation += a.nbytes
                grew = True
        if not grew:
            return out
        phase = _phase()
        best = self.phases.get(phase)
        if best is None or self.activation > best[0]:
            alive = sorted((a for p, a in self._live.items() if p in self._counted), key=lambda a: -a.nbytes)
            self.phases[phase] = (self.activation, alive, str(func), next(reversed(self._live.values())).site)
        return out


@contextlib.contextmanager
def scaled_tiles(config: LlamaConfig, seq_len: int, reference: LlamaConfig, reference_len: int) -> Iterator[None]:
    """While inside, the tile sizes of the code are such that a run of ``config`` at ``seq_len`` tokens cuts its
    sequence into the same fraction per tile as ``reference`` at ``reference_len`` does: the RMSNorm, RoPE and MLP
    tiles (their bytes are per token times the hidden or intermediate width) scaled by the ratio of the hidden-sized
    tensors, the loss tiles (per token times the vocabulary) by the ratio of the logits."""
    hidden = seq_len * config.hidden_size / (reference_len * reference.hidden_size)
    logits = seq_len * config.vocab_size / (reference_len * reference.vocab_size)
    factors = [(ops, "TILE_BYTES", hidden), (tiling, "MLP_TILE_BYTES", hidden),
               (tiling, "MLP_UNTILED_BYTES", hidden), (tiling, "LOSS_TILE_BYTES", logits)]
    values = [getattr(module, name) for module, name, _ in factors]
    try:
        for (module, name, factor), value in zip(factors, values):
            setattr(module, name, max(1, int(value * factor)))
        yield
    finally:
        for (module, name, _), value in zip(factors, values):
            setattr(module, name, value)


@contextlib.contextmanager
def host_buffers_untracked(tracker: LiveBytes) -> Iterator[None]:
    """Host buffers of the stashes (attention chunks, block inputs) are not GPU memory: leave them out."""
    acquire = HostBufferPool.acquire

    def host_buffer(pool: HostBufferPool, *args: Any) -> Any:
        with tracker.untracked():
            return acquire(pool, *args)

    HostBufferPool.acquire = host_buffer
    try:
        yield
    finally:
        HostBufferPool.acquire = acquire


def build_step_model(
    config: LlamaConfig, num_chunks: int, *, backend: str = "auto", head_chunks: int = 1, prefetch: int = 1,
    reload_input: bool = False,
) -> LlamaForCausalLM:
    """The reference Llama in bf16 with the one-GPU options, installed in the strategy's order (attention, tiled MLP,
    tiled loss, activation offload with the attention recomputed, and its ``prefetch`` and ``reload_input``)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    attention = FPDTAttention(num_chunks=num_chunks, backend=backend, offload=True, offload_dq=True,
                              head_chunks=head_chunks)
    install_reference_llama(model, SequenceParallelContext(group=None, attention=attention))
    blocks = find_blocks(model)
    apply_tiled_mlp(model, blocks=blocks)
    apply_tiled_loss(model)
    ActivationOffload(recompute_attention=True, prefetch=prefetch, reload_input=reload_input).fpdt_transform(
        model, blocks)
    return model


@dataclass
class StepMemory:
    """One step's count: the overall peak and the per-phase peaks, in bytes, and the unit ``A`` (one hidden-sized
    bf16 tensor of the run)."""

    tracker: PhaseBytes
    unit: int
    seq_len: int
    reference_len: int
    model: LlamaForCausalLM


def measure_step(
    config: LlamaConfig, seq_len: int, num_chunks: int, *, reference_len: Optional[int] = None, backend: str = "auto",
    head_chunks: int = 1, prefetch: int = 1, reload_input: bool = False,
) -> StepMemory:
    """Count one training step (forward, loss, backward) of ``seq_len`` tokens with tiles as Llama-3-8B's at
    ``reference_len`` tokens (:func:`scaled_tiles`; default: ``seq_len``)."""
    reference_len = reference_len or seq_len
    reference = LlamaConfig.from_name("llama3-8b")
    model = build_step_model(config, num_chunks, backend=backend, head_chunks=head_chunks, prefetch=prefetch,
                             reload_input=reload_input)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (1, seq_len + 1), generator=gen)
    input_ids, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()  # shifted on the global sequence
    position_ids = torch.arange(seq_len).unsqueeze(0)
    tracker = PhaseBytes({tuple(p.shape) for p in model.parameters()})
    with scaled_tiles(config, seq_len, reference, reference_len), host_buffers_untracked(tracker), tracker:
        loss = model(input_ids=input_ids, position_ids=position_ids, labels=targets)
        loss.backward()
    return StepMemory(tracker, seq_len * config.hidden_size * 2, seq_len, reference_len, model)


def _describe(a: Allocation, step: StepMemory) -> str:
    return f"{a.nbytes / step.unit:7.3f} A  {str(a.dtype)[6:]:8s} {str(tuple(a.shape)):22s} {a.op:34s} {a.site}"


def report(step: StepMemory, top: int = 16) -> str:
    """Each phase's activation peak in units of A, the largest first, with the allocations alive at the highest
    and at the second-highest phase's peak."""
    lines = [f"S = {step.seq_len} tokens, tiles as at {step.reference_len}; A = {step.unit / 2**20:.2f} MiB; "
             f"overall peak with weight-shaped terms {step.tracker.peak / step.unit:.3f} A"]
    ranked = sorted(step.tracker.phases.items(), key=lambda kv: -kv[1][0])
    lines.append("activation peak of each phase (A):")
    for phase, (peak, alive, op, site) in ranked:
        lines.append(f"  {peak / step.unit:7.3f} A  {phase}  [{op} at {site.split(' < ')[0]}]")
    for title, (phase, (peak, alive, op, site)) in zip(("highest", "second"), ranked[:2]):
        lines.append(f"{title}: {phase}, {peak / step.unit:.3f} A, reached at {op} ({site})")
        lines.extend("  " + _describe(a, step) for a in alive[:top])
        rest = alive[top:]
        if rest:
            lines.append(f"  {sum(a.nbytes for a in rest) / step.unit:7.3f} A  ({len(rest)} more)")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--reference-len", type=int, default=1 << 20, help="the length whose tiles the run copies")
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--head-chunks", type=int, default=1, help="head groups G of the attention module")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=1, help="ActivationOffload(prefetch=...)")
    parser.add_argument("--reload-input", action="store_true", help="ActivationOffload(reload_input=True)")
    parser.add_argument("--vocab", type=int, default=512, help="small: the loss's vocabulary terms are constants")
    parser.add_argument("--narrow", type=int, default=1,
                        help="divide hidden, intermediate and head counts by this (head_dim kept): same ratios")
    args = parser.parse_args(argv)
    n = args.narrow
    config = LlamaConfig.from_name("llama3-8b", num_layers=args.layers, vocab_size=args.vocab,
                                   hidden_size=4096 // n, intermediate_size=14336 // n, num_heads=32 // n,
                                   num_kv_heads=max(1, 8 // n), head_dim=128)
    step = measure_step(config, args.seq_len, args.chunks, reference_len=args.reference_len,
                        head_chunks=args.head_chunks, prefetch=args.prefetch, reload_input=args.reload_input)
    print(report(step))


if __name__ == "__main__":
    main()
