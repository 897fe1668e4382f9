"""Host-resident states on a GPU: the parameters stepping during the backward read each gradient only once its copy
to host memory has landed (marker gpu; run on the device)."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_fpdt import FPDTStrategy, TiledLoss
from lightning_fpdt.models.llama import LlamaConfig, LlamaForCausalLM

pytestmark = pytest.mark.gpu

VOCAB, SEQ, STEPS, LR = 4096, 4096, 3, 1e-3


class LM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024,
                                                  num_layers=4, num_heads=8, num_kv_heads=4))

    def training_step(self, batch, batch_idx):
        return self.model(**batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


def _train(in_backward: bool) -> tuple[dict[str, torch.Tensor], int]:
    gen = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(0, VOCAB, (STEPS, SEQ), generator=gen)]
    module = LM()
    trainer = L.Trainer(accelerator="cuda", devices=1, precision="bf16-mixed", max_steps=STEPS, logger=False,
                        strategy=FPDTStrategy(cpu_offload_params=True, host_step_in_backward=in_backward, chunks=2),
                        callbacks=[TiledLoss()], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, DataLoader(data, batch_size=1, collate_fn=lambda b: {k: v[None] for k, v in b[0].items()}))
    stepper = trainer.strategy._in_backward
    params = {name: p.full_tensor().detach().float().cpu() for name, p in module.model.named_parameters()}
    return params, 0 if stepper is None else stepper.stepped_in_backward


def test_the_step_in_the_backward_equals_the_step_after_it_on_cuda():
    """3 AdamW steps (lr 1e-3: a stale or half-copied gradient moves a parameter by up to 1e-3 a step) stepped in
    the backward against after it: no further apart than two runs of the step after the backward are (the GPU
    kernels may sum in another order from run to run), plus 1e-6."""
    during, stepped = _train(True)
    after, _ = _train(False)
    again, _ = _train(False)
    assert stepped == len(during)
    noise = max((after[n] - again[n]).abs().max().item() for n in after)
    gap = max((during[n] - after[n]).abs().max().item() for n in after)
    assert gap <= 2 * noise + 1e-6, (gap, noise)
