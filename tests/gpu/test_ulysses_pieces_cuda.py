"""The one-chunk path in head pieces on several GPUs with NCCL: the all-to-alls of one piece in flight while another
piece attends, bf16 cuDNN kernels, against fp32 attention and against the chunk loop (marker gpu; >= 2 GPUs)."""

from __future__ import annotations

import pytest
import torch

from lightning_fpdt.offload.host_stash import StashFactory
from lightning_fpdt.sequence import HeadSplit, SequenceLayout, fpdt_attention
from lightning_fpdt.sequence.fpdt import head_pieces_for
from tests.gpu.nccl import REL_ERROR, relative_error, run_on_gpus
from tests.reference import causal_attention

pytestmark = pytest.mark.gpu


def _check(rank: int, world: int, heads: tuple[int, int], seq_len: int, offload: bool) -> None:
    assert head_pieces_for(HeadSplit(num_heads=heads[0], num_kv_heads=heads[1], sp_size=world), 1) == 2
    gen = torch.Generator(device="cuda").manual_seed(seq_len)  # every rank draws the same full inputs
    q = torch.randn(1, seq_len, heads[0], 128, device="cuda", generator=gen)
    k, v = (torch.randn(1, seq_len, heads[1], 128, device="cuda", generator=gen) for _ in range(2))
    dout = torch.randn(q.shape, device="cuda", generator=gen)
    ref_inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out = causal_attention(*ref_inputs)  # fp32
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, dout)
    results = {}
    for num_chunks in (1, 2):  # 1: head pieces; 2: the chunk loop, whole heads, as before the pieces
        layout = SequenceLayout(world, rank, num_chunks)
        local = [layout.shard(layout.pad(x.bfloat16(), dim=1)).requires_grad_() for x in (q, k, v)]
        out = fpdt_attention(*local, group=None, num_chunks=num_chunks, backend="cudnn",
                             stashes=StashFactory(offload=offload))
        grads = torch.autograd.grad(out, local, layout.shard(layout.pad(dout.bfloat16(), dim=1)))
        results[num_chunks] = [layout.gather(x.detach().contiguous(), None)[:, :seq_len] for x in (out, *grads)]
    case = f"P={world} heads={heads} S={seq_len} offload={offload}"
    for name, pieces, chunks, ref in zip(("out", "dq", "dk", "dv"), results[1], results[2], (ref_out, *ref_grads)):
        error, before = relative_error(pieces, ref), relative_error(chunks, ref)
        assert error < REL_ERROR, f"{case} {name}: relative error {error:.2e}"
        # the pieces round as whole heads do (one kernel call per head, same kernel): no worse than the chunk loop's
        # two blocks merged, with 10% room for the kernels' own tiling differences
        assert error <= 1.1 * before + 1e-4, f"{case} {name}: {error:.2e} against the chunk loop's {before:.2e}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 GPUs")
def test_ulysses_head_pieces_nccl_bf16_match_fp32_attention():
    """Head pieces under NCCL: output and q/k/v gradients within bf16 rounding of fp32 attention, padded lengths, the
    host stash and a kv head the pieces share included."""
    world = 4 if torch.cuda.device_count() >= 4 else 2
    heads = (32, 8) if world == 4 else (16, 4)  # Llama-3-8B's heads on 4 GPUs: 8 q, 2 kv a rank, two pieces
    # one kv head a rank, which the two pieces share (as Llama-3-8B on 8 GPUs): scattered, then replicated
    shared, replicated = ((32, 4), (32, 2)) if world == 4 else ((16, 2), (16, 1))
    # 8192 tokens: the fp32 reference holds (H, S, S) scores, 8 GiB for 32 heads
    cases = [dict(heads=heads, seq_len=8192, offload=False), dict(heads=heads, seq_len=4096 - 6, offload=True),
             dict(heads=shared, seq_len=8192, offload=False), dict(heads=replicated, seq_len=4096 - 6, offload=True)]
    run_on_gpus(_check, world, cases)
