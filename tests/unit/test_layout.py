"""SequenceLayout arithmetic: the one definition of which tokens a rank holds (docs/design.md §3)."""

import pytest
import torch

from lightning_fpdt.sequence import SequenceLayout

GEOMETRIES = [(p, u) for p in (1, 2, 3, 4) for u in (1, 2, 4)]


@pytest.mark.parametrize("sp_size,num_chunks", GEOMETRIES)
def test_shard_unshard_round_trip(sp_size, num_chunks):
    """unshard(shards of every rank) gives back the global tensor, along any sequence dim."""
    seq_len = sp_size * num_chunks * 3
    x = torch.randn(2, seq_len, 5)
    layouts = [SequenceLayout(sp_size, r, num_chunks) for r in range(sp_size)]
    assert torch.equal(layouts[0].unshard([lay.shard(x, dim=1) for lay in layouts], dim=1), x)
    xt = x.transpose(0, 1).contiguous()  # sequence on dim 0
    assert torch.equal(layouts[0].unshard([lay.shard(xt, dim=0) for lay in layouts], dim=0), xt)


@pytest.mark.parametrize("sp_size,num_chunks", GEOMETRIES)
def test_local_chunk_i_is_global_piece_iP_plus_r(sp_size, num_chunks):
    """Local chunk i of rank r holds global piece i·P + r; together the ranks' chunk i is [i·C, (i+1)·C)."""
    c = 3
    seq_len = sp_size * num_chunks * c
    ids = torch.arange(seq_len).unsqueeze(0)
    for i in range(num_chunks):
        gathered = []
        for r in range(sp_size):
            layout = SequenceLayout(sp_size, r, num_chunks)
            chunk = layout.local_chunk(layout.shard(ids), i)
            piece = i * sp_size + r
            assert torch.equal(chunk[0], torch.arange(piece * c, (piece + 1) * c))
            gathered.append(chunk)
        assert torch.equal(torch.cat(gathered, dim=1)[0], torch.arange(i * sp_size * c, (i + 1) * sp_size * c))


@pytest.mark.parametrize("sp_size,num_chunks", GEOMETRIES)
def test_position_ids_are_global_indices(sp_size, num_chunks):
    """position_ids of a rank are the global indices of its tokens, i.e. the shard of arange(S)."""
    seq_len = sp_size * num_chunks * 2
    for r in range(sp_size):
        layout = SequenceLayout(sp_size, r, num_chunks)
        expected = layout.shard(torch.arange(seq_len).expand(3, -1))
        assert torch.equal(layout.position_ids(seq_len, batch_size=3), expected)
        assert torch.equal(layout.local_indices(seq_len), expected[0])


def test_padding_and_label_shift():
    """Right-padding reaches a multiple of P·u; labels are shifted globally; position ids continue through pads."""
    layout = SequenceLayout(3, 1, 2)
    labels = torch.arange(10).unsqueeze(0)
    assert layout.padded_length(10) == 12 and layout.local_length(10) == 4 and layout.chunk_length(10) == 2
    padded = layout.pad(labels, dim=1, value=-100)
    assert padded.tolist() == [list(range(10)) + [-100, -100]]
    shifted = SequenceLayout.shift_labels(labels)
    assert shifted.tolist() == [list(range(1, 10)) + [-100]]
    assert layout.pad_position_ids(torch.arange(10).unsqueeze(0)).tolist() == [list(range(12))]
    assert layout.pad(labels[:, :6]) is not None and layout.pad(labels[:, :6]).shape[1] == 6  # already a multiple


def test_layout_validation_messages():
    """Every wrong layout argument raises a ValueError naming the value and the fix."""
    with pytest.raises(ValueError, match="sp_size must be >= 1"):
        SequenceLayout(0, 0)
    with pytest.raises(ValueError, match=r"sp_rank must be in \[0, sp_size=2\)"):
        SequenceLayout(2, 2)
    with pytest.raises(ValueError, match="num_chunks must be >= 1"):
        SequenceLayout(2, 0, 0)
    with pytest.raises(
        ValueError, match=r"not divisible by sequence_parallel_size \(2\) \* chunks \(2\) = 4: pad it to 12"
    ):
        SequenceLayout(2, 0, 2).shard(torch.zeros(1, 10))
    with pytest.raises(ValueError, match="one shard per rank"):
        SequenceLayout(2, 0).unshard([torch.zeros(1, 4)])
    with pytest.raises(ValueError, match=r"local sequence length 5 is not divisible by num_chunks \(2\)"):
        SequenceLayout(2, 0, 2).local_chunk(torch.zeros(1, 5), 0)


@pytest.mark.parametrize("sp_size,num_chunks", [(3, 2), (2, 1), (4, 4)])
def test_batch_plan_marks_the_padding_of_each_rank(sp_size, num_chunks):
    """shard_batch's token mask is False exactly at the padding it added, on each rank's shard, and absent when
    nothing is padded."""
    from lightning_fpdt.strategy.batch import shard_batch

    seq_len = sp_size * num_chunks * 3 - 1
    input_ids = torch.randint(0, 100, (2, seq_len))
    masks = []
    for rank in range(sp_size):
        layout = SequenceLayout(sp_size, rank, num_chunks)
        sharded, plan = shard_batch({"input_ids": input_ids}, layout=layout, pad_token_id=0, pad_to_multiple=True)
        assert plan.token_mask.shape == sharded["input_ids"].shape
        masks.append(plan.token_mask)
    padded = SequenceLayout(sp_size, 0, num_chunks).unshard(masks, dim=1)
    assert padded.tolist() == [[True] * seq_len + [False]] * 2
    _, whole = shard_batch({"input_ids": input_ids[:, :seq_len - sp_size * num_chunks + 1]},
                           layout=SequenceLayout(sp_size, 0, num_chunks), pad_token_id=0, pad_to_multiple=True)
    assert whole.token_mask is None
