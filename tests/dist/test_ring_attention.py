"""Hybrid Ulysses × ring attention on gloo processes against single-process fp64 causal attention (docs/ring.md)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_fpdt.callbacks.activation_offload import ActivationOffload
from lightning_fpdt.models.llama import LlamaConfig, LlamaForCausalLM
from lightning_fpdt.offload.host_stash import StashFactory
from lightning_fpdt.sequence import FPDTAttention, SequenceLayout, ring_attention
from lightning_fpdt.integrations import SequenceParallelContext, install_reference_llama
from lightning_fpdt.memory import find_blocks
from lightning_fpdt.sequence.ring import RingComm, new_sequence_groups
from tests.dist.attention_checks import assert_matches_reference, draw_inputs, reference
from tests.reference import causal_attention

# fp64: parallel and reference differ only in summation order (~1e-15 relative); 1e-10 catches any wrong index or
# mask (errors are then O(1)).
# fp32 (CPU flash op): ~1e-7 relative rounding per block, amplified by the log-sum-exp merge over up to 2R blocks
# and the fp32 dK/dV sums carried around the ring: 2e-5 absolute on O(1) values.
TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=2e-5, atol=2e-5)}


def _check_ring(groups, ring_size: int, seq_len: int, heads: tuple[int, int], dtype: torch.dtype, backend: str,
                seed: int, through_module: bool = False, offload: bool = False) -> None:
    """Shard with the ring layout, run, gather; compare output and q/k/v gradients with the reference."""
    sp_size, rank = dist.get_world_size(), dist.get_rank()  # ring-major groups over the world: sp rank = rank
    gen = torch.Generator().manual_seed(seed)  # every rank draws the same full inputs
    q, k, v, grad_out = draw_inputs(gen, batch=2, seq_len=seq_len, heads=heads, head_dim=4)
    ref_out, ref_grads = reference(causal_attention, q, k, v, grad_out)

    layout = SequenceLayout(sp_size, rank, 1, ring_size=ring_size)
    # pad tokens sit after every real token, so causality keeps them out of the real tokens' results
    local = [layout.shard(layout.pad(x.to(dtype), dim=1)).requires_grad_() for x in (q, k, v)]
    local_grad_out = layout.shard(layout.pad(grad_out.to(dtype), dim=1))
    if through_module:  # what the strategy installs: FPDTAttention bound to the pair
        out = FPDTAttention(group=groups, backend=backend, offload=offload)(*local)
    else:  # offload: the shares wait in the host stash (plain tensors on CPU, the same life cycle)
        out = ring_attention(*local, group=groups, backend=backend, stashes=StashFactory(offload=offload))
    grads = torch.autograd.grad(out, local, local_grad_out)

    case = f"S={seq_len} U={sp_size // ring_size} R={ring_size} heads={heads} {dtype} {backend} offload={offload}"
    assert_matches_reference(layout, seq_len, out, grads, ref_out, ref_grads, TOLERANCE[dtype], case)


def run_ring_cases(ring_size: int, cases: list[dict]) -> None:
    groups = new_sequence_groups(ring_size)
    for case in cases:
        _check_ring(groups, ring_size, **case)


def _cases(sp_size: int, ring_size: int, head_choices: list[tuple[int, int]]) -> list[dict]:
    multiple = 2 * sp_size if ring_size > 1 else sp_size
    cases = []
    for heads in head_choices:
        for seq_len in (multiple * 2, multiple * 2 + 3):  # exact and needing padding
            cases.append(dict(seq_len=seq_len, heads=heads, dtype=torch.float64, backend="math", seed=len(cases)))
    # the CPU flash op in fp32, on the last (GQA) geometry; and the module the strategy installs
    cases.append(dict(seq_len=multiple * 3 - 1, heads=head_choices[-1], dtype=torch.float32, backend="flash", seed=90))
    cases.append(dict(seq_len=multiple * 2 + 1, heads=head_choices[0], dtype=torch.float64, backend="math", seed=91,
                      through_module=True))
    for through_module in (False, True):  # the host stash, through both entry points
        cases.append(dict(seq_len=multiple * 2 + 5, heads=head_choices[-1], dtype=torch.float64, backend="math",
                          seed=92 + through_module, through_module=through_module, offload=True))
    return cases


def test_ring_two_processes(dist_pool):
    """U=1, R=2: pure ring with head-tail pieces, MHA and GQA (2 query heads, 1 kv head), padded lengths."""
    dist_pool(2).run(run_ring_cases, ring_size=2, cases=_cases(2, 2, [(2, 2), (2, 1)]))


@pytest.mark.parametrize("ring_size,heads", [
    (2, [(2, 2), (2, 1), (4, 2)]),  # U=2, R=2: P = 4 > 2 query heads (plain Ulysses refuses); kv replicated, scattered
    (4, [(1, 1), (2, 1)]),  # U=1, R=4: one query head on four ranks
    (1, [(4, 4), (4, 2)]),  # U=4, R=1: the pair falls back to FPDT over the Ulysses group (sanity)
])
def test_ring_four_processes(dist_pool, ring_size, heads):
    """(U, R) in {(2, 2), (1, 4), (4, 1)}: exact outputs and q/k/v gradients, MHA and GQA, padded lengths."""
    dist_pool(4).run(run_ring_cases, ring_size=ring_size, cases=_cases(4, ring_size, heads))


def _check_comm_life_cycle() -> None:
    _, ring_group = new_sequence_groups(2)
    comm = RingComm(ring_group, tag=5)
    with pytest.raises(RuntimeError, match="wait called before start"):
        comm.wait()
    rank = dist.get_rank()
    comm.start(torch.full((3,), float(rank)))
    with pytest.raises(RuntimeError, match="start called again before wait"):
        comm.start(torch.zeros(3))
    assert comm.wait().tolist() == [float(1 - rank)] * 3  # from the previous ring rank (the other one, R = 2)


def test_ring_comm_life_cycle(dist_pool):
    """RingComm: receives the previous ring rank's tensor; wait before start, or start twice, raise RuntimeError."""
    dist_pool(2).run(_check_comm_life_cycle)


