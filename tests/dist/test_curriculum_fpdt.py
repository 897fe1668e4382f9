"""SequenceLengthCurriculum under Trainer(strategy="fpdt"): the strategy shards (and pads) the scheduled length."""

from __future__ import annotations

import lightning as L

import lightning_fpdt  # noqa: F401  (registers "fpdt")
from lightning_fpdt import FPDTStrategy
from lightning_fpdt.callbacks.curriculum import SequenceLengthCurriculum
from lightning_fpdt.data import RetrievalDataModule
from lightning_fpdt.models.module import LlamaLM
from tests.dist.training import trainer_kwargs


class Geometry(L.Callback):
    """Records, per micro-batch, the optimizer step, the strategy's (batch, seq_len, padded) and the local length."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, tuple[int, int, int], int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((trainer.global_step, trainer.strategy.last_batch_geometry, batch["input_ids"].shape[1]))


def fit_with_curriculum() -> list:
    geometry = Geometry()
    trainer = L.Trainer(strategy=FPDTStrategy(sequence_parallel_size=2, chunks=2), devices=2, max_steps=3,
                        callbacks=[SequenceLengthCurriculum({0: 30, 1: 50, 2: 64}), geometry],
                        limit_val_batches=0, **trainer_kwargs())
    module = LlamaLM("tiny", config_overrides={"vocab_size": 96, "num_layers": 1}, accuracy=True)
    trainer.fit(module, datamodule=RetrievalDataModule(seq_len=64, vocab_size=96, num_train=16, batch_size=2))
    return geometry.seen


def test_strategy_follows_the_curriculum(dist_pool):
    """Steps 0, 1, 2 are sharded at 30, 50, 64 tokens (padded to multiples of sp 2 × chunks 2: 32, 52, 64)."""
    for seen in dist_pool(2).run(fit_with_curriculum):
        assert seen == [(0, (2, 30, 32), 16), (1, (2, 50, 52), 26), (2, (2, 64, 64), 32)]
