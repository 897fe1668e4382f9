"""Packed documents with the CUDA block kernels (marker gpu; run on the device machine)."""

import pytest
import torch

from lightning_fpdt.sequence import fpdt as fpdt_module
from lightning_fpdt.sequence import fpdt_attention
from lightning_fpdt.sequence.documents import DocumentBoundaries
from lightning_fpdt.sequence.kernels import supported_backends
from tests.reference import documents_separately

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("varlen", [True, False])
@pytest.mark.parametrize("backend", ["cudnn", "flash"])
@pytest.mark.parametrize("num_chunks", [1, 4])
def test_packed_bf16_matches_documents_separately(monkeypatch, backend, num_chunks, varlen):
    """Packed documents on CUDA, one varlen flash call per block or one cuDNN / flash call per segment (odd offsets,
    length-1 documents, documents spanning chunks, B = 2 with different boundaries, GQA): within bf16 precision of
    each document alone in fp64."""
    if backend not in supported_backends(torch.device("cuda"), torch.bfloat16):
        pytest.skip(f"{backend} not available")
    made = []
    original = fpdt_module.varlen_kernel_for
    monkeypatch.setattr(fpdt_module, "varlen_kernel_for",
                        lambda *a: made.append(original(*a) if varlen else None) or made[-1])
    seq_len = 2048
    starts = [[0, 1, 300, 301, 777, 1024, 1025, 1999], [0, 511, 1536, 2047]]
    gen = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(2, seq_len, 8, 128, device="cuda", generator=gen)
    k, v = (torch.randn(2, seq_len, 2, 128, device="cuda", generator=gen) for _ in range(2))
    dout = torch.randn_like(q)
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref = documents_separately(*ref_in, starts)
    ref_grads = torch.autograd.grad(ref, ref_in, dout.double())
    inputs = [x.bfloat16().requires_grad_() for x in (q, k, v)]
    documents = DocumentBoundaries(tuple(tuple(row) for row in starts), seq_len)
    out = fpdt_attention(*inputs, num_chunks=num_chunks, backend=backend, documents=documents)
    grads = torch.autograd.grad(out, inputs, dout.bfloat16())
    assert (made[-1] is not None) == varlen
    assert _rel(out, ref) < 1e-2  # bf16 operands: ~3e-3 relative
    for g, rg in zip(grads, ref_grads):
        assert _rel(g, rg) < 2e-2
