"""SequenceLayout with a ring dimension (P = U·R, head-tail ring pieces): the one definition the ring attention,
the strategy and the tests share (docs/ring.md)."""

import pytest
import torch

from lightning_fpdt.sequence import SequenceLayout

# (U, R): Ulysses ranks per ring rank, ring ranks; odd U puts a Ulysses part across the head/tail boundary
RING_GEOMETRIES = [(1, 2), (2, 2), (1, 4), (3, 2), (2, 3), (1, 3), (4, 1), (2, 1)]


def _layouts(ulysses: int, ring: int) -> list[SequenceLayout]:
    sp_size = ulysses * ring
    return [SequenceLayout(sp_size, r, 1, ring_size=ring) for r in range(sp_size)]


@pytest.mark.parametrize("ulysses,ring", RING_GEOMETRIES)
def test_ring_round_trip_and_every_token_once(ulysses, ring):
    """unshard(shard of every rank) is the identity along any dim, and every global token lives on exactly one rank."""
    layouts = _layouts(ulysses, ring)
    seq_len = layouts[0].num_pieces * 3
    x = torch.randn(2, seq_len, 5)
    assert torch.equal(layouts[0].unshard([lay.shard(x, dim=1) for lay in layouts], dim=1), x)
    xt = x.transpose(0, 1).contiguous()
    assert torch.equal(layouts[0].unshard([lay.shard(xt, dim=0) for lay in layouts], dim=0), xt)
    owned = torch.cat([lay.local_indices(seq_len) for lay in layouts])
    assert torch.equal(owned.sort().values, torch.arange(seq_len))


@pytest.mark.parametrize("ulysses,ring", RING_GEOMETRIES)
def test_ring_rank_holds_head_and_tail_pieces(ulysses, ring):
    """Ring rank ρ's Ulysses ranks (consecutive sp ranks) together hold pieces ρ and 2R−1−ρ, in that order; the
    Ulysses all-to-all (source-rank order) therefore yields exactly share_indices."""
    layouts = _layouts(ulysses, ring)
    seq_len = layouts[0].num_pieces * 2
    piece = seq_len // (2 * ring)
    for rho in range(ring):
        group = layouts[rho * ulysses:(rho + 1) * ulysses]
        assert [lay.ring_rank for lay in group] == [rho] * ulysses
        assert [lay.ulysses_rank for lay in group] == list(range(ulysses))
        gathered = torch.cat([lay.local_indices(seq_len) for lay in group])
        head, tail = (rho, 2 * ring - 1 - rho) if ring > 1 else (0, 1)
        expected = torch.cat([torch.arange(head * piece, (head + 1) * piece),
                              torch.arange(tail * piece, (tail + 1) * piece)])
        assert torch.equal(gathered, expected)
        assert torch.equal(group[0].share_indices(seq_len), expected)


@pytest.mark.parametrize("ulysses,ring", RING_GEOMETRIES)
def test_ring_position_ids_are_global_indices(ulysses, ring):
    """position_ids of a rank are the shard of arange(S), also with the ring layout."""
    for layout in _layouts(ulysses, ring):
        seq_len = layout.num_pieces * 2
        expected = layout.shard(torch.arange(seq_len).expand(3, -1))
        assert torch.equal(layout.position_ids(seq_len, batch_size=3), expected)


@pytest.mark.parametrize("ulysses,ring", RING_GEOMETRIES)
def test_ring_padding_and_label_shift_follow_the_layout(ulysses, ring):
    """Padding reaches a multiple of 2P; labels shifted globally then sharded lose no target; pads are -100 and
    continue the positions, wherever they land."""
    layouts = _layouts(ulysses, ring)
    multiple = layouts[0].num_pieces
    assert multiple == (2 * ulysses * ring if ring > 1 else ulysses)
    seq_len = multiple * 2 + 1  # needs padding
    padded = layouts[0].padded_length(seq_len)
    assert padded % multiple == 0 and 0 < padded - seq_len < multiple
    ids = torch.arange(100, 100 + seq_len).unsqueeze(0)
    targets = layouts[0].pad(SequenceLayout.shift_labels(ids), value=-100)
    positions = layouts[0].pad_position_ids(torch.arange(seq_len).unsqueeze(0))
    for layout in layouts:
        local_targets, local_positions = layout.shard(targets), layout.shard(positions)
        indices = layout.local_indices(padded)
        assert torch.equal(local_positions[0], indices)
        for t, target in zip(indices.tolist(), local_targets[0].tolist()):
            assert target == (100 + t + 1 if t + 1 < seq_len else -100)


@pytest.mark.parametrize("ring", [2, 3, 4])
def test_ring_blocks_match_the_causal_mask(ring):
    """ring_block(κ) is exactly the causal mask between ring rank ρ's q share and ring rank κ's kv share: rows and
    columns outside the block see nothing; inside, all (full blocks) or the lower triangle (the diagonal)."""
    seq_len = 2 * ring * 3
    for rho in range(ring):
        layout = SequenceLayout(ring, rho, 1, ring_size=ring)  # U = 1
        q_pos = layout.share_indices(seq_len)
        for kappa in range(ring):
            kv_pos = layout.share_indices(seq_len, ring_rank=kappa)
            mask = q_pos[:, None] >= kv_pos[None, :]  # what causal attention allows
            block = layout.ring_block(kappa, len(q_pos))
            inside = torch.zeros_like(mask)
            inside[block.q, block.kv] = True
            assert not mask[~inside].any(), f"ρ={rho} κ={kappa}: a visible score outside {block}"
            expected = torch.ones_like(mask[block.q, block.kv])
            if block.causal:
                expected = expected.tril()
            assert torch.equal(mask[block.q, block.kv], expected), f"ρ={rho} κ={kappa}: {block}"
            if kappa != rho:  # load balance: every off-diagonal step is one (S/R)·(S/2R) block
                assert mask[block.q, block.kv].numel() == len(q_pos) * len(q_pos) // 2


def test_ring_layout_validation_messages():
    """A ring size that does not divide P, or FPDT chunks with a ring, raise ValueErrors naming the fix."""
    with pytest.raises(ValueError, match=r"ring_size \(3\) must be a positive divisor of sequence_parallel_size \(4\)"):
        SequenceLayout(4, 0, 1, ring_size=3)
    with pytest.raises(ValueError, match=r"use chunks=1 with ring_size > 1, or ring_size=1"):
        SequenceLayout(4, 0, 2, ring_size=2)
    with pytest.raises(ValueError, match=r"2 \* sequence_parallel_size \(4\) with ring_size 2 = 8: pad it to 16"):
        SequenceLayout(4, 0, 1, ring_size=2).shard(torch.zeros(1, 12))
