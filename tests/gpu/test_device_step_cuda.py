"""States on the GPU: the parameters stepping in FSDP2's gradient hooks, on the reduce-scatter's stream during the
backward, read each gradient only once it is made and train as the step after the backward (marker gpu; run on the
device)."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_fpdt import FPDTStrategy, TiledLoss
from tests.gpu.small_llama import LM, batches, parameters

pytestmark = pytest.mark.gpu

STEPS = 4


def _train(in_backward: bool) -> tuple[dict[str, torch.Tensor], int]:
    module = LM()
    trainer = L.Trainer(accelerator="cuda", devices=1, precision="bf16-mixed", max_steps=STEPS, logger=False,
                        strategy=FPDTStrategy(device_step_in_backward=in_backward, chunks=2),
                        callbacks=[TiledLoss()], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, DataLoader(batches(STEPS), batch_size=None))
    stepper = trainer.strategy._in_backward
    return parameters(module), 0 if stepper is None else stepper.stepped_in_backward


def test_the_device_step_in_the_backward_equals_the_step_after_it():
    """4 AdamW steps (lr 1e-3: a gradient read before its reduce-scatter landed moves a parameter by up to 1e-3 a
    step), the last three stepped in the backward, against after it: no further apart than two runs of the step
    after the backward are (the GPU kernels may sum in another order from run to run), plus 1e-6."""
    during, stepped = _train(True)
    after, _ = _train(False)
    again, _ = _train(False)
    assert stepped == len(during)
    noise = max((after[n] - again[n]).abs().max().item() for n in after)
    gap = max((during[n] - after[n]).abs().max().item() for n in after)
    assert gap <= 2 * noise + 1e-6, (gap, noise)
