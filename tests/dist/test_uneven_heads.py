"""Uneven head splits (docs/design.md §4, "Heads"): P that divides neither the query heads, nor the kv heads, nor
both, against single-process attention, forward and q/k/v gradients; chunks, the host stash and packed documents;
whole training against one process, also with the stashes spilling to the disk tier."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_fpdt.callbacks.activation_offload import ActivationOffload
from lightning_fpdt.sequence import SequenceLayout, all_to_all_head_to_seq, all_to_all_seq_to_head
from lightning_fpdt.sequence.all_to_all import group_rank, group_size
from lightning_fpdt.sequence.heads import HeadSplit
from tests.dist import test_strategy_parity as parity
from tests.dist.test_packed_attention import check_packed, random_starts
from tests.dist.test_fpdt_attention import TOLERANCE, run_attention_cases

# (num_heads, num_kv_heads) per P that the even split refuses: P divides neither H nor Hkv ((4, 4), (4, 2) on 3),
# H but not the kv heads ((12, 6) on 4: each rank's 3 q heads straddle two kv heads; (6, 4)-like shapes are not GQA),
# and neither, with kv heads read on two ranks ((6, 2), (14, 2) on 4: Qwen2.5-0.5B's heads)
UNEVEN = {
    3: [(4, 4), (4, 2), (8, 2)],
    4: [(6, 2), (12, 6), (14, 2), (6, 6)],
}


def _cases(sp_size: int) -> list[dict]:
    cases = []
    for heads in UNEVEN[sp_size]:
        assert not HeadSplit(num_heads=heads[0], num_kv_heads=heads[1], sp_size=sp_size).even
        for num_chunks in (1, 2):
            seq_len = sp_size * num_chunks * 3 + (num_chunks - 1)  # exact, and (u = 2) needing padding
            cases.append(dict(seq_len=seq_len, num_chunks=num_chunks, heads=heads, dtype=torch.float64,
                              backend="math", seed=len(cases)))
    # through the host stash (the partial dQ sums too): the stash holds each rank's un-expanded kv heads
    cases.append(dict(seq_len=sp_size * 4 * 2 + 1, num_chunks=4, heads=UNEVEN[sp_size][1], dtype=torch.float64,
                      backend="math", seed=50, offload=True, offload_dq=True))
    # the CPU flash op in fp32
    cases.append(dict(seq_len=sp_size * 2 * 5 - 2, num_chunks=2, heads=UNEVEN[sp_size][-1], dtype=torch.float32,
                      backend="flash", seed=99))
    return cases


@pytest.mark.parametrize("sp_size", [3, 4])
def test_uneven_heads_match_single_process(dist_pool, sp_size):
    """P = 3 (4 q, 4 or 2 kv heads) and 4 (6 q and 2 kv, 12 q and 6 kv, 14 q and 2 kv): exact outputs, gradients."""
    dist_pool(sp_size).run(run_attention_cases, cases=_cases(sp_size))


def _packed_cases(sp_size: int) -> list[dict]:
    cases = []
    # the first split with the kernels' own grouping on every rank; (8, 2) on 3 and (12, 6) on 4 expand kv locally
    for heads in (UNEVEN[sp_size][0], {3: (8, 2), 4: (12, 6)}[sp_size]):
        for num_chunks in (1, 2):
            seq_len = sp_size * num_chunks * 3 + 2
            gen = torch.Generator().manual_seed(10 * sp_size + num_chunks)
            starts = [random_starts(seq_len, gen, force=[3]), random_starts(seq_len, gen, force=[1, seq_len - 1])]
            cases.append(dict(seq_len=seq_len, num_chunks=num_chunks, heads=heads, starts=starts, seed=len(cases),
                              offload=num_chunks == 2))
    return cases


def run_packed_cases(cases: list[dict]) -> None:
    for case in cases:
        check_packed(**case)


@pytest.mark.parametrize("sp_size", [3, 4])
def test_uneven_heads_packed_documents(dist_pool, sp_size):
    """Packed documents with an uneven split: each document attends only to itself, exactly."""
    dist_pool(sp_size).run(run_packed_cases, cases=_packed_cases(sp_size))


def _check_all_to_all(heads: tuple[int, int], seed: int) -> None:
    sp_size, rank = group_size(None), group_rank(None)
    split = HeadSplit(num_heads=heads[0], num_kv_heads=heads[1], sp_size=sp_size)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3 * sp_size, heads[0], 4, generator=gen, dtype=torch.float64)  # global (B, S, H, D)
    k = torch.randn(2, 3 * sp_size, heads[1], 4, generator=gen, dtype=torch.float64)
    grads = [torch.randn(2, 3 * sp_size, h, 4, generator=gen, dtype=torch.float64) for h in heads]
    layout = SequenceLayout(sp_size, rank, 1)
    q_local, k_local = (layout.shard(t).requires_grad_() for t in (q, k))
    ranges = split.ranges("q", "kv")
    q_heads, k_heads = all_to_all_seq_to_head(q_local, k_local, group=None, ranges=ranges)
    (q_start, q_stop), (kv_start, kv_stop) = split.q_range(rank), split.kv_range(rank)
    # every token of the group, this rank's q heads and the kv heads they read, in (B, h_r, S, D) order
    torch.testing.assert_close(q_heads, q[:, :, q_start:q_stop].transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(k_heads, k[:, :, kv_start:kv_stop].transpose(1, 2), rtol=0, atol=0)
    (back,) = all_to_all_head_to_seq(q_heads, group=None, ranges=ranges[:1])
    torch.testing.assert_close(back, q_local, rtol=0, atol=0)
    # backward: a kv head's gradient is the sum of the gradients of its copies on every rank that received it
    grad_q, grad_k = torch.autograd.grad(
        (q_heads, k_heads), (q_local, k_local),
        (grads[0][:, :, q_start:q_stop].transpose(1, 2), grads[1][:, :, kv_start:kv_stop].transpose(1, 2)),
    )
    torch.testing.assert_close(grad_q, layout.shard(grads[0]), rtol=0, atol=0)
    copies = torch.tensor([sum(a <= h < b for a, b in split.kv_ranges) for h in range(heads[1])], dtype=torch.float64)
    # fp64 sums of up to P equal values: exact to rounding
    torch.testing.assert_close(grad_k, layout.shard(grads[1]) * copies.view(1, 1, -1, 1), rtol=1e-12, atol=1e-12)


def run_all_to_all_cases(cases: list[dict]) -> None:
    for case in cases:
        _check_all_to_all(**case)


@pytest.mark.parametrize("sp_size", [3, 4])
def test_uneven_all_to_all_round_trip_and_gradient(dist_pool, sp_size):
    """seq->head with unequal splits gives each rank its q heads and the kv heads they read; head->seq inverts it for
    q; the backward sums a replicated kv head's gradients."""
    dist_pool(sp_size).run(run_all_to_all_cases, cases=[dict(heads=h, seed=n) for n, h in enumerate(UNEVEN[sp_size])])


