"""The parameters stepping during the backward on a GPU (marker gpu; run on the device): with host-resident states
each reads its gradient only once the copy to host memory has landed; with the states on the GPU, in FSDP2's hook on
the reduce-scatter's stream, only once the reduce-scatter has made it. Either trains as the step after the backward."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_fpdt import FPDTStrategy, TiledLoss
from tests.gpu.small_llama import LM, batches, parameters

pytestmark = pytest.mark.gpu


def _train(steps: int, **options) -> tuple[dict[str, torch.Tensor], int]:
    module = LM()
    trainer = L.Trainer(accelerator="cuda", devices=1, precision="bf16-mixed", max_steps=steps, logger=False,
                        strategy=FPDTStrategy(chunks=2, **options), callbacks=[TiledLoss()],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(batches(steps), batch_size=None))
    stepper = trainer.strategy._in_backward
    return parameters(module), 0 if stepper is None else stepper.stepped_in_backward


def _during_equals_after(steps: int, option: str, **options) -> None:
    """``steps`` AdamW steps (lr 1e-3: a stale or half-made gradient moves a parameter by up to 1e-3 a step) stepped
    in the backward against after it: no further apart than two runs of the step after the backward are (the GPU
    kernels may sum in another order from run to run), plus 1e-6."""
    during, stepped = _train(steps, **{option: True}, **options)
    after, _ = _train(steps, **{option: False}, **options)
    again, _ = _train(steps, **{option: False}, **options)
    assert stepped == len(during)
    noise = max((after[n] - again[n]).abs().max().item() for n in after)
    gap = max((during[n] - after[n]).abs().max().item() for n in after)
    assert gap <= 2 * noise + 1e-6, (gap, noise)


def test_the_step_in_the_backward_equals_the_step_after_it_on_cuda():
    """Host-resident states, 3 steps, every one stepped in the backward."""
    _during_equals_after(3, "host_step_in_backward", cpu_offload_params=True)


def test_the_device_step_in_the_backward_equals_the_step_after_it():
    """States on the GPU, 4 steps, the last three stepped in the backward (the first allocates the states)."""
    _during_equals_after(4, "device_step_in_backward")
