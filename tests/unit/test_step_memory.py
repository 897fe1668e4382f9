"""The peak of a one-GPU training step, counted on the CPU (tests/step_memory.py, docs/planner.md): how many
hidden-sized tensors each phase holds under ActivationOffload(recompute_attention=True), TiledMLP, TiledLoss and the
offloaded FPDT attention."""

from __future__ import annotations

import functools

from lightning_fpdt.models.llama import LlamaConfig
from tests.step_memory import StepMemory, measure_step

SEQ_LEN, CHUNKS = 2048, 16


@functools.lru_cache(maxsize=None)
def _step(head_chunks: int = 1) -> StepMemory:
    # Llama-3-8B's per-token ratios at an eighth of its widths (head_dim kept), two layers, tiles as at 1M tokens
    config = LlamaConfig.from_name("llama3-8b", num_layers=2, vocab_size=512, hidden_size=512, intermediate_size=1792,
                                   num_heads=4, num_kv_heads=1, head_dim=128)
    return measure_step(config, SEQ_LEN, CHUNKS, reference_len=1 << 20, head_chunks=head_chunks)


def _block_phases(step: StepMemory, kind: str) -> dict[str, float]:
    """Activation peak, in units of A, of each phase of a block's recompute or backward (``kind``)."""
    return {phase: peak / step.unit for phase, (peak, *_) in step.tracker.phases.items() if f" {kind} / " in phase}


def test_block_backward_does_not_keep_the_recomputed_output():
    """The inner backward of a checkpointed block starts from gradient edges: the recomputed block output (one
    hidden-sized tensor, its value never read) is freed before the block's backward runs."""
    step = _step()
    chunk = step.unit / CHUNKS  # one bf16 chunk of q's size
    # At the step's peak (the attention backward of a block with the next input prefetched, docs/planner.md):
    # 8 hidden-sized tensors (block input, the prefetched next input, the incoming gradient, the input norm's output,
    # the attention output, the residual-stream gradient, dout, dq) and the half of one for dk, dv; the chunk terms of
    # the FPDT backward are 23 chunks at u = 16. With the recomputed output kept it was 10.94 A.
    phase = max(_block_phases(step, "backward").items(), key=lambda kv: kv[1])[0]
    peak, alive, *_ = step.tracker.phases[phase]
    hidden_sized = [a for a in alive if a.nbytes == step.unit]
    assert len(hidden_sized) == 8, [(a.op, a.site) for a in hidden_sized]
    assert peak <= 8.5 * step.unit + 24 * chunk, (phase, peak / step.unit)


def test_recompute_makes_no_hidden_sized_zeros():
    """In a block's recompute the TiledMLP value nothing reads is one zero broadcast to the input's shape, not a
    hidden-sized zero tensor: the recompute's highest point, its last residual add, holds 8 hidden-sized tensors."""
    step = _step()
    phase, peak = max(_block_phases(step, "recompute").items(), key=lambda kv: kv[1])
    _, alive, *_ = step.tracker.phases[phase]
    # block input, the prefetched next input, the incoming gradient, the two norms' outputs, the attention output,
    # the residual stream after attention, and the block output being made (9 with the zeros)
    assert len([a for a in alive if a.nbytes == step.unit]) == 8, (phase, [(a.op, a.site) for a in alive])
    assert peak <= 8.1, (phase, peak)
