"""FPDT / Ulysses attention on several gloo processes against single-process fp64 attention (docs/design.md §4, §7)."""

from __future__ import annotations

import pytest
import torch

from lightning_fpdt.sequence import (
    SequenceLayout,
    all_to_all_head_to_seq,
    all_to_all_seq_to_head,
    fpdt_attention,
)
from lightning_fpdt.offload.host_stash import StashFactory
from lightning_fpdt.sequence.all_to_all import group_rank, group_size
from tests.dist.attention_checks import assert_matches_reference, draw_inputs, reference
from tests.reference import causal_attention

# (num_heads, num_kv_heads) per sequence-parallel size: MHA, GQA with kv heads scattered (Hkv % P == 0), GQA with kv
# heads replicated (P % Hkv == 0)
HEADS = {
    1: [(4, 4), (4, 2)],
    2: [(4, 4), (4, 2), (4, 1)],
    3: [(6, 6), (6, 3), (6, 1)],
    4: [(8, 8), (8, 4), (8, 2)],
}
# fp64: the parallel and the reference computations differ only in summation order, so they agree to ~1e-15
# relative; 1e-10 leaves room for long sums while catching any wrong index (errors are then O(1)).
# fp32 (CPU flash kernel): per-block rounding of ~1e-7 relative, amplified by the softmax merge over up to 8 blocks
# and the fp32 gradient accumulation: 2e-5 absolute on O(1) values.
TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=2e-5, atol=2e-5)}


def _check_attention(seq_len: int, num_chunks: int, heads: tuple[int, int], dtype: torch.dtype, backend: str, seed: int,
                     offload: bool = False, offload_dq: bool = False):
    """One case on every rank: shard, run, gather, compare output and q/k/v gradients with the reference."""
    sp_size, rank = group_size(None), group_rank(None)
    gen = torch.Generator().manual_seed(seed)  # every rank draws the same full inputs
    q, k, v, grad_out = draw_inputs(gen, batch=2, seq_len=seq_len, heads=heads, head_dim=8)
    ref_out, ref_grads = reference(causal_attention, q, k, v, grad_out)

    layout = SequenceLayout(sp_size, rank, num_chunks)
    # pad tokens sit after every real token, so causality keeps them out of the real tokens' results
    local = [layout.shard(layout.pad(x.to(dtype), dim=1)).requires_grad_() for x in (q, k, v)]
    local_grad_out = layout.shard(layout.pad(grad_out.to(dtype), dim=1))  # zero on pad tokens
    stashes = StashFactory(offload=offload, offload_dq=offload_dq)
    out = fpdt_attention(*local, group=None, num_chunks=num_chunks, backend=backend, stashes=stashes)
    grads = torch.autograd.grad(out, local, local_grad_out)

    case = f"S={seq_len} P={sp_size} u={num_chunks} heads={heads} {dtype} {backend} offload={offload}/{offload_dq}"
    assert_matches_reference(layout, seq_len, out, grads, ref_out, ref_grads, TOLERANCE[dtype], case)


def run_attention_cases(cases: list[dict]) -> None:
    for case in cases:
        _check_attention(**case)


def _cases(sp_size: int) -> list[dict]:
    cases = []
    for num_chunks in (1, 2, 4):
        for heads in HEADS[sp_size]:
            for seq_len in (sp_size * num_chunks * 3, sp_size * num_chunks * 3 + 1):  # exact and needing padding
                cases.append(dict(seq_len=seq_len, num_chunks=num_chunks, heads=heads, dtype=torch.float64,
                                  backend="math", seed=len(cases)))
    # chunks through the host stash (and the partial dQ sums too), every GQA kind; one chunk (the Ulysses loop, in
    # head pieces where the heads split) through the host stash too
    for heads in HEADS[sp_size]:
        cases.append(dict(seq_len=sp_size * 3 + 1, num_chunks=1, heads=heads, dtype=torch.float64, backend="math",
                          seed=70 + len(cases), offload=True))
        cases.append(dict(seq_len=sp_size * 4 * 2 + 1, num_chunks=4, heads=heads, dtype=torch.float64, backend="math",
                          seed=50 + len(cases), offload=True, offload_dq=len(cases) % 2 == 0))
    # the CPU flash op in fp32, on the GQA case with the most blocks
    cases.append(dict(seq_len=sp_size * 4 * 5 - 2, num_chunks=4, heads=HEADS[sp_size][-1], dtype=torch.float32,
                      backend="flash", seed=99))
    return cases


def test_fpdt_single_process():
    """P = 1: chunked attention (u = 1, 2, 4) equals full attention, forward and q/k/v gradients."""
    run_attention_cases(_cases(1))


@pytest.mark.parametrize("sp_size", [2, 3, 4])
def test_fpdt_matches_single_process(dist_pool, sp_size):
    """P = 2, 3, 4 with u = 1, 2, 4, MHA and both GQA cases, padded lengths, host offload: exact outputs, gradients."""
    dist_pool(sp_size).run(run_attention_cases, cases=_cases(sp_size))


def _check_all_to_all(seed: int) -> None:
    sp_size, rank = group_size(None), group_rank(None)
    gen = torch.Generator().manual_seed(seed)
    num_heads = 2 * sp_size
    x = torch.randn(2, 3 * sp_size, num_heads, 4, generator=gen, dtype=torch.float64)  # global (B, S, H, D)
    y = torch.randn(2, 3 * sp_size, 2 * num_heads, 4, generator=gen, dtype=torch.float64)  # wider second tensor
    g = torch.randn(2, 3 * sp_size, num_heads, 4, generator=gen, dtype=torch.float64)
    layout = SequenceLayout(sp_size, rank, 1)
    x_local, y_local = (layout.shard(t).requires_grad_() for t in (x, y))
    x_heads, y_heads = all_to_all_seq_to_head(x_local, y_local, group=None)
    heads = slice(rank * num_heads // sp_size, (rank + 1) * num_heads // sp_size)
    # head-sharded: every token of the group, this rank's heads, in (B, h/P, S, D) order
    torch.testing.assert_close(x_heads, x[:, :, heads].transpose(1, 2), rtol=0, atol=0)
    wide = slice(rank * 2 * num_heads // sp_size, (rank + 1) * 2 * num_heads // sp_size)
    torch.testing.assert_close(y_heads, y[:, :, wide].transpose(1, 2), rtol=0, atol=0)
    (back,) = all_to_all_head_to_seq(x_heads, group=None)
    torch.testing.assert_close(back, x_local, rtol=0, atol=0)
    # backward of seq->head is head->seq: d/dx_local of <x_heads, g_heads> is this rank's shard of g
    (grad,) = torch.autograd.grad(x_heads, x_local, g[:, :, heads].transpose(1, 2))
    torch.testing.assert_close(grad, layout.shard(g), rtol=0, atol=0)


@pytest.mark.parametrize("sp_size", [2, 3])
def test_all_to_all_round_trip_and_gradient(dist_pool, sp_size):
    """seq->head gives each rank its heads of the whole sequence; head->seq inverts it; backward is the reverse."""
    dist_pool(sp_size).run(_check_all_to_all, seed=sp_size)
