"""Gradient accumulation on a GPU: reduce-scattering every batch trains as reducing at a window's end, with the
states on the GPU and in host memory (marker gpu; run on the device)."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_fpdt import FPDTStrategy, TiledLoss
from tests.gpu.small_llama import LM, batches, parameters

pytestmark = pytest.mark.gpu

STEPS, ACCUMULATE = 3, 2


def _train(sync_every_batch, cpu_offload_params: bool) -> tuple[dict[str, torch.Tensor], bool]:
    module = LM()
    strategy = FPDTStrategy(cpu_offload_params=cpu_offload_params, sync_every_batch=sync_every_batch, chunks=2)
    trainer = L.Trainer(accelerator="cuda", devices=1, precision="bf16-mixed", max_steps=STEPS,
                        accumulate_grad_batches=ACCUMULATE, logger=False, strategy=strategy, callbacks=[TiledLoss()],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(batches(STEPS * ACCUMULATE), batch_size=None))
    return parameters(module), trainer.strategy.syncs_every_batch()


@pytest.mark.parametrize("cpu_offload_params", [False, True], ids=["states-on-gpu", "states-on-host"])
def test_reducing_every_batch_trains_as_reducing_at_the_window_end_on_cuda(cpu_offload_params):
    """3 AdamW steps of 2 batches each (lr 1e-3: a lost or doubled batch moves a parameter by up to 1e-3 a step):
    every batch reduce-scattered against the window's end only, no further apart than two runs of the latter (the
    GPU kernels may sum in another order from run to run), plus 1e-6; "auto" for a model this small keeps the
    unsharded gradients (they fit)."""
    synced, synced_on = _train(True, cpu_offload_params)
    at_end, at_end_on = _train(False, cpu_offload_params)
    again, auto_on = _train("auto", cpu_offload_params)
    assert synced_on and not at_end_on and not auto_on
    noise = max((at_end[n] - again[n]).abs().max().item() for n in at_end)
    gap = max((synced[n] - at_end[n]).abs().max().item() for n in at_end)
    assert gap <= 2 * noise + 1e-6, (gap, noise)
