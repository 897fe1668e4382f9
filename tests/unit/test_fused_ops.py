"""The fused forms of RMSNorm, RoPE and SwiGLU (lightning_fpdt.fused.ops) compute what the eager forms compute; a
compiler failure falls back to the eager forms with one warning. (On the CPU they compile without code generation:
the formulas and the autograd wiring are tested here, the kernels on a GPU in tests/gpu/test_fused_ops_cuda.py.)"""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_fpdt.fused import ops


@pytest.fixture
def fused():
    ops.FUSED_OPS.enabled = True
    yield
    ops.FUSED_OPS.enabled, ops.FUSED_OPS.failed = "auto", None


def _grads(fn, inputs, seed=3):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype))
    return [out.detach()] + [x.grad for x in leaves]


def _cases():
    gen = torch.Generator().manual_seed(0)
    positions = torch.arange(40)[None].expand(2, -1) + 1000
    return {
        "rms_norm": (lambda x, w: ops.rms_norm(x, w, 1e-6),
                     (torch.randn(2, 40, 64, generator=gen), torch.randn(64, generator=gen))),
        "rotary": (lambda q: ops.rotary(q, positions, 10000.0), (torch.randn(2, 40, 4, 16, generator=gen),)),
        "swiglu": (ops.swiglu, (torch.randn(2, 40, 96, generator=gen), torch.randn(2, 40, 96, generator=gen))),
    }


def test_fused_forms_equal_the_eager_forms(fused):
    """fp32, fresh random inputs: every output and input gradient within 1e-6 of the eager form's (the same fp32
    formulas; SwiGLU's backward is written out by hand)."""
    for name, (fn, inputs) in _cases().items():
        ops.FUSED_OPS.enabled = True
        got = _grads(fn, inputs)
        ops.FUSED_OPS.enabled = False
        want = _grads(fn, inputs)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
    assert ops.FUSED_OPS.failed is None


def test_fp64_is_never_fused(fused):
    """fp64 tensors (the tests' references) always take the eager forms."""
    assert not ops.FUSED_OPS.applies(torch.zeros(2, dtype=torch.float64))
    assert ops.FUSED_OPS.applies(torch.zeros(2))
    ops.FUSED_OPS.enabled = "auto"
    assert not ops.FUSED_OPS.applies(torch.zeros(2))  # "auto": CUDA devices only


