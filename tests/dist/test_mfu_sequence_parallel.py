"""MFUMonitor under sequence parallelism: ranks sharing a sample count its tokens once (docs/design.md §6)."""

from __future__ import annotations

import lightning as L
from torch.utils.data import DataLoader

from lightning_fpdt import FPDTStrategy, MFUMonitor
from tests.dist.training import LitLM, TokenDataset, trainer_kwargs


def count_tokens(dp: int, sp: int) -> tuple[int, int]:
    monitor = MFUMonitor(peak_flops=1e12)
    trainer = L.Trainer(strategy=FPDTStrategy(sequence_parallel_size=sp, data_parallel_size=dp, chunks=1),
                        devices=dp * sp, max_steps=2, callbacks=[monitor], **trainer_kwargs())
    trainer.fit(LitLM("llama-mha", seed=0, lr=0.1), DataLoader(TokenDataset(8, 15, 0), batch_size=2))
    return monitor.last_step_tokens, len(monitor.step_records)


def test_tokens_counted_once_per_sequence_group(dist_pool):
    """2×2: a step processes batch 2 × 15 tokens × 2 data-parallel groups = 60 tokens, not ×4 ranks (nor padded 16)."""
    results = dist_pool(4).run(count_tokens, dp=2, sp=2)
    assert all(tokens == 2 * 15 * 2 and steps == 2 for tokens, steps in results)
