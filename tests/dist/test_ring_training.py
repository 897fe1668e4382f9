"""Whole-training parity with more sequence-parallel ranks than query heads: Trainer(strategy="fpdt") picks the
Ulysses × ring hybrid (docs/ring.md) and trains like one process."""

from __future__ import annotations

from lightning_fpdt.callbacks.activation_offload import ActivationOffload
from tests.dist import test_strategy_parity as parity


def run_ring_training(cases: list[dict]) -> None:
    for case in cases:
        expected_ring = case.pop("expected_ring")
        offload_blocks = case.pop("activation_offload", False)
        trainer = parity.train_and_compare(**case, callbacks=[ActivationOffload()] if offload_blocks else None)
        strategy = trainer.strategy
        assert strategy.ring_size == expected_ring, f"{case}: ring_size {strategy.ring_size} != {expected_ring}"
        assert strategy.sequence_parallel_size == case["sp"]
        if expected_ring > 1:  # the attention got the (ulysses_group, ring_group) pair
            assert isinstance(strategy._context.attention.group, tuple)


def test_ring_training_parity_four_processes(dist_pool):
    """P = 4 > 2 query heads: ring_size "auto" = 2 (U = 2, kv head replicated); reference Llama (with gradient
    accumulation and a padded length; under ActivationOffload with the shares offloaded), HF Llama through the
    attention interface, and an explicit ring_size=4 (U = 1)."""
    dist_pool(4).run(run_ring_training, cases=[
        dict(kind="llama-2heads", dp=1, sp=4, chunks=1, accumulate=2, seq_len=21, expected_ring=2),
        dict(kind="hf-2heads", dp=1, sp=4, chunks="auto", accumulate=1, seq_len=16, expected_ring=2),
        dict(kind="llama-2heads", dp=1, sp=4, chunks=1, accumulate=1, seq_len=16, expected_ring=2,
             activation_offload=True, offload=True),
        dict(kind="llama", dp=1, sp=4, chunks=1, accumulate=1, seq_len=16, ring_size=4, expected_ring=4),
    ])


def test_ring_training_parity_data_parallel(dist_pool):
    """dp = 2 x sp = 2 with ring_size=2 (U = 1): each data-parallel group is its own ring."""
    dist_pool(4).run(run_ring_training, cases=[
        dict(kind="llama-2heads", dp=2, sp=2, chunks=1, accumulate=1, seq_len=13, ring_size=2, expected_ring=2),
    ])