def run_training(cases: list[dict]) -> None:
    for case in cases:
        activation_offload = case.pop("activation_offload", False)
        parity.train_and_compare(**case, callbacks=[ActivationOffload()] if activation_offload else [])


# Tolerance: test_strategy_parity.TOL (fp32, rtol 1e-4 / atol 2e-5) on losses and parameters after 3 SGD steps: the
# parallel run sums the same products in another order (blockwise softmax, a kv head's gradient summed over the ranks
# that read it), ~1e-7 relative per op; a q head attending the wrong kv head or a lost kv gradient copy moves the loss
# or a parameter by > 1e-3.


def test_training_parity_uneven_heads_four_processes(dist_pool):
    """1×4 with 6 query / 2 kv heads (2, 2, 1, 1 query heads a rank; kv head 0 read on ranks 0 and 1, kv head 1 on
    ranks 1 to 3): the reference Llama with chunks 2, host offload and ActivationOffload, a Qwen2-shaped HF model
    with chunks 2, and sequence_parallel_size "auto" taking all 4 ranks for 6 heads."""
    dist_pool(4).run(run_training, cases=[
        dict(kind="llama-6q2kv", dp=1, sp=4, chunks=2, accumulate=1, seq_len=23, offload=True,
             activation_offload=True),
        dict(kind="hf-qwen2-6q2kv", dp=1, sp=4, chunks=2, accumulate=1, seq_len=16),
        dict(kind="hf-qwen2-6q2kv", dp=1, sp=4, chunks=1, accumulate=1, seq_len=16, strategy_name=True),
    ])


def test_training_parity_uneven_heads_three_processes(dist_pool):
    """1×3 with 4 query / 2 kv heads (2, 1, 1 query heads a rank), chunks 2; and head groups (8 query / 4 kv heads
    in 2 groups of 4 / 2, each split unevenly over the 3 ranks)."""
    dist_pool(3).run(run_training, cases=[
        dict(kind="llama", dp=1, sp=3, chunks=2, accumulate=1, seq_len=18),
        dict(kind="llama-gqa8", dp=1, sp=3, chunks=2, accumulate=1, seq_len=18, head_chunks=2, offload=True),
    ])


def _even_split_takes_the_equal_all_to_all(cases: list[dict]) -> None:
    from lightning_fpdt.sequence import all_to_all

    def refuse(*args, **kwargs):
        raise AssertionError("an even head split went through the all-to-all of unequal blocks")

    saved = all_to_all._exchange_uneven
    all_to_all._exchange_uneven = refuse
    try:
        run_attention_cases(cases)
    finally:
        all_to_all._exchange_uneven = saved


