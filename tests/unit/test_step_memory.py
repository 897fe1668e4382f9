"""The peak of a one-GPU training step, counted on the CPU (tests/step_memory.py, docs/planner.md): how many
hidden-sized tensors each phase holds under ActivationOffload(recompute_attention=True), TiledMLP, TiledLoss and the
offloaded FPDT attention."""

from __future__ import annotations

import functools

from lightning_fpdt.models.llama import LlamaConfig
from tests.step_memory import StepMemory, measure_step

SEQ_LEN, CHUNKS = 2048, 16


@functools.lru_cache(maxsize=None)
def _step(head_chunks: int = 1, prefetch: int = 1, reload_input: bool = False) -> StepMemory:
    # Llama-3-8B's per-token ratios at an eighth of its widths (head_dim kept), two layers, tiles as at 1M tokens
    config = LlamaConfig.from_name("llama3-8b", num_layers=2, vocab_size=512, hidden_size=512, intermediate_size=1792,
                                   num_heads=4, num_kv_heads=1, head_dim=128)
    return measure_step(config, SEQ_LEN, CHUNKS, reference_len=1 << 20, head_chunks=head_chunks, prefetch=prefetch,
                        reload_input=reload_input)


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
    # block input, the incoming gradient, the two norms' outputs, the attention output, the residual stream after
    # attention, and the block output being made (8 with the zeros; the next block's input is not back yet)
    assert len([a for a in alive if a.nbytes == step.unit]) == 7, (phase, [(a.op, a.site) for a in alive])
    assert peak <= 7.1, (phase, peak)


def _prefetched(alive: list) -> list:
    """The earlier blocks' inputs brought back ahead of their backward (not the block's own, which ``get`` loads)."""
    return [a for a in alive if "prefetch_before" in a.site]


def test_next_block_input_comes_back_after_the_mlp_backward():
    """In a block with a known MLP the input of the block before it is prefetched when the MLP's backward has
    ended: the recompute and the MLP backward (with the recomputed activations, the highest point of long runs under
    head groups) do not hold it; the attention backward, which hides the copy, does."""
    step = _step()
    last = max(int(phase.split()[1]) for phase in _block_phases(step, "backward"))  # the first block in backward
    phases = {**_block_phases(step, "recompute"), **_block_phases(step, "backward")}
    for phase in phases:
        if not phase.startswith(f"block {last} "):
            continue
        _, alive, *_ = step.tracker.phases[phase]
        early = " recompute / " in phase or phase.endswith("/ MLP backward")
        assert len(_prefetched(alive)) == (0 if early else 1), (phase, [a.site for a in _prefetched(alive)])
    # one hidden-sized tensor less than with the copy started at the block's backward (8.09 A then)
    assert phases[f"block {last} backward / MLP backward"] <= 7.1


def _inputs_back(alive: list) -> list:
    """The block input copies on the device: the block's own (``get``, or a reload's), the next one prefetched."""
    return [a for a in alive if "host_stash.py" in a.site and "block_offload.py" in a.site]


def test_reload_input_without_prefetch_holds_no_block_input_in_the_backward():
    """ActivationOffload(reload_input=True, prefetch=0): after the recompute a block's backward holds no block input
    until its first norm's backward takes its own back, at the end (its peak, in the phase of the norms' backward, is
    the other norm's): the block-backward peak (the attention backward)
    is two hidden-sized tensors lower than with the input held and the next one prefetched (9.94 A)."""
    step = _step(prefetch=0, reload_input=True)
    phases = _block_phases(step, "backward")
    for phase in phases:
        _, alive, *_ = step.tracker.phases[phase]
        held = [a.site for a in _inputs_back(alive) if a.nbytes == step.unit]
        assert len(held) <= (1 if phase.endswith("/ RMSNorm backward") else 0), (phase, held)  # its own, reloaded
    default = max(_block_phases(_step(), "backward").values())
    assert max(phases.values()) <= default - 1.99, (max(phases.values()), default)