def test_a_compiler_failure_falls_back_with_one_warning(fused, monkeypatch):
    """Where compiling fails the ops compute eagerly, the same values, with one warning naming the error."""
    def broken(fn):
        def call(*args):
            raise RuntimeError("no compiler here")
        return call

    monkeypatch.setattr(ops, "_compiled", broken)
    fn, inputs = _cases()["rms_norm"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _grads(fn, inputs)
        again = _grads(fn, inputs)
    assert [str(w.message) for w in caught if "could not be compiled" in str(w.message)] == [
        "lightning_fpdt: the fused RMSNorm/RoPE/SwiGLU/loss kernels could not be compiled (RuntimeError: no compiler "
        "here); these ops run eager from now on"]
    ops.FUSED_OPS.enabled, ops.FUSED_OPS.failed = False, None
    for a, b, c in zip(got, again, _grads(fn, inputs)):
        torch.testing.assert_close(a, c, rtol=0, atol=0)
        torch.testing.assert_close(b, c, rtol=0, atol=0)


def test_out_of_memory_is_not_a_compiler_failure(fused, monkeypatch):
    """A fused kernel that runs out of device memory raises as it would eager: no fallback, no warning."""
    def no_memory(fn):
        def call(*args):
            raise torch.OutOfMemoryError("out of memory")
        return call

    monkeypatch.setattr(ops, "_compiled", no_memory)
    fn, inputs = _cases()["swiglu"]
    with pytest.raises(torch.OutOfMemoryError):
        _grads(fn, inputs)
    assert ops.FUSED_OPS.failed is None


def test_hugging_face_gated_mlps_compute_the_same_product():
    """A Hugging Face Llama's SiLU-gated MLPs get the fused product's forward: the same outputs and gradients."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_fpdt.integrations.huggingface import fuse_hf_gated_mlps

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 12))
    want = _loss_and_grads(model, ids)
    assert fuse_hf_gated_mlps(model) == 2 and fuse_hf_gated_mlps(model) == 0  # idempotent
    got = _loss_and_grads(model, ids)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


def _tiled_loss_and_grads(hidden, weight, targets, weight_trains=True):
    from lightning_fpdt.memory.tiled_loss import tiled_cross_entropy

    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_(weight_trains)
    mean, num_valid = tiled_cross_entropy(h, w, targets, num_tiles=3)
    mean.backward()
    return mean.detach(), num_valid, h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_loss_tiles_equal_the_in_place_tiles(fused, dtype):
    """The tiled loss's fused tile (softmax and its gradient as plain expressions, compiled) gives the loss and both
    gradients of the in-place tile, with ignored targets among the tokens; fp32: the same formulas in another order
    (1e-6), bf16: the gradients rounded to bf16 at the same point in both (one bf16 ulp, 1e-2)."""
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 37, 24, generator=gen).to(dtype)
    weight = (torch.randn(101, 24, generator=gen) / 5).to(dtype)
    targets = torch.randint(0, 101, (2, 37), generator=gen)
    targets[0, :6] = -100
    targets[1, 30:] = -100
    got = _tiled_loss_and_grads(hidden, weight, targets)
    assert ops.FUSED_OPS.failed is None
    ops.FUSED_OPS.enabled = False
    want = _tiled_loss_and_grads(hidden, weight, targets)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    assert got[1] == want[1] == int((targets != -100).sum())
    for a, b in zip(got[:1] + got[2:], want[:1] + want[2:]):  # the mean, the hidden and the weight gradients
        torch.testing.assert_close(a, b, **tol)
    reference = torch.nn.functional.cross_entropy((hidden.float() @ weight.float().T).flatten(0, 1),
                                                  targets.flatten(), ignore_index=-100)
    torch.testing.assert_close(got[0], reference, **tol)


def test_a_loss_tile_that_cannot_compile_runs_in_place(fused, monkeypatch):
    """A compiler failure in the loss's fused tile falls back to the in-place tile: the same loss and gradients."""
    def broken(fn):
        def call(*args):
            raise RuntimeError("no compiler here")
        return call

    gen = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(1, 20, 16, generator=gen), torch.randn(50, 16, generator=gen)
    targets = torch.randint(0, 50, (1, 20), generator=gen)
    monkeypatch.setattr(ops, "_compiled", broken)
    with pytest.warns(UserWarning, match="could not be compiled"):
        got = _tiled_loss_and_grads(hidden, weight, targets)
    ops.FUSED_OPS.enabled, ops.FUSED_OPS.failed = False, None
    for a, b in zip(got, _tiled_loss_and_grads(hidden, weight, targets)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fused_loss_tiles_with_a_frozen_head(fused):
    """A frozen output head (adapters, a frozen lm_head): the fused tile gives the hidden gradient of the in-place
    tile and leaves the head without a gradient."""
    gen = torch.Generator().manual_seed(7)
    hidden, weight = torch.randn(1, 29, 16, generator=gen), torch.randn(60, 16, generator=gen) / 4
    targets = torch.randint(0, 60, (1, 29), generator=gen)
    targets[0, :4] = -100
    got = _tiled_loss_and_grads(hidden, weight, targets, weight_trains=False)
    ops.FUSED_OPS.enabled = False
    want = _tiled_loss_and_grads(hidden, weight, targets, weight_trains=False)
    assert got[3] is None and want[3] is None
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)  # fp32, the same formulas in another order
    torch.testing.assert_close(got[2], want[2], rtol=1e-6, atol=1e-6)
