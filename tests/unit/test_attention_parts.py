"""The pieces of the FPDT attention: LSE merge, block kernels, stash life cycle, validation (docs/design.md §4)."""

import pytest
import torch

from lightning_fpdt.offload.host_stash import ChunkStash, StashFactory
from lightning_fpdt.sequence import FPDTAttention, check_heads, fpdt_attention, merge_partial
from lightning_fpdt.sequence.kernels import CudnnKernel, MathKernel, make_kernel, supported_backends


def _blocks_and_direct(scale: float, dtype=torch.float64):
    """Scores of one row set split in three key blocks, each block's (out, lse), and softmax over all of them."""
    gen = torch.Generator().manual_seed(int(scale))
    scores = [torch.randn(2, 3, 4, n, generator=gen, dtype=dtype) * scale for n in (5, 2, 7)]
    values = [torch.randn(2, 3, n, 6, generator=gen, dtype=dtype) for n in (5, 2, 7)]
    blocks = [(torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)) for s, v in zip(scores, values)]
    all_scores = torch.cat(scores, -1)
    direct = (torch.softmax(all_scores, -1) @ torch.cat(values, -2), torch.logsumexp(all_scores, -1))
    return blocks, direct


@pytest.mark.parametrize("scale", [1.0, 30.0, 1e4])
def test_merge_equals_softmax_over_concatenated_blocks(scale):
    """merge_partial over blocks equals one softmax over all keys, also at logits of ±1e4 (naive exp overflows)."""
    blocks, (direct_out, direct_lse) = _blocks_and_direct(scale)
    out = lse = None
    for block_out, block_lse in blocks:
        out, lse = merge_partial(out, lse, block_out, block_lse)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out, direct_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, direct_lse, rtol=1e-12, atol=1e-12)


def test_merge_in_fp32_at_extreme_logits():
    """fp32 blocks with logits of ±1e4 merge in fp32 without inf/NaN, to fp32 precision of the fp64 result."""
    blocks, (direct_out, _) = _blocks_and_direct(1e4)
    out = lse = None
    for block_out, block_lse in blocks:
        out, lse = merge_partial(out, lse, block_out.float(), block_lse.float())
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    # the weights exp(lse_b - lse) lose ~1e4 * 6e-8 = 6e-4 relative at these magnitudes
    torch.testing.assert_close(out.double(), direct_out, rtol=2e-3, atol=2e-3)


def test_merge_rows_without_keys_stay_zero():
    """Rows whose lse is -inf in both parts (no key seen yet) merge to zero, not NaN."""
    out = torch.zeros(1, 1, 2, 3)
    lse = torch.full((1, 1, 2), float("-inf"))
    merged, merged_lse = merge_partial(out, lse, torch.zeros(1, 1, 2, 3), lse.clone())
    assert torch.equal(merged, torch.zeros_like(merged)) and torch.isinf(merged_lse).all()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cpu_flash_kernel_matches_math_kernel(causal, dtype):
    """The CPU flash op kernel returns the math kernel's (out, lse) and, given them, its gradients; GQA included."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 6, 8, generator=gen, dtype=dtype)
    k, v = (torch.randn(2, 2, 6, 8, generator=gen, dtype=dtype) for _ in range(2))
    dout = torch.randn_like(q)
    math, flash = MathKernel(), make_kernel("flash", q.device, dtype)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)  # fp32 rounding
    out_m, lse_m = math.forward(q, k, v, causal=causal, scale=0.3)
    out_f, lse_f = flash.forward(q, k, v, causal=causal, scale=0.3)
    torch.testing.assert_close(out_f, out_m, **tol)
    torch.testing.assert_close(lse_f.to(lse_m.dtype), lse_m, **tol)
    grads_m = math.backward(dout, q, k, v, out_m, lse_m, causal=causal, scale=0.3)
    grads_f = flash.backward(dout, q, k, v, out_m, lse_m, causal=causal, scale=0.3)
    for gm, gf in zip(grads_m, grads_f):
        torch.testing.assert_close(gf, gm, **tol)
    assert grads_m[1].shape == k.shape  # GQA: kv gradients summed back to the kv heads


def test_block_backward_with_merged_lse_is_exact():
    """Two kv blocks, merged by LSE, each block's backward fed the merged (out, lse): the full-attention gradients."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 2, 8, 4, generator=gen, dtype=torch.float64)
    full = torch.softmax(q @ k.transpose(-1, -2) * 0.5, -1) @ v  # non-causal over all 8 keys
    ref = torch.autograd.grad(full, (q, k, v), dout)
    kernel = MathKernel()
    parts = [kernel.forward(q, k[:, :, s], v[:, :, s], causal=False, scale=0.5) for s in (slice(0, 3), slice(3, 8))]
    out, lse = merge_partial(None, None, *parts[0])
    out, lse = merge_partial(out, lse, *parts[1])
    g1 = kernel.backward(dout, q, k[:, :, :3], v[:, :, :3], out, lse, causal=False, scale=0.5)
    g2 = kernel.backward(dout, q, k[:, :, 3:], v[:, :, 3:], out, lse, causal=False, scale=0.5)
    torch.testing.assert_close(g1[0] + g2[0], ref[0])
    torch.testing.assert_close(torch.cat([g1[1], g2[1]], 2), ref[1])
    torch.testing.assert_close(torch.cat([g1[2], g2[2]], 2), ref[2])


