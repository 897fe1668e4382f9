"""StepProgress under Trainer(strategy="fpdt"): the hooks on the FSDP2-wrapped blocks follow the step on rank 0,
the tokens count the group's whole sequences, and no rank waits on another for it."""

from __future__ import annotations

import time

import lightning as L
import torch

import lightning_fpdt  # noqa: F401  (registers "fpdt")
from lightning_fpdt import FPDTStrategy, StepProgress
from lightning_fpdt.data import RetrievalDataModule
from lightning_fpdt.models.module import LlamaLM
from tests.dist.training import trainer_kwargs


class SlowLM(LlamaLM):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        time.sleep(0.3)  # a long step, seen by the display thread after the last block's forward
        return loss


class Recorded(StepProgress):
    """What would be shown, kept."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.shown: list[str] = []

    def _show(self, text: str) -> None:
        self.shown.append(text)


def progress_under_fpdt() -> list[str]:
    progress = Recorded(after_seconds=0.1, refresh_seconds=0.02)
    trainer = L.Trainer(strategy=FPDTStrategy(sequence_parallel_size=2, chunks=2), devices=2, max_steps=2,
                        callbacks=[progress], limit_val_batches=0, **trainer_kwargs())
    trainer.fit(SlowLM("tiny", config_overrides={"vocab_size": 96}),
                datamodule=RetrievalDataModule(seq_len=45, vocab_size=96, batch_size=2))
    assert not progress._handles
    return progress.shown


def test_progress_under_fpdt(dist_pool):
    """Rank 0 shows the forward at block 2 of 2 with the group's 2 x 48 padded tokens, then the second step with the
    previous step's time; the other rank shows nothing."""
    shown, other = dist_pool(2).run(progress_under_fpdt)
    assert any(text.startswith("step 0: forward, block 2 of 2, 96 tokens") for text in shown)
    assert any(text.startswith("step 1: ") and "(previous step" in text for text in shown)
    assert other == []
