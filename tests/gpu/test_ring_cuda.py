"""The Ulysses x ring hybrid on several GPUs with NCCL, bf16 cuDNN/flash kernels (marker gpu; needs >= 2 GPUs)."""

from __future__ import annotations

import pytest
import torch

from lightning_fpdt.offload.host_stash import StashFactory
from lightning_fpdt.sequence import SequenceLayout, new_sequence_groups, ring_attention
from tests.gpu.nccl import REL_ERROR, relative_error, run_on_gpus
from tests.reference import causal_attention

pytestmark = pytest.mark.gpu


def _check(rank: int, world: int, ring_size: int, heads: tuple[int, int], backend: str, offload: bool,
           seq_len: int) -> None:
    groups = new_sequence_groups(ring_size)
    gen = torch.Generator(device="cuda").manual_seed(0)  # every rank draws the same full inputs
    q = torch.randn(1, seq_len, heads[0], 128, device="cuda", generator=gen)
    k, v = (torch.randn(1, seq_len, heads[1], 128, device="cuda", generator=gen) for _ in range(2))
    dout = torch.randn(q.shape, device="cuda", generator=gen)  # from gen too: the same on every rank
    ref_inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out = causal_attention(*ref_inputs)  # fp32, one GPU
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, dout)

    layout = SequenceLayout(world, rank, 1, ring_size=ring_size)
    local = [layout.shard(layout.pad(x.bfloat16())).requires_grad_() for x in (q, k, v)]
    out = ring_attention(*local, group=groups, backend=backend, stashes=StashFactory(offload=offload))
    grads = torch.autograd.grad(out, local, layout.shard(layout.pad(dout.bfloat16())))
    case = f"P={world} R={ring_size} heads={heads} {backend} offload={offload}"
    for name, got, ref in (("out", out.detach(), ref_out.detach()), *zip(("dq", "dk", "dv"), grads, ref_grads)):
        full = layout.gather(got.contiguous(), None)[:, :seq_len]
        error = relative_error(full, ref)
        assert error < REL_ERROR, f"{case} {name}: relative error {error:.2e}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 GPUs")
def test_ring_nccl_bf16_matches_fp32_attention():
    """NCCL point-to-point ring, bf16 cuDNN and flash kernels, P > query heads, GQA, offloaded shares: output and
    gradients within bf16 rounding of single-GPU fp32 attention."""
    world = 4 if torch.cuda.device_count() >= 4 else 2
    cases = [
        dict(ring_size=2, heads=(8, 2), backend="cudnn", offload=False, seq_len=8192),
        dict(ring_size=2, heads=(8, 2), backend="flash", offload=True, seq_len=8192 - 5),  # padded
        dict(ring_size=world, heads=(2, 1), backend="cudnn", offload=True, seq_len=4096),  # pure ring, P > 2 heads
    ]
    if world == 4:
        cases.append(dict(ring_size=2, heads=(2, 1), backend="cudnn", offload=False, seq_len=4096))  # U = 2 > Hkv
    run_on_gpus(_check, world, cases)
