"""One rank of a 2-process CPU training run in which a rank fails at step 1 (run by test_failures.py): rank 1 dies
(``die``), hangs outside any collective (``hang``) or freezes (``freeze``: SIGSTOP), or rank 0 dies (``die0``)."""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

import lightning as L
from torch.utils.data import DataLoader

from lightning_fpdt import FPDTStrategy
from tests.dist.training import LitLM, TokenDataset, trainer_kwargs


class FailingLM(LitLM):
    def __init__(self, mode: str) -> None:
        super().__init__("llama", seed=0, lr=0.1)
        self.mode = mode

    def training_step(self, batch, batch_idx):
        if self.global_step == 1 and self.global_rank == (0 if self.mode == "die0" else 1):
            if self.mode in ("die", "die0"):
                os._exit(3)
            if self.mode == "freeze":
                os.kill(os.getpid(), signal.SIGSTOP)  # the whole process stops, its heartbeat thread too
            time.sleep(600)  # hang outside any collective
        return super().training_step(batch, batch_idx)


def main(mode: str) -> None:
    # a frozen or vanished rank must be found by its heartbeat, well before the default collective timeout
    timeouts = dict(heartbeat_timeout=3.0) if mode in ("freeze", "die0") else dict(timeout=timedelta(seconds=15))
    strategy = FPDTStrategy(sequence_parallel_size=2, chunks=2, **timeouts)
    trainer = L.Trainer(strategy=strategy, devices=2, max_steps=5, **trainer_kwargs())
    trainer.fit(FailingLM(mode), DataLoader(TokenDataset(16, 16, seed=0), batch_size=2))


if __name__ == "__main__":
    main(sys.argv[1])
