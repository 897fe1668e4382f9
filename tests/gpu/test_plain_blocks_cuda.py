"""Blocks left plain on a GPU: ``ActivationOffload(checkpoint_blocks=n)`` trains as checkpointing every block, with
the tiled MLP run whole in the plain blocks, and the optimizer steps with torch's fused kernel (marker gpu; run on the
device)."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_fpdt import ActivationOffload, FPDTStrategy, TiledLoss, TiledMLP
from tests.gpu.small_llama import LM, batches, parameters

pytestmark = pytest.mark.gpu

STEPS = 3


def _train(checkpoint_blocks) -> tuple[dict[str, torch.Tensor], int, list[object]]:
    module = LM()
    offload = ActivationOffload(checkpoint_blocks=checkpoint_blocks)
    trainer = L.Trainer(accelerator="cuda", devices=1, precision="bf16-mixed", max_steps=STEPS, logger=False,
                        strategy=FPDTStrategy(chunks=2), callbacks=[offload, TiledMLP(), TiledLoss()],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(batches(STEPS), batch_size=None))
    fused = [group.get("fused") for group in trainer.optimizers[0].param_groups]
    return parameters(module), offload._owner.checkpointed, fused


@pytest.mark.parametrize("checkpoint_blocks", [2, 0])
def test_plain_blocks_train_as_checkpointed_blocks_on_cuda(checkpoint_blocks):
    """3 AdamW steps (lr 1e-3: a lost or stale gradient moves a parameter by up to 1e-3 a step) with the last blocks
    plain against every block checkpointed: no further apart than two runs of the latter (the GPU kernels may sum in
    another order from run to run, and a recompute's bf16 rounding is that of its first forward) plus 1e-6; the
    first ``checkpoint_blocks`` of the 4 blocks checkpointed, the others not; AdamW fused."""
    reference, all_checkpointed, fused = _train("all")
    again, _, _ = _train("all")
    plain, checkpointed, _ = _train(checkpoint_blocks)
    assert all_checkpointed == 4 and checkpointed == checkpoint_blocks and fused == [True]
    noise = max((reference[n] - again[n]).abs().max().item() for n in reference)
    gap = max((plain[n] - reference[n]).abs().max().item() for n in reference)
    assert gap <= 2 * noise + 1e-6, (gap, noise)
