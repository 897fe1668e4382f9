"""States on the training device: the parameters stepping inside FSDP2's gradient hook, during the backward, train
exactly as the step after the backward and as one process, with every parameter trainable and with some frozen
(docs/design.md §5)."""

from __future__ import annotations

from typing import Optional

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.callbacks import TiledLoss
from tests.dist.training import LitLM, TokenDataset, full_state, reference_training, trainer_kwargs

# against one process: as the parity tests (fp32, other summation orders, ~1e-6 after 3 steps); AdamW's update of
# order lr = 1e-2 moves a parameter by at most lr per step whatever the gradient's rounding, the same margin holds
TOL = dict(rtol=1e-4, atol=2e-5)
STEPS = 3


class LandedEachStep(L.Callback):
    """How many parameters each optimizer step updated during its backward (-1: none can)."""

    def __init__(self, accumulate: int) -> None:
        self.accumulate, self.batches = accumulate, 0
        self.landed: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        self.batches += 1
        if self.batches % self.accumulate == 0:  # a window's last batch: the optimizer stepped
            stepper = trainer.strategy._in_backward
            self.landed.append(-1 if stepper is None else stepper.stepped_in_backward)


def train(kind: str, *, in_backward: bool, accumulate: int = 1, tuning: Optional[str] = None, clip: float | None = None,
          steps: int = STEPS) -> tuple[LitLM, L.Trainer, TokenDataset, LandedEachStep]:
    dataset = TokenDataset(num_samples=2 * steps * accumulate, seq_len=16, seed=7)
    strategy = FPDTStrategy(sequence_parallel_size=dist.get_world_size(), chunks=2,
                            device_step_in_backward=in_backward)
    landed = LandedEachStep(accumulate)
    trainer = L.Trainer(strategy=strategy, devices=dist.get_world_size(), max_steps=steps,
                        callbacks=[TiledLoss(), landed], accumulate_grad_batches=accumulate, gradient_clip_val=clip,
                        **trainer_kwargs())
    module = LitLM(kind, seed=1234, lr=1e-2, optimizer="adamw", tuning=tuning)
    trainer.fit(module, DataLoader(dataset, batch_size=2, shuffle=False))
    return module, trainer, dataset, landed


def compare_steps(kind: str, *, accumulate: int = 1, tuning: Optional[str] = None) -> None:
    case = f"{kind} accumulate={accumulate} tuning={tuning}"
    during, trainer, dataset, landed = train(kind, in_backward=True, accumulate=accumulate, tuning=tuning)
    stepper = trainer.strategy._in_backward
    trainable = [p for group in stepper.optimizer.param_groups for p in group["params"] if p.requires_grad]
    # the first step allocates the states after the backward; from the second on every trainable parameter's
    # gradient lands in FSDP2's hook and steps there
    assert landed.landed == [0] + [len(trainable)] * (STEPS - 1), (case, landed.landed, len(trainable))
    after, trainer_after, _, _ = train(kind, in_backward=False, accumulate=accumulate, tuning=tuning)
    assert trainer_after.strategy._in_backward is None
    # the same gradients (same reductions) and per-parameter updates of the same kernel: exactly equal
    torch.testing.assert_close(torch.tensor(during.losses), torch.tensor(after.losses), rtol=0, atol=0)
    state_during, state_after = full_state(during), full_state(after)
    for name, value in state_after.items():
        torch.testing.assert_close(state_during[name], value, rtol=0, atol=0, msg=lambda m: f"{case} {name}: {m}")
    ref_params, ref_losses = reference_training(kind, seed=1234, lr=1e-2, steps=STEPS, accumulate=accumulate, dp=1,
                                                dataset=dataset, batch_size=2, optimizer="adamw", tuning=tuning)
    torch.testing.assert_close(torch.tensor(during.losses), torch.tensor(ref_losses[0]), **TOL)
    for name, ref in ref_params.items():
        torch.testing.assert_close(state_during["model." + name], ref, **TOL, msg=lambda m: f"{case} {name}: {m}")


def all_trainable() -> None:
    compare_steps("llama")
    compare_steps("hf", accumulate=2)  # the window's first backward steps nothing


def some_frozen() -> None:
    compare_steps("llama", tuning="embeddings")
    compare_steps("hf", tuning="lora-attention")


def clipping_steps_after_the_backward() -> None:
    _, trainer, _, landed = train("llama", in_backward=True, steps=2, clip=1.0)
    assert trainer.strategy._in_backward is None and landed.landed == [-1, -1]


def test_device_states_step_during_the_backward(dist_pool):
    """1×2, reference and HF Llama with TiledLoss, AdamW: during the backward == after it == one process."""
    dist_pool(2).run(all_trainable)


def test_device_states_step_during_the_backward_with_frozen_parameters(dist_pool):
    """Frozen embeddings, LoRA adapters on the attention: only the trainable parameters step, during the backward, ==
    after it == one process."""
    dist_pool(2).run(some_frozen)


def test_gradient_clipping_keeps_the_device_step_after_the_backward(dist_pool):
    dist_pool(2).run(clipping_steps_after_the_backward)
