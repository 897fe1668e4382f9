"""Uneven head splits on several GPUs with NCCL (unequal all-to-all splits), bf16 cuDNN/flash kernels and the varlen
kernel of packed documents (marker gpu; needs >= 2 GPUs)."""

from __future__ import annotations

import pytest
import torch

from lightning_fpdt.offload.host_stash import StashFactory
from lightning_fpdt.sequence import DocumentBoundaries, HeadSplit, SequenceLayout, fpdt_attention
from tests.gpu.nccl import REL_ERROR, relative_error, run_on_gpus
from tests.reference import causal_attention, documents_separately

pytestmark = pytest.mark.gpu


def _check(rank: int, world: int, heads: tuple[int, int], backend: str, num_chunks: int, offload: bool, seq_len: int,
           packed: bool = False) -> None:
    assert not HeadSplit(num_heads=heads[0], num_kv_heads=heads[1], sp_size=world).even
    gen = torch.Generator(device="cuda").manual_seed(0)  # every rank draws the same full inputs
    q = torch.randn(1, seq_len, heads[0], 128, device="cuda", generator=gen)
    k, v = (torch.randn(1, seq_len, heads[1], 128, device="cuda", generator=gen) for _ in range(2))
    dout = torch.randn(q.shape, device="cuda", generator=gen)
    starts = [[0, 1000, 1001, seq_len // 2 + 7]] if packed else None
    ref_inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out = documents_separately(*ref_inputs, starts) if packed else causal_attention(*ref_inputs)  # fp32
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, dout)

    layout = SequenceLayout(world, rank, num_chunks)
    documents = None
    if packed:
        documents = DocumentBoundaries(tuple(tuple(row) for row in starts), seq_len).padded(
            layout.padded_length(seq_len))
    local = [layout.shard(layout.pad(x.bfloat16(), dim=1)).requires_grad_() for x in (q, k, v)]
    out = fpdt_attention(*local, group=None, num_chunks=num_chunks, backend=backend, documents=documents,
                         stashes=StashFactory(offload=offload, offload_dq=offload))
    grads = torch.autograd.grad(out, local, layout.shard(layout.pad(dout.bfloat16(), dim=1)))
    case = f"P={world} heads={heads} {backend} u={num_chunks} offload={offload} packed={packed}"
    for name, got, ref in (("out", out.detach(), ref_out.detach()), *zip(("dq", "dk", "dv"), grads, ref_grads)):
        full = layout.gather(got.contiguous(), None)[:, :seq_len]
        error = relative_error(full, ref)
        assert error < REL_ERROR, f"{case} {name}: relative error {error:.2e}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 GPUs")
def test_uneven_heads_nccl_bf16_matches_fp32_attention():
    """NCCL all-to-all of unequal head blocks, bf16 cuDNN and flash kernels with kv heads expanded locally, chunks,
    offloaded stash, packed documents on the varlen kernel: output and gradients within bf16 rounding of fp32."""
    world = 4 if torch.cuda.device_count() >= 4 else 2
    if world == 4:  # 14 / 2: Qwen2.5-0.5B's heads; 6 / 2; 12 / 6: each rank's 3 q heads straddle two kv heads
        heads = [(14, 2), (6, 2), (12, 6)]
    else:  # 6 / 3: 3 q heads a rank over 2 kv heads; 3 / 1: 2 and 1 q heads
        heads = [(6, 3), (3, 1), (6, 3)]
    cases = [
        dict(heads=heads[0], backend="cudnn", num_chunks=2, offload=False, seq_len=8192),
        dict(heads=heads[1], backend="flash", num_chunks=2, offload=True, seq_len=8192 - 5),  # padded
        dict(heads=heads[2], backend="auto", num_chunks=2, offload=True, seq_len=4096, packed=True),
    ]
    run_on_gpus(_check, world, cases)
