"""The reference Llama's tiled RMSNorm and RoPE (lightning_fpdt/fused/ops.py): exact gradients, the plain forms'
values, several tiles equal to one, and nothing large saved for backward."""

from __future__ import annotations

import pytest
import torch

from lightning_fpdt.fused import ops
from lightning_fpdt.integrations.huggingface import tile_hf_rms_norms


def plain_rms_norm(x, weight, eps):
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def plain_rotary(x, position_ids, theta):
    acc = torch.promote_types(x.dtype, torch.float32)
    inv_freq = 1.0 / (theta ** (torch.arange(0, x.shape[-1], 2, dtype=acc) / x.shape[-1]))
    angles = position_ids.to(acc)[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]
    x_c = x.to(acc)
    x1, x2 = x_c.chunk(2, dim=-1)
    return (x_c * angles.cos() + torch.cat((-x2, x1), dim=-1) * angles.sin()).to(x.dtype)


@pytest.fixture(params=[None, 4 * 64 * 8], ids=["one-tile", "many-tiles"])
def tile_bytes(request, monkeypatch):
    """Run each test with one tile and with tiles of a few tokens (TILE_BYTES shrunk)."""
    if request.param is not None:
        monkeypatch.setattr(ops, "TILE_BYTES", request.param)
    return request.param


def test_rms_norm_gradcheck_and_plain_values(tile_bytes):
    """fp64 gradcheck of input and weight; values and gradients equal the plain autograd form's."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 37, 64, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(64, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: ops.rms_norm(a, b, 1e-5), (x, w))
    g = torch.randn(2, 37, 64, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(ops.rms_norm(x, w, 1e-5), (x, w), g)
    want = torch.autograd.grad(plain_rms_norm(x, w, 1e-5), (x, w), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)  # fp64: the same maths, another summation order


def test_rms_norm_bf16_matches_plain_form(tile_bytes):
    """bf16 input, fp32 weight (bf16-mixed master) and bf16 weight: the forward is the plain form's to the bit (the
    same fp32 ops per token); gradients within bf16 rounding (the plain form sums the weight gradient in bf16)."""
    gen = torch.Generator().manual_seed(1)
    for weight_dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 29, 64, generator=gen).bfloat16().requires_grad_()
        w = (1 + 0.1 * torch.randn(64, generator=gen)).to(weight_dtype).requires_grad_()
        out, ref = ops.rms_norm(x, w, 1e-5), plain_rms_norm(x, w, 1e-5)
        assert out.dtype == ref.dtype and torch.equal(out, ref)
        g = torch.randn(out.shape, generator=gen).to(out.dtype)
        for a, b in zip(torch.autograd.grad(out, (x, w), g), torch.autograd.grad(ref, (x, w), g)):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)  # bf16: 8 mantissa bits, sums of ~87 products


def test_rotary_gradcheck_and_plain_values(tile_bytes):
    """fp64 gradcheck (the backward is the inverse rotation); bf16 values equal the plain form's to the bit."""
    gen = torch.Generator().manual_seed(2)
    position_ids = torch.randint(0, 100_000, (2, 23), generator=gen)
    x = torch.randn(2, 23, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: ops.rotary(a, position_ids, 500_000.0), (x,))
    torch.testing.assert_close(ops.rotary(x, position_ids, 500_000.0), plain_rotary(x, position_ids, 500_000.0),
                               rtol=1e-12, atol=1e-12)
    xb = torch.randn(2, 23, 4, 8, generator=gen).bfloat16()
    assert torch.equal(ops.rotary(xb, position_ids, 500_000.0), plain_rotary(xb, position_ids, 500_000.0))