def test_even_split_keeps_the_equal_all_to_all(dist_pool):
    """When P divides the heads (kv heads scattered or replicated) the attention never takes the unequal all-to-all."""
    cases = [dict(seq_len=4 * 2 * 3, num_chunks=2, heads=heads, dtype=torch.float64, backend="math", seed=n)
             for n, heads in enumerate([(8, 8), (8, 4), (8, 2)])]
    dist_pool(4).run(_even_split_takes_the_equal_all_to_all, cases=cases)


# The attention's host budget when its stash spills: one or two of a rank's chunks (a (B, h_r or hk_r, S/u, D) fp32
# chunk is 768 or 1,536 bytes here), so each rank keeps its first entries in host memory and writes the rest, of
# sizes that differ from rank to rank
ATTENTION_HOST_BYTES = 2048


def run_training_spilling_to_disk(offload_dir: str, case: dict) -> dict[str, int]:
    """``case`` trained (:func:`parity.train_and_compare`) with a plan made as on a GPU (this host has none): one of
    the two block inputs on disk, and the attention's chunks and partial dQ sums beyond ``ATTENTION_HOST_BYTES``.
    Returns how many entries of each went to a file on this rank."""
    from lightning_fpdt.callbacks.tiled_loss import TiledLoss
    from lightning_fpdt.callbacks.tiled_mlp import TiledMLP
    from lightning_fpdt.offload.disk import DiskStash
    from lightning_fpdt.planner import plan_memory
    from lightning_fpdt.strategy import budget

    def planned(memory, seq_len, batch_size):
        return plan_memory(geometry=memory.facts.network.config, seq_len=seq_len, batch_size=batch_size,
                           num_gpus=memory.facts.world_size, sequence_parallel_size=case["sp"], chunks=case["chunks"],
                           offload=True, offload_dq=True, head_chunks=1, activation_offload=True, tiled_mlp=True,
                           tiled_loss=True, precision="32-true", recompute_attention=False, reload_input=False,
                           prefetch=1, keep_inputs="all", checkpoint_blocks="all", gpu_memory_gib=80,
                           disk_memory_gib=1, disk_inputs=1)

    def configure_disk(memory, plan):
        real_configure(memory, plan)
        if plan is not None:  # the plan gives the attention room for all its chunks: a tighter host spills them
            memory.attention.stashes.disk.host_budget_bytes = ATTENTION_HOST_BYTES

    spilled: dict[int, int] = {}

    def put(stash, key, tensor):
        real_put(stash, key, tensor)
        if stash.on_disk(key):
            spilled[id(stash.tier)] = spilled.get(id(stash.tier), 0) + 1

    real_plan, real_configure, real_put = budget.plan_for, budget.MemoryBudget.configure_disk, DiskStash.put
    budget.plan_for, budget.MemoryBudget.configure_disk, DiskStash.put = planned, configure_disk, put
    callbacks = [ActivationOffload(prefetch=1, recompute_attention=False, reload_input=False), TiledMLP(num_tiles=2),
                 TiledLoss(num_tiles=2)]
    try:
        trainer = parity.train_and_compare(**case, offload=True, offload_dq=True, offload_dir=offload_dir,
                                           callbacks=callbacks)
    finally:
        budget.plan_for, budget.MemoryBudget.configure_disk, DiskStash.put = real_plan, real_configure, real_put
    memory = trainer.strategy.memory
    assert memory.plan is not None and memory.plan.options.disk_inputs == 1
    return {"attention": spilled.get(id(memory.attention.stashes.disk), 0),
            "block inputs": spilled.get(id(callbacks[0].stashes.disk), 0)}


# Tolerance: test_strategy_parity.TOL (fp32, rtol 1e-4 / atol 2e-5) on the losses of 3 SGD steps and every
# parameter, and each parameter within UPDATE_TOL (1e-2) of its own update, i.e. of lr x its gradients: the files
# hold the bytes that went in, so only the reordered sums of the run in host memory remain (~1e-7 relative per op);
# an entry read back wrong (a chunk 1% off moves the loss by ~1e-3) or another rank's kv heads read would fail it.
def test_training_parity_uneven_heads_with_the_disk_tier(dist_pool, tmp_path):
    """6 query / 2 kv heads on 4 ranks train as one process with both stashes spilling to disk on every rank."""
    case = dict(kind="llama-6q2kv", dp=1, sp=4, chunks=2, accumulate=1, seq_len=23)
    spilled = dist_pool(4).run(run_training_spilling_to_disk, offload_dir=str(tmp_path / "spill"), case=case)
    assert all(counts["attention"] > 0 and counts["block inputs"] > 0 for counts in spilled), spilled
    assert os.listdir(tmp_path / "spill") == [], "spill files left after the fit"
