"""The tiled loss on a GPU: the lm_head gradient summed in fp32 inside cuBLAS (marker gpu; run on the device)."""

import pytest
import torch

from lightning_fpdt.memory import tiled_loss
from lightning_fpdt.memory.tiled_loss import tiled_cross_entropy_forward

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_lm_head_gradient_accumulates_in_fp32_on_cuda():
    """bf16 hidden states and lm_head over 16 tiles: both gradients match fp64 from the same bf16 values; the fp32
    buffer is added to by cuBLAS (the fast path runs)."""
    device = torch.device("cuda")
    assert tiled_loss._accumulates_in_place(device, torch.bfloat16, torch.float32)
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, hidden, vocab = 4096, 256, 5000
    h = torch.randn(n, hidden, device=device, dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(vocab, hidden, device=device, generator=gen) * 0.05).to(torch.bfloat16)
    t = torch.randint(0, vocab, (n,), device=device, generator=gen)
    t[::7] = -100
    mean, _, grad_h, grad_w = tiled_cross_entropy_forward(h, w, t, 16, -100, hidden_grad=True, weight_grad=True)
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(h64 @ w64.T, t, ignore_index=-100)
    ref.backward()
    assert grad_w.dtype == torch.float32
    assert abs(mean.item() - ref.item()) < 1e-4 * ref.item()
    # the bf16 matmul operands (grad_logits rounded once, 2^-9 relative at most) set the error: the CPU path gives
    # 2.8e-3 for both gradients on these inputs
    assert _rel(grad_w, w64.grad) < 5e-3 and _rel(grad_h, h64.grad) < 5e-3