def test_cudnn_kernel_computes_one_token_blocks_itself():
    """cuDNN refuses s_q = s_kv = 1 (a one-token document's diagonal): the kernel answers those with the math kernel
    (on any device, so this runs on CPU: a larger block would reach the CUDA op)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 1, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 1, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, 4, 1, 8, generator=gen, dtype=torch.float64)
    out, lse = CudnnKernel().forward(q, k, v, causal=True, scale=0.3)
    ref_out, ref_lse = MathKernel().forward(q, k, v, causal=True, scale=0.3)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    torch.testing.assert_close(out, v.repeat_interleave(2, dim=1), rtol=1e-12, atol=1e-12)  # one key: out = its value
    grads = CudnnKernel().backward(dout, q, k, v, out, lse, causal=True, scale=0.3)
    for got, want in zip(grads, MathKernel().backward(dout, q, k, v, out, lse, causal=True, scale=0.3)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_stash_life_cycle_misuse_raises():
    """put/get/free follow a life cycle; double put, get or free of an absent key raise RuntimeError."""
    stash = ChunkStash()
    t = torch.randn(3)
    stash.put(("k", 0), t)
    stash.prefetch(("k", 0))
    assert stash.get(("k", 0)) is t and stash.nbytes == 12 and ("k", 0) in stash
    with pytest.raises(RuntimeError, match="already stashed"):
        stash.put(("k", 0), t)
    stash.free(("k", 0))
    with pytest.raises(RuntimeError, match="get of \\('k', 0\\), which was never put or was already freed"):
        stash.get(("k", 0))
    with pytest.raises(RuntimeError, match="free of"):
        stash.free(("k", 0))
    with pytest.raises(RuntimeError, match="prefetch of"):
        stash.prefetch(("q", 1))
    assert len(stash) == 0


def test_head_validation_messages():
    """Head counts that Ulysses cannot split raise ValueErrors naming the valid sizes and the two GQA rules."""
    assert check_heads(32, 8, 4) == 1 and check_heads(32, 8, 16) == 2 and check_heads(8, 8, 1) == 1
    with pytest.raises(
        ValueError, match=r"num_heads \(6\) is not divisible by sequence_parallel_size \(4\).*\[1, 2, 3, 6\]"
    ):
        check_heads(6, 6, 4)
    with pytest.raises(
        ValueError, match=r"num_kv_heads \(6\) and sequence_parallel_size \(4\) must divide one another"
    ):
        check_heads(12, 6, 4)
    with pytest.raises(ValueError, match=r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"):
        check_heads(6, 4, 1)


def test_attention_argument_validation_messages():
    """fpdt_attention rejects non-causal use, bad shapes, undivisible lengths and unknown backends by name."""
    q, kv = torch.randn(1, 6, 2, 4), torch.randn(1, 6, 2, 4)
    with pytest.raises(ValueError, match="causal only"):
        fpdt_attention(q, kv, kv, causal=False)
    with pytest.raises(ValueError, match="equal shape"):
        fpdt_attention(q, kv, kv[:, :, :1])
    with pytest.raises(ValueError, match="must agree in batch, local length and head dim"):
        fpdt_attention(q, kv[:, :4], kv[:, :4])
    with pytest.raises(ValueError, match=r"local sequence length 6 is not divisible by num_chunks \(4\)"):
        fpdt_attention(q, kv, kv, num_chunks=4)
    with pytest.raises(ValueError, match=r"attention_backend must be one of .*got 'xformers'"):
        fpdt_attention(q, kv, kv, backend="xformers")
    with pytest.raises(ValueError, match=r"attention_backend='cudnn' cannot run torch.float32 on cpu"):
        fpdt_attention(q, kv, kv, backend="cudnn")
    with pytest.raises(ValueError, match="num_chunks must be >= 1"):
        FPDTAttention(num_chunks=0)
    assert supported_backends(torch.device("cpu"), torch.float32) == ["flash", "math"]


def test_no_grad_forward_keeps_nothing():
    """Under no_grad (validation) the forward stashes nothing for a backward, also when offloading."""
    made = []

    class Recording(StashFactory):
        def chunks(self, device):
            made.append(super().chunks(device))
            return made[-1]

    q = torch.randn(1, 8, 2, 4, requires_grad=True)
    for offload in (False, True):
        with torch.no_grad():
            fpdt_attention(q, q, q, num_chunks=4, stashes=Recording(offload=offload))
        assert len(made[-1]) == 0
