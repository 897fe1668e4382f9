"""A LightningModule around the reference Llama, for the demo, the examples and the benchmarks."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from lightning_fpdt.models.llama import LlamaConfig, LlamaForCausalLM


class LlamaLM(L.LightningModule):
    """Causal-LM training of the reference Llama with AdamW; logs ``loss`` to the progress bar.

    Args:
        name: a named size of :class:`LlamaConfig` (``"tiny"``, ``"llama3-1b"``, ``"llama3-8b"``).
        lr: AdamW learning rate.
        seed: seed of the weight initialisation (the same on every rank).
        overrides: config fields to change, e.g. ``num_layers=2``.
    """

    def __init__(self, name: str = "tiny", *, lr: float = 3e-4, seed: int = 0, **overrides: Any) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = LlamaForCausalLM(LlamaConfig.from_name(name, **overrides))
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch)
        self.losses.append(loss.item())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)
