"""HeadSplit: which query and kv heads each sequence-parallel rank attends for (docs/design.md §4, "Heads")."""

from __future__ import annotations

import pytest

from lightning_fpdt.planner import plan_memory
from lightning_fpdt.planner.step_sizes import StepSizes
from lightning_fpdt.sequence.heads import HeadSplit
from lightning_fpdt.sequence.planning import AttentionGeometry, stash_bytes
from lightning_fpdt.sequence.sizes import resolve_sizes


def test_uneven_split_blocks_and_kv_heads():
    """The first H mod P ranks get one more q head; each rank gets the contiguous kv heads its q heads read."""
    split = HeadSplit(num_heads=14, num_kv_heads=2, sp_size=4)  # Qwen2.5-0.5B on 4 ranks
    assert split.q_ranges == ((0, 4), (4, 8), (8, 11), (11, 14))
    assert split.kv_ranges == ((0, 1), (0, 2), (1, 2), (1, 2))  # kv head 1 goes to three ranks
    assert not split.even and split.kv_repeat == 1
    assert (split.max_heads, split.max_kv_heads) == (4, 2)
    assert split.local_kv_index(1) == (0, 0, 0, 1)  # q heads 4-6 read kv head 0, q head 7 kv head 1
    assert split.local_kv_index(0) is None and split.local_kv_index(2) is None  # the kernels' own grouping
    three = HeadSplit(num_heads=4, num_kv_heads=4, sp_size=3)
    assert three.q_ranges == three.kv_ranges == ((0, 2), (2, 3), (3, 4))
    straddle = HeadSplit(num_heads=12, num_kv_heads=6, sp_size=4)  # P divides H, not the kv heads
    assert straddle.q_ranges == ((0, 3), (3, 6), (6, 9), (9, 12))
    assert straddle.kv_ranges == ((0, 2), (1, 3), (3, 5), (4, 6))
    assert straddle.local_kv_index(0) == (0, 0, 1) and straddle.local_kv_index(1) == (0, 1, 1)