def test_nothing_large_is_saved_for_backward():
    """RMSNorm saves its input, weight and one fp32 per token; RoPE only the position ids (the plain forms save fp32
    copies of their inputs)."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    x = torch.randn(2, 16, 64).bfloat16().requires_grad_()
    w = torch.ones(64, requires_grad=True)
    q = torch.randn(2, 16, 4, 8).bfloat16().requires_grad_()
    position_ids = torch.arange(16).expand(2, -1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ops.rms_norm(x, w, 1e-5)
    assert saved == [((2, 16, 64), torch.bfloat16), ((64,), torch.float32), ((32,), torch.float32)]
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ops.rotary(q, position_ids, 10_000.0)
    assert saved == [((2, 16), torch.int64)]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_hf_rms_norms_tiled_with_the_same_values(family):
    """Hugging Face Llama / Qwen3 norms (Qwen3's q/k norms too) get the tiled forward: fp32 logits equal to the bit,
    gradients within fp32 summation order; installed once."""
    import copy

    import transformers

    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, attn_implementation="sdpa")
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **sizes))
    ref = copy.deepcopy(model)
    norms = 2 * 2 + 1 + (2 * 2 if family == "qwen3" else 0)  # two per layer, the final one, q/k norms per layer
    assert tile_hf_rms_norms(model) == norms and tile_hf_rms_norms(model) == 0
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(5))
    out, out_ref = model(ids, labels=ids), ref(ids, labels=ids)
    assert torch.equal(out.logits, out_ref.logits)
    out.loss.backward()
    out_ref.loss.backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6, msg=name)  # fp32: summation order only


def test_hf_rms_norm_keeps_its_own_forward_in_fp64():
    """fp64 (the tests' references) runs Hugging Face's own norm arithmetic: gradients equal to the bit."""
    import copy

    import transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa")).double()
    ref = copy.deepcopy(model)
    tile_hf_rms_norms(model)
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(6))
    model(ids, labels=ids).loss.backward()
    ref(ids, labels=ids).loss.backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, r.grad)


def _rms_norm_backward_out_of_place(grad_out, x, weight, rstd):
    """The backward's formula written plainly (every op allocating), one tile: what the in-place one must equal."""
    acc = rstd.dtype
    flat, dy = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, x.shape[-1]).to(acc)
    r = rstd[:, None]
    normed = flat.to(acc) * r
    grad_w = (dy * normed.to(x.dtype).to(acc)).sum(0)
    g = dy * weight.to(acc)
    grad_x = (r * (g - normed * (g * normed).mean(-1, keepdim=True))).to(x.dtype)
    return grad_x.view_as(x), grad_w.to(weight.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_backward_in_place_is_the_plain_formula_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 33, 64, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(64, generator=gen)).to(dtype)
    grad_out = torch.randn(2, 33, 64, generator=gen).to(dtype)
    _, rstd = ops.rms_norm_forward(x, w, 1e-5)
    x_before, grad_before = x.clone(), grad_out.clone()
    got = ops.rms_norm_backward(grad_out, x, w, rstd, input_grad=True, weight_grad=True)
    want = _rms_norm_backward_out_of_place(grad_out, x, w, rstd)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # the in-place ops touch only its own buffers
    assert torch.equal(x, x_before) and torch.equal(grad_out, grad_before)


def test_rms_norm_backward_holds_three_fp32_tile_buffers():
    """One tile of 512 tokens × 1024 (2 MiB in fp32): besides dx and the weight gradient, the backward holds at most
    three fp32 tile buffers at once (the normalised input, dy turned into dx, one temporary) and the bf16 rounding of
    the normalised input (half a buffer); the out-of-place form held five (10 MiB here against 7)."""
    from tests.live_bytes import LiveBytes

    x = torch.randn(512, 1024).bfloat16()
    w = torch.ones(1024)
    grad_out = torch.randn(512, 1024).bfloat16()
    _, rstd = ops.rms_norm_forward(x, w, 1e-5)
    with LiveBytes() as live:
        ops.rms_norm_backward(grad_out, x, w, rstd, input_grad=True, weight_grad=True)
    tile = 512 * 1024 * 4
    outputs = x.numel() * x.element_size() + 2 * 1024 * 4  # dx (bf16), the fp32 weight sum and its fp32 cast copy
    assert live.peak <= outputs + 3.5 * tile + 64 * 1024, live.report()


def _rotary_out_of_place(x, position_ids, theta, inverse=False):
    """RoPE written plainly (every op allocating), one tile: what the in-place loop must equal."""
    acc = torch.promote_types(x.dtype, torch.float32)
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=acc) / d))
    angles = position_ids.to(acc)[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]
    sin = -angles.sin() if inverse else angles.sin()
    x_c = x.to(acc)
    x1, x2 = x_c.chunk(2, dim=-1)
    return (x_c * angles.cos() + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inverse", [False, True])
def test_rotary_in_place_is_the_plain_formula_bit_for_bit(dtype, inverse):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 40, 3, 16, generator=gen).to(dtype)
    position_ids = torch.randint(0, 100_000, (2, 40), generator=gen)
    x_before = x.clone()
    got = ops.rotary_forward(x, position_ids, 500_000.0, inverse=inverse)
    assert torch.equal(got, _rotary_out_of_place(x, position_ids, 500_000.0, inverse))
    assert torch.equal(x, x_before)


def test_rotary_holds_two_fp32_tile_buffers():
    """One tile of 256 tokens × 8 heads × 128 (1 MiB in fp32): besides the output, the forward (and so the backward,
    the same function) holds two fp32 tile buffers at once, x and its rotate-half; the plain expression held four
    (4.75 MiB here against 2.9)."""
    from tests.live_bytes import LiveBytes

    x = torch.randn(1, 256, 8, 128).bfloat16()
    position_ids = torch.arange(256)[None]
    with LiveBytes() as live:
        ops.rotary_forward(x, position_ids, 500_000.0)
    tile = 256 * 8 * 128 * 4
    output = x.numel() * x.element_size()
    angles = 4 * 256 * 128 * 4  # (B, n, 1, D) fp32: the angles, their cos and sin (and the half-width angles)
    assert live.peak <= output + 2 * tile + angles, live.report()


def test_rms_norm_forward_holds_two_fp32_tile_buffers():
    """One tile of 512 tokens × 1024 (2 MiB in fp32): besides the output and rstd, the forward holds two fp32 tile
    buffers at once (x in fp32, normalised in place, and its square); the plain expression held three."""
    from tests.live_bytes import LiveBytes

    x = torch.randn(512, 1024).bfloat16()
    w = torch.ones(1024).bfloat16()
    with LiveBytes() as live:
        ops.rms_norm_forward(x, w, 1e-5)
    tile = 512 * 1024 * 4
    outputs = x.numel() * x.element_size() + 512 * 4  # the bf16 output, rstd
    assert live.peak <= outputs + 2 * tile + 64 * 1024, live.report()
