"""The optimizer step on host-resident states: fused where torch's kernel gives the same update, on the rank's cores."""

import torch

from lightning_fpdt.strategy.host_optimizer import fuse_host_optimizers, host_step, host_threads


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
