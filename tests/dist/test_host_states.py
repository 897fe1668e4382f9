"""Host-resident states (``cpu_offload_params``): the parameters stepping on the host during the backward, as FSDP2
hands over each gradient, train exactly as the step after the backward and as one process (docs/design.md §5)."""

from __future__ import annotations

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.callbacks import TiledLoss
from lightning_fpdt.integrations.head_loss import loss_head
from tests.dist.training import (FirstBatchGradients, LitLM, TokenDataset, full_state, reference_training,
                                 trainer_kwargs)

# against one process: as the parity tests (fp32, other summation orders, ~1e-6 after 3 steps); AdamW's update of
# order lr = 1e-2 moves a parameter by at most lr per step whatever the gradient's rounding, the same margin holds
TOL = dict(rtol=1e-4, atol=2e-5)


def train(kind: str, *, in_backward: bool, seq_len: int = 16, steps: int = 3, accumulate: int = 1,
          clip: float | None = None, sync_every_batch: bool | str = "auto", callbacks: tuple = (),
          tuning: str | None = None) -> tuple[LitLM, L.Trainer, TokenDataset]:
    dataset = TokenDataset(num_samples=2 * steps * accumulate, seq_len=seq_len, seed=7)
    strategy = FPDTStrategy(sequence_parallel_size=dist.get_world_size(), chunks=2, cpu_offload_params=True,
                            host_step_in_backward=in_backward, sync_every_batch=sync_every_batch)
    trainer = L.Trainer(strategy=strategy, devices=dist.get_world_size(), max_steps=steps, callbacks=[TiledLoss(), *callbacks],
                        accumulate_grad_batches=accumulate, gradient_clip_val=clip, **trainer_kwargs())
    module = LitLM(kind, seed=1234, lr=1e-2, optimizer="adamw", tuning=tuning)
    trainer.fit(module, DataLoader(dataset, batch_size=2, shuffle=False))
    return module, trainer, dataset


def compare_steps(kind: str, accumulate: int, sync_every_batch: bool | str = "auto",
                  tuning: str | None = None) -> None:
    watch = FirstBatchGradients()
    during, trainer, dataset = train(kind, in_backward=True, accumulate=accumulate, sync_every_batch=sync_every_batch,
                                     callbacks=(watch,), tuning=tuning)
    if accumulate > 1:  # a window's first batch left its gradients in host memory only where it reduce-scattered
        assert watch.seen == [sync_every_batch is True] * len(watch.seen) and watch.seen
    stepper = trainer.strategy._in_backward
    params = [p for group in stepper.optimizer.param_groups for p in group["params"] if p.requires_grad]
    assert stepper.stepped_in_backward == len(params)  # every trainable parameter stepped in the backward
    head = loss_head(during.model)
    assert isinstance(head, FSDPModule) and head.weight.device.type == "cpu"  # its own unit, states on the host
    after, trainer_after, _ = train(kind, in_backward=False, accumulate=accumulate, sync_every_batch=sync_every_batch,
                                    tuning=tuning)
    assert trainer_after.strategy._in_backward is None
    case = f"{kind} accumulate={accumulate} sync_every_batch={sync_every_batch} tuning={tuning}"
    # the same gradients (same reductions) and per-parameter updates of the same kernel: exactly equal
    torch.testing.assert_close(torch.tensor(during.losses), torch.tensor(after.losses), rtol=0, atol=0)
    state_during, state_after = full_state(during), full_state(after)
    for name, value in state_after.items():
        torch.testing.assert_close(state_during[name], value, rtol=0, atol=0, msg=lambda m: f"{case} {name}: {m}")
    ref_params, ref_losses = reference_training(kind, seed=1234, lr=1e-2, steps=3, accumulate=accumulate, dp=1,
                                                dataset=dataset, batch_size=2, optimizer="adamw", tuning=tuning)
    torch.testing.assert_close(torch.tensor(during.losses), torch.tensor(ref_losses[0]), **TOL)
    for name, ref in ref_params.items():
        torch.testing.assert_close(state_during["model." + name], ref, **TOL, msg=lambda m: f"{case} {name}: {m}")


def run_cases() -> None:
    compare_steps("llama", accumulate=1)
    compare_steps("hf", accumulate=2)  # micro-steps without a reduce-scatter step nothing


def frozen_parameters_stay_out() -> None:
    compare_steps("llama", accumulate=1, tuning="embeddings")
    compare_steps("hf", accumulate=1, tuning="lora-attention")


def synced_batches_add_on_the_host() -> None:
    compare_steps("hf", accumulate=2, sync_every_batch=True)


def clipping_steps_after_the_backward() -> None:
    _, trainer, _ = train("llama", in_backward=True, steps=1, clip=1.0)
    assert trainer.strategy._in_backward is None


def test_host_resident_states_step_during_the_backward(dist_pool):
    """1×2, reference and HF Llama with TiledLoss, AdamW: during the backward == after it == one process."""
    dist_pool(2).run(run_cases)


def test_host_resident_states_step_during_the_backward_with_frozen_parameters(dist_pool):
    """Frozen embeddings, LoRA adapters on the attention (the optimizer given every parameter): the trainable ones
    step on the host during the backward, == after it == one process."""
    dist_pool(2).run(frozen_parameters_stay_out)


def test_accumulation_synced_every_batch_steps_once_on_the_host(dist_pool):
    """With sync_every_batch=True a window's batches reduce-scatter into the gradients in host memory, which FSDP2 adds
    up there; only the last batch's backward steps the parameters, as they land: == after it == one process."""
    dist_pool(2).run(synced_batches_add_on_the_host)


def test_gradient_clipping_keeps_the_step_after_the_backward(dist_pool):
    dist_pool(2).run(clipping_steps_after_the_backward)