def _check_heads_message() -> None:
    groups = new_sequence_groups(2)  # U = 2, R = 2
    q = torch.randn(1, 4, 3, 4)
    with pytest.raises(ValueError, match=r"U = sequence_parallel_size \(4\) / ring_size \(2\) = 2 ranks"):
        ring_attention(q, q, q, group=groups)
    with pytest.raises(ValueError, match=r"use chunks=1 with ring_size > 1"):
        ring_attention(*(torch.randn(1, 4, 2, 4) for _ in range(3)), group=groups, num_chunks=2)


def test_ring_validation_messages(dist_pool):
    """Heads that U = P/R cannot split, and FPDT chunks with a ring, raise ValueErrors printing the factors."""
    dist_pool(4).run(_check_heads_message)


def _check_checkpointing(offload: bool) -> None:
    groups = new_sequence_groups(2)  # U = 2, R = 2: P = 4 > 2 query heads
    layout = SequenceLayout(4, dist.get_rank(), 1, ring_size=2)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(3))
    targets = SequenceLayout.shift_labels(ids)
    local_ids, local_targets = layout.shard(ids), layout.shard(targets)
    models, attentions = [], []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig.from_name("tiny", vocab_size=64, num_heads=2, num_kv_heads=1)).double()
        attention = FPDTAttention(group=groups, backend="math", offload=offload)
        context = SequenceParallelContext(group=dist.group.WORLD, attention=attention,
                                          position_ids=layout.position_ids(24, batch_size=2))
        install_reference_llama(model, context)
        if wrap:
            ActivationOffload(offload=offload).fpdt_transform(model, find_blocks(model))
        for _ in range(2):
            model(input_ids=local_ids, labels=local_targets).backward()
        models.append(model)
        attentions.append(attention)
    assert attentions[0].kernel_calls == attentions[1].kernel_calls == 2 * 2  # 2 layers, 2 steps: no recompute
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12, msg=name)  # fp64, same arithmetic


@pytest.mark.parametrize("offload", [False, True])
def test_ring_under_activation_checkpointing_runs_attention_once(dist_pool, offload):
    """ActivationOffload with the ring hybrid: the recompute takes the first forward's output and stash (kernel calls
    = layers x steps), gradients equal those without checkpointing; also with the shares in the host stash."""
    dist_pool(4).run(_check_checkpointing, offload=offload)
