"""A small reference Llama as a LightningModule, and its data, for the GPU training tests."""

import lightning as L
import torch

from lightning_fpdt.models.llama import LlamaConfig, LlamaForCausalLM

VOCAB, SEQ, LR = 4096, 4096, 1e-3


class LM(L.LightningModule):
    """4 layers, hidden 512, 8 heads (4 kv heads), AdamW at lr 1e-3: a lost, doubled or stale gradient moves a
    parameter by up to 1e-3 a step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024,
                                                  num_layers=4, num_heads=8, num_kv_heads=4))

    def training_step(self, batch, batch_idx):
        return self.model(**batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


def batches(count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` sequences of random tokens (a fixed seed), each its own batch of one."""
    gen = torch.Generator().manual_seed(1)
    return [{"input_ids": ids[None], "labels": ids[None].clone()}
            for ids in torch.randint(0, VOCAB, (count, SEQ), generator=gen)]


def parameters(module: LM) -> dict[str, torch.Tensor]:
    """Every parameter gathered, in fp32 on the host."""
    return {name: p.full_tensor().detach().float().cpu() for name, p in module.model.named_parameters()}
