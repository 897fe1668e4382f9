"""Packed documents in the FPDT attention: per-document causal masking against each document run on its own
(docs/design.md §4, §7)."""

from __future__ import annotations

import pytest
import torch

from lightning_fpdt.offload.host_stash import StashFactory
from lightning_fpdt.sequence import SequenceLayout, fpdt_attention
from lightning_fpdt.sequence.all_to_all import group_rank, group_size
from lightning_fpdt.sequence.documents import DocumentBoundaries
from tests.dist.attention_checks import assert_matches_reference, draw_inputs, reference
from tests.reference import documents_separately

# fp64: parallel and reference differ only in summation order (blockwise merge, per-segment sums), ~1e-15 relative;
# 1e-10 catches any token attending across a document boundary (that moves outputs by O(1e-1)).
# fp32 (CPU flash op): ~1e-7 per op, amplified by up to 8 merged blocks and fp32 gradient sums: 2e-5 absolute.
TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=2e-5, atol=2e-5)}


def random_starts(seq_len: int, gen: torch.Generator, force: list[int]) -> list[int]:
    """Document starts of one sequence: the forced ones (chunk/rank edges, length-1 documents) plus random ones."""
    cuts = set(force) | set(torch.randint(1, seq_len, (max(1, seq_len // 6),), generator=gen).tolist())
    return sorted({0} | {c for c in cuts if 0 < c < seq_len})


def check_packed(seq_len: int, num_chunks: int, heads: tuple[int, int], starts: list[list[int]], seed: int,
                 dtype: torch.dtype = torch.float64, backend: str = "math", offload: bool = False) -> None:
    """One case on every rank: shard, run with the documents, gather, compare output and q/k/v gradients."""
    sp_size, rank = group_size(None), group_rank(None)
    batch = len(starts)
    gen = torch.Generator().manual_seed(seed)  # every rank draws the same full inputs
    q, k, v, grad_out = draw_inputs(gen, batch=batch, seq_len=seq_len, heads=heads, head_dim=8)
    ref_out, ref_grads = reference(documents_separately, q, k, v, grad_out, starts)

    layout = SequenceLayout(sp_size, rank, num_chunks)
    documents = DocumentBoundaries(tuple(tuple(row) for row in starts), seq_len).padded(layout.padded_length(seq_len))
    # pad tokens are random here (not zeros): the pad document must keep them out of every real token's result
    pad_fill = torch.randn(batch, layout.padded_length(seq_len) - seq_len, 1, 1, generator=gen, dtype=torch.float64)
    local = [layout.shard(torch.cat([x, pad_fill.expand(-1, -1, *x.shape[2:])], dim=1).to(dtype)).requires_grad_()
             for x in (q, k, v)]
    local_grad_out = layout.shard(layout.pad(grad_out.to(dtype), dim=1))  # zero on pad tokens
    out = fpdt_attention(*local, group=None, num_chunks=num_chunks, backend=backend, documents=documents,
                         stashes=StashFactory(offload=offload, offload_dq=offload))
    grads = torch.autograd.grad(out, local, local_grad_out)

    case = f"S={seq_len} P={sp_size} u={num_chunks} heads={heads} starts={starts} {dtype} {backend}"
    assert_matches_reference(layout, seq_len, out, grads, ref_out, ref_grads, TOLERANCE[dtype], case)


def _cases(sp_size: int) -> list[dict]:
    heads_by_p = {1: [(4, 2)], 2: [(4, 4), (4, 1)], 3: [(6, 3)], 4: [(8, 2), (8, 8)]}
    cases = []
    for num_chunks in (1, 2, 4):
        pieces = sp_size * num_chunks
        for seq_len in (pieces * 3, pieces * 3 + 2):  # exact, and needing padding
            gen = torch.Generator().manual_seed(100 * sp_size + 10 * num_chunks + seq_len)
            # documents starting exactly at a piece edge (rank and chunk boundaries), and one of length 1 just after
            edge = 3 * (pieces // 2) if pieces > 1 else 1
            first = random_starts(seq_len, gen, force=[edge, edge + 1])
            second = random_starts(seq_len, gen, force=[1, seq_len - 1])  # length-1 documents at both ends
            for heads in heads_by_p[sp_size]:
                cases.append(dict(seq_len=seq_len, num_chunks=num_chunks, heads=heads, starts=[first, second],
                                  seed=len(cases)))
            # equal boundaries for both items (one kernel call per segment for the whole batch); a single document
            cases.append(dict(seq_len=seq_len, num_chunks=num_chunks, heads=heads_by_p[sp_size][0],
                              starts=[first, first], seed=50 + len(cases)))
            cases.append(dict(seq_len=seq_len, num_chunks=num_chunks, heads=heads_by_p[sp_size][-1],
                              starts=[[0], [0, seq_len // 2]], seed=70 + len(cases)))
    pieces = sp_size * 4
    gen = torch.Generator().manual_seed(sp_size)
    starts = [random_starts(pieces * 5 - 1, gen, force=[3]), random_starts(pieces * 5 - 1, gen, force=[pieces])]
    # through the host stash, and the CPU flash op in fp32
    cases.append(dict(seq_len=pieces * 5 - 1, num_chunks=4, heads=heads_by_p[sp_size][-1], starts=starts, seed=98,
                      offload=True))
    cases.append(dict(seq_len=pieces * 5 - 1, num_chunks=4, heads=heads_by_p[sp_size][-1], starts=starts, seed=99,
                      dtype=torch.float32, backend="flash"))
    return cases


def run_packed_cases(cases: list[dict]) -> None:
    for case in cases:
        check_packed(**case)


def test_packed_single_process():
    """P = 1, u = 1, 2, 4: each document attends only to itself (padding, length-1 documents, B = 2 unequal)."""
    run_packed_cases(_cases(1))


@pytest.mark.parametrize("sp_size", [2, 3, 4])
def test_packed_matches_documents_separately(dist_pool, sp_size):
    """P = 2, 3, 4 with u = 1, 2, 4: documents across chunk and rank edges, GQA, offload, fp32 flash: exact."""
    dist_pool(sp_size).run(run_packed_cases, cases=_cases(sp_size))
