"""The fused RMSNorm, RoPE, SwiGLU and loss tiles on a GPU against their eager forms, and training with them against
training without them (marker gpu; run on the device)."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_fpdt import ActivationOffload, FPDTStrategy, TiledLoss, TiledMLP
from lightning_fpdt.fused import ops
from tests.gpu.small_llama import LM, batches

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _run(fn, inputs, fused: bool, dtype: torch.dtype, seed: int = 0):
    """Outputs and input gradients of ``fn`` with the fused kernels on or off, on ``inputs`` cast to ``dtype``, for
    one output gradient drawn from ``seed``."""
    ops.FUSED_OPS.enabled = fused
    try:
        leaves = [x.detach().to(dtype).requires_grad_() if x.is_floating_point() else x for x in inputs]
        out = fn(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        grads = [torch.randn(o.shape, device="cuda", generator=gen).to(dtype) for o in outs]
        torch.autograd.backward(outs, grads)
        return [o.detach() for o in outs] + [x.grad for x in leaves if x.is_floating_point()]
    finally:
        ops.FUSED_OPS.enabled = "auto"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_ops_are_as_accurate_as_eager(dtype):
    """Each op, fused and eager, against the eager form in fp64 on the same inputs (16,384 tokens of the Llama-3-8B
    widths, fresh random values, positions past 100,000): every output and input gradient of the fused form is within
    twice the eager form's error (or 1e-6 where that is smaller). Not a bound on the difference between the two: at
    long positions an fp32 RoPE angle is uncertain by ``position × 2^-24`` (about 0.01 rad past 100,000 tokens), so
    two fp32 evaluations of the same formula differ by about that much; what must hold is that fusing loses no
    accuracy. bf16: both round to 2^-8 relative."""
    assert ops.FUSED_OPS.failed is None
    gen = torch.Generator(device="cuda").manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype).double()  # values exact in dtype

    tokens = 16384
    positions = torch.arange(tokens, device="cuda")[None] + 123_456
    cases = {
        "rms_norm": (lambda x, w: ops.rms_norm(x, w, 1e-5), (randn(1, tokens, 4096), randn(4096))),
        "rotary": (lambda q: ops.rotary(q, positions, 500000.0), (randn(1, tokens, 32, 128),)),
        "swiglu": (ops.swiglu, (randn(1, tokens, 14336), randn(1, tokens, 14336))),
    }
    for name, (fn, inputs) in cases.items():
        reference = _run(fn, inputs, False, torch.float64)
        fused, eager = _run(fn, inputs, True, dtype), _run(fn, inputs, False, dtype)
        assert ops.FUSED_OPS.failed is None, ops.FUSED_OPS.failed
        for i, (a, b, ref) in enumerate(zip(fused, eager, reference)):
            assert a.dtype == b.dtype == dtype and a.shape == b.shape == ref.shape
            assert _rel(a, ref) <= max(2 * _rel(b, ref), 1e-6), (name, i, _rel(a, ref), _rel(b, ref))


def test_fused_loss_tiles_are_as_accurate_as_eager():
    """The tiled loss with fused tiles and with in-place tiles against the fp64 loss (4,096 tokens, the Llama-3
    vocabulary and width, bf16 operands, fresh random values, a tenth of the targets ignored): the mean and both
    gradients of the fused form within twice the eager form's error (or 1e-6): both round the logits to bf16 as the
    matmul writes them, and fusing must lose nothing beyond that."""
    from lightning_fpdt.memory.tiled_loss import tiled_cross_entropy

    gen = torch.Generator(device="cuda").manual_seed(2)
    hidden = torch.randn(1, 4096, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(128256, 4096, device="cuda", generator=gen) / 64).to(torch.bfloat16)
    targets = torch.randint(0, 128256, (1, 4096), device="cuda", generator=gen)
    targets[torch.rand(targets.shape, device="cuda", generator=gen) < 0.1] = -100

    def run(fused: bool, dtype: torch.dtype):
        ops.FUSED_OPS.enabled = fused
        try:
            h, w = hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()
            mean, _ = tiled_cross_entropy(h, w, targets, num_tiles=4)
            mean.backward()
            return mean.detach().double(), h.grad.double(), w.grad.double()
        finally:
            ops.FUSED_OPS.enabled = "auto"

    reference = run(False, torch.float64)
    fused, eager = run(True, torch.bfloat16), run(False, torch.bfloat16)
    assert ops.FUSED_OPS.failed is None, ops.FUSED_OPS.failed
    for i, (a, b, ref) in enumerate(zip(fused, eager, reference)):
        assert _rel(a, ref) <= max(2 * _rel(b, ref), 1e-6), (i, _rel(a, ref), _rel(b, ref))


class _Record(L.Callback):
    """The loss of every step, and every parameter's gradient before the first optimizer step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.first_grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if not self.first_grads:
            self.first_grads = {name: p.grad.full_tensor().float().cpu()
                                for name, p in pl_module.model.named_parameters() if p.grad is not None}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def _train(fused: bool, steps: int) -> _Record:
    record = _Record()
    trainer = L.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        strategy=FPDTStrategy(fused_ops=fused, heartbeat_timeout=None),
                        callbacks=[ActivationOffload(), TiledMLP(), TiledLoss(), record])
    trainer.fit(LM(), DataLoader(batches(steps), batch_size=None))
    return record


def test_training_with_fused_ops_matches_eager():
    """A small reference Llama in bf16-mixed with every memory callback, with the fused kernels and without: every
    parameter's gradient at the first step within 2% (relative norm) of the eager one (bf16 operands round at 2^-8
    relative, about 0.4%, and the two forms round at different places through 4 layers; a wrong norm, RoPE or SwiGLU
    gradient is off by its own size), and the losses of 20 AdamW steps within 1% of each other."""
    fused, eager = _train(True, 20), _train(False, 20)
    assert fused.first_grads.keys() == eager.first_grads.keys() and len(eager.first_grads) == 39
    for name, grad in eager.first_grads.items():
        assert _rel(fused.first_grads[name], grad) < 2e-2, name
    for step, (a, b) in enumerate(zip(fused.losses, eager.losses)):
        assert abs(a - b) < 1e-2 * abs(b), (step, a, b)
