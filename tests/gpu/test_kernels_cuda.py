"""CUDA block kernels and the chunked attention on one GPU (marker gpu; run on the device machine)."""

import pytest
import torch

from lightning_fpdt.sequence import fpdt_attention
from lightning_fpdt.sequence.kernels import MathKernel, make_kernel, supported_backends
from tests.reference import causal_attention

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("backend", ["cudnn", "flash"])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_kernel_matches_math(backend, causal):
    """cuDNN / flash ops give the fp32 math kernel's (out, lse) and, fed them, its gradients (bf16, GQA)."""
    if backend not in supported_backends(torch.device("cuda"), torch.bfloat16):
        pytest.skip(f"{backend} not available")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 512, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(2, 2, 512, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    dout = torch.randn_like(q)
    kernel, math = make_kernel(backend, q.device, q.dtype), MathKernel()
    out, lse = kernel.forward(q, k, v, causal=causal, scale=128 ** -0.5)
    out_m, lse_m = math.forward(q.float(), k.float(), v.float(), causal=causal, scale=128 ** -0.5)
    assert _rel(out, out_m) < 1e-2 and _rel(lse, lse_m) < 1e-3  # bf16 operands: ~3e-3 relative
    grads = kernel.backward(dout, q, k, v, out_m.to(q.dtype), lse_m, causal=causal, scale=128 ** -0.5)
    grads_m = math.backward(dout.float(), q.float(), k.float(), v.float(), out_m, lse_m, causal=causal,
                            scale=128 ** -0.5)
    for g, gm in zip(grads, grads_m):
        assert g.shape == gm.shape and _rel(g, gm) < 2e-2


@pytest.mark.parametrize("backend", ["cudnn", "flash"])
@pytest.mark.parametrize("num_chunks", [1, 4])
def test_chunked_attention_bf16_matches_fp64(backend, num_chunks):
    """FPDT attention on one GPU in bf16 (u = 1, 4) is within bf16 precision of fp64 attention, with gradients."""
    if backend not in supported_backends(torch.device("cuda"), torch.bfloat16):
        pytest.skip(f"{backend} not available")
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, 2048, 8, 128, device="cuda", generator=gen)
    k, v = (torch.randn(1, 2048, 2, 128, device="cuda", generator=gen) for _ in range(2))
    dout = torch.randn_like(q)
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref = causal_attention(*ref_in)
    ref_grads = torch.autograd.grad(ref, ref_in, dout.double())
    inputs = [x.bfloat16().requires_grad_() for x in (q, k, v)]
    out = fpdt_attention(*inputs, num_chunks=num_chunks, backend=backend)
    grads = torch.autograd.grad(out, inputs, dout.bfloat16())
    assert _rel(out, ref) < 1e-2
    for g, rg in zip(grads, ref_grads):
        assert _rel(g, rg) < 2e-2
