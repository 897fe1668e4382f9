"""One rank of a 2-process CPU training run whose host runs short for rank 1's checkpointed block inputs at the first
step (run by test_host_memory.py): rank 1's guard reads an almost full host."""

from __future__ import annotations

import sys
from datetime import timedelta

import lightning as L
from torch.utils.data import DataLoader

from lightning_fpdt import ActivationOffload, FPDTStrategy
from tests.dist.training import LitLM, TokenDataset, trainer_kwargs


class ShortHost(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 1:
            trainer.strategy.memory.guard.available = lambda: 2**30  # 1 GiB left, under the reserve


def main() -> None:
    strategy = FPDTStrategy(sequence_parallel_size=2, chunks=2, timeout=timedelta(seconds=120))
    trainer = L.Trainer(strategy=strategy, devices=2, max_steps=3, callbacks=[ActivationOffload(), ShortHost()],
                        **trainer_kwargs())
    trainer.fit(LitLM("llama", seed=0, lr=0.1), DataLoader(TokenDataset(16, 16, seed=0), batch_size=2))


if __name__ == "__main__":
    main()
