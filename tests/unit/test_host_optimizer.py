"""The optimizer step on host-resident states: fused where torch's kernel gives the same update, on the rank's cores,
during the backward where nothing needs all gradients first."""

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Callback, LightningModule

from lightning_fpdt.strategy.host_optimizer import (
    InBackwardStep,
    fuse_host_optimizers,
    fuse_optimizers,
    host_step,
    host_threads,
    in_backward_refusal,
)


def _params(seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((37, 11), (5,), (3, 4, 6))]


def test_fused_adamw_on_the_host_matches_the_per_tensor_loop():
    """Three steps of the fused AdamW equal the per-tensor loop's on fresh random gradients (fp32: a few ulps)."""
    fused, loop = _params(0), _params(0)
    options = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    fused_optimizer = torch.optim.AdamW(fused, **options)
    loop_optimizer = torch.optim.AdamW(loop, foreach=False, **options)
    assert fuse_host_optimizers([fused_optimizer]) == []
    assert fused_optimizer.param_groups[0]["fused"] is True
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        for a, b in zip(fused, loop):
            grad = torch.randn(a.shape, generator=generator)
            a.grad, b.grad = grad.clone(), grad.clone()
        fused_optimizer.step()
        loop_optimizer.step()
    for a, b in zip(fused, loop):
        # values of order 1 after updates of order lr: the kernels differ only in the order of fp32 operations
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_optimizers_torch_cannot_fuse_or_the_user_configured_are_left_as_they_were():
    """SGD, and an AdamW whose user chose foreach, keep their step; each is named for the warning."""
    sgd = torch.optim.SGD(_params(0), lr=0.1)
    chosen = torch.optim.AdamW(_params(1), foreach=False)
    left = fuse_host_optimizers([sgd, chosen])
    assert len(left) == 2 and left[0].startswith("SGD") and "foreach=False" in left[1]
    assert chosen.param_groups[0]["fused"] is None


def test_only_groups_whose_parameters_all_live_on_the_device_are_fused():
    """Fusing for the GPU leaves a group with parameters elsewhere (here in host memory) as the user made it."""
    on_host = torch.optim.AdamW(_params(2))
    left = fuse_optimizers([on_host], "cuda")
    assert on_host.param_groups[0]["fused"] is None and "not all floating point on cuda" in left[0]
    assert fuse_optimizers([on_host], "cpu") == [] and on_host.param_groups[0]["fused"] is True


def test_host_step_runs_the_closure_with_the_threads_it_had_and_the_step_with_the_hosts():
    """The closure (forward and backward) sees the process's thread count, the step's arithmetic ``threads``."""
    before = torch.get_num_threads()
    seen = {}

    def closure():
        seen["closure"] = torch.get_num_threads()
        return 1.5

    def step(c):
        loss = c()
        seen["step"] = torch.get_num_threads()
        return loss

    threads = before + 1
    assert host_step(step, closure, threads) == 1.5
    assert seen == {"closure": before, "step": threads}
    assert torch.get_num_threads() == before
    assert host_threads(1) >= 1 and host_threads(10**6) == 1


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    return model(torch.randn(64, 16, generator=generator)).square().mean()


@pytest.mark.parametrize("make", [
    lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True),
    lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
])
def test_the_step_in_the_backward_is_the_step_after_it(make):
    """Each parameter stepped alone on the worker as autograd hands over its gradient, over 3 steps on fresh random
    inputs, gives the same parameters as one step after the backward: exactly, as the update of a parameter reads
    only its own gradient and state and the same kernel runs."""
    model, reference = _model(0), _model(0)
    optimizer, reference_optimizer = make(model.parameters()), make(reference.parameters())
    stepper = InBackwardStep(optimizer, threads=2)
    order: list[str] = []
    optimizer.register_step_post_hook(lambda *_: order.append("optimizer.step"))
    try:
        for step in range(3):
            optimizer.zero_grad()
            assert stepper.run(lambda: _loss(model, step).backward() or 1.5, threads=2) == 1.5
            assert stepper.stepped_in_backward == 4  # two weights, two biases
            reference_optimizer.zero_grad()
            _loss(reference, step).backward()
            reference_optimizer.step()
            for a, b in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
                torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)  # the gradients are left as they were
    finally:
        stepper.close()
    assert order == ["optimizer.step"] * 3  # the optimizer's own step (and its hooks) runs once per step


def test_outside_a_step_the_hooks_do_nothing_and_a_failed_backward_is_reported():
    model = _model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    stepper = InBackwardStep(optimizer, threads=1)
    try:
        _loss(model, 0).backward()  # e.g. a gradient-accumulation micro-step: nothing steps
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))

        def failing() -> None:
            raise RuntimeError("out of memory in the backward")

        with pytest.raises(RuntimeError, match="out of memory"):
            stepper.run(failing, threads=1)
    finally:
        stepper.close()


def test_what_keeps_the_step_after_the_backward_is_named():
    class Module(LightningModule):
        pass

    class Clipping(Module):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            pass

    class Reader(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            pass

    def trainer(module=None, clip=None, callbacks=()):
        module = module or Module()
        return SimpleNamespace(lightning_module=module, gradient_clip_val=clip, callbacks=list(callbacks))

    adamw = torch.optim.AdamW(_params(0))
    assert in_backward_refusal([adamw], trainer()) is None
    assert "2 optimizers" in in_backward_refusal([adamw, adamw], trainer())
    assert "Adagrad" in in_backward_refusal([torch.optim.Adagrad(_params(0))], trainer())
    assert "clipping" in in_backward_refusal([adamw], trainer(clip=1.0))
    assert "clipping" in in_backward_refusal([adamw], trainer(Clipping()))
    assert "Reader" in in_backward_refusal([adamw], trainer(callbacks=[Reader()]))
    manual = Module()
    manual.automatic_optimization = False
    assert "manual" in in_backward_refusal([adamw], trainer(manual))