@pytest.mark.parametrize(("heads", "sp_size", "kv_repeat"), [((32, 8), 4, 1), ((32, 8), 16, 2), ((8, 2), 4, 2)])
def test_even_split_is_the_equal_all_to_all(heads, sp_size, kv_repeat):
    """When P divides H and Hkv, P divide one another the split is even: no ranges (the equal-split all-to-all),
    kv heads replicated P/Hkv times when P > Hkv, and the ranges it would give agree with that replication."""
    split = HeadSplit(num_heads=heads[0], num_kv_heads=heads[1], sp_size=sp_size)
    assert split.even and split.ranges("q", "kv") is None and split.kv_repeat == kv_repeat
    for rank in range(sp_size):
        start, stop = split.q_range(rank)
        assert stop - start == heads[0] // sp_size
        assert split.kv_range(rank) == ((rank // kv_repeat, rank // kv_repeat + 1) if kv_repeat > 1 else
                                        (rank * heads[1] // sp_size, (rank + 1) * heads[1] // sp_size))
        assert split.local_kv_index(rank) is None


def test_split_refusals_name_the_fix():
    """More ranks than query heads, and H not a multiple of Hkv, are refused with the fix."""
    with pytest.raises(ValueError, match=r"num_heads \(2\) < sequence_parallel_size \(4\).*ring_size"):
        HeadSplit(num_heads=2, num_kv_heads=1, sp_size=4)
    with pytest.raises(ValueError, match=r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"):
        HeadSplit(num_heads=6, num_kv_heads=4, sp_size=2)
    with pytest.raises(ValueError, match="sequence_parallel_size must be a positive int, got 0"):
        HeadSplit(num_heads=6, num_kv_heads=2, sp_size=0)


def test_planner_counts_the_busiest_rank():
    """The planner plans all GPUs of a host for heads they do not divide, and counts the busiest rank's ⌈H/P⌉ query
    heads (and the kv heads they read) in the stash and the attention's time; an even split is counted as before."""
    uneven = AttentionGeometry(num_layers=1, num_heads=14, num_kv_heads=2, head_dim=64)  # Qwen2.5-0.5B's heads
    local = 2 * 4096 // 4
    # rank 0 holds q heads 0-3 (as if every rank held 4: 16) and rank 1 reads both kv heads (2 a rank: 8)
    assert stash_bytes(uneven, batch_size=2, seq_len=4096, sp_size=4) == local * (16 + 2 * 8) * 64 * 2 + local * 16 * 4
    even = AttentionGeometry(num_layers=1, num_heads=32, num_kv_heads=8, head_dim=64)
    assert stash_bytes(even, batch_size=2, seq_len=4096, sp_size=4) == local * (32 + 2 * 8) * 64 * 2 + local * 32 * 4
    plan = plan_memory(geometry="llama3-8b", seq_len=65536, num_gpus=3, activation_offload=True, tiled_mlp=True,
                       tiled_loss=True)
    assert (plan.options.sequence_parallel_size, plan.options.ring_size) == (3, 1)  # 32 heads: 11, 11, 10
    sizes = StepSizes(g=plan.geometry, o=plan.options, seq_len=plan.padded_seq_len, batch_size=1, num_gpus=3)
    assert sizes.attention_heads == 33 and sizes.attn_width == 32 * 128
    assert resolve_sizes(world_size=4, devices_per_node=4, data_parallel_size="auto", sequence_parallel_size="auto",
                         heads=(14, 2)) == (1, 4)


@pytest.mark.parametrize(("heads", "sp_size", "num_chunks", "pieces", "shared_kv"), [
    ((32, 8), 4, 1, 2, False),  # Llama-3-8B on 4 ranks: 8 q and 2 kv heads a rank split in two
    ((32, 8), 8, 1, 2, True),  # one kv head a rank: the q heads split, the pieces share the kv head
    ((32, 8), 16, 1, 2, True),  # kv heads replicated: one a rank, shared
    ((32, 2), 32, 1, 1, False),  # one q head a rank: nothing to split
    ((24, 6), 2, 1, 1, False),  # 12 q and 3 kv heads a rank: the kv heads neither split in two nor are one
    ((32, 8), 4, 2, 1, False),  # chunks: the chunk loop, not the one-chunk path
    ((32, 8), 1, 1, 1, False),  # one rank: no all-to-all to hide
    ((14, 2), 4, 1, 1, False),  # uneven split: the unequal all-to-all, whole
])
def test_head_pieces_of_the_one_chunk_path(heads, sp_size, num_chunks, pieces, shared_kv):
    """The one-chunk path splits every rank's q heads into ULYSSES_HEAD_PIECES where they divide and its kv heads
    either divide too or are one (shared by the pieces), else 1."""
    from lightning_fpdt.sequence.fpdt import ULYSSES_HEAD_PIECES, FPDTPlan, head_pieces_for

    assert ULYSSES_HEAD_PIECES == 2
    split = HeadSplit(num_heads=heads[0], num_kv_heads=heads[1], sp_size=sp_size)
    assert head_pieces_for(split, num_chunks) == pieces
    plan = FPDTPlan(group=None, layout=None, kernel=None, scale=1.0, heads=split, head_pieces=pieces)
    assert plan.shared_kv is shared_kv


def test_exchange_life_cycle():
    """An exchange starts once and is waited for once: misuse raises RuntimeError; one rank returns its blocks."""
    import torch

    from lightning_fpdt.sequence.all_to_all import Exchange

    block = torch.randn(1, 3, 4)
    exchange = Exchange([block.transpose(1, 2)], None, 1)
    with pytest.raises(RuntimeError, match="start it once, wait once"):
        exchange.wait()
    (received,) = exchange.start().wait()
    assert torch.equal(received, block.transpose(1, 2)) and received.is_contiguous()
    with pytest.raises(RuntimeError, match="wait called on an exchange that is done"):
        exchange.wait()
    with pytest.raises(RuntimeError, match="start called on an exchange that is done"):
        exchange.start()
