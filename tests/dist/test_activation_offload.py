"""ActivationOffload under Trainer(strategy="fpdt") on gloo processes: training parity with one process."""

from __future__ import annotations

from lightning_fpdt.callbacks.activation_offload import ActivationOffload
from lightning_fpdt.callbacks.tiled_loss import TiledLoss
from lightning_fpdt.callbacks.tiled_mlp import TiledMLP
from tests.dist import test_strategy_parity as parity


def run_with_offload(cases: list[dict]) -> None:
    for case in cases:
        parity.train_and_compare(**case, callbacks=[ActivationOffload()])


def test_activation_offload_parity_two_processes(dist_pool):
    """1×2 with chunks 2: reference Llama (gradient accumulation 2), HF Llama and a plain SDPA module."""
    dist_pool(2).run(run_with_offload, cases=[
        dict(kind="llama", dp=1, sp=2, chunks=2, accumulate=2, seq_len=15),
        dict(kind="hf", dp=1, sp=2, chunks=2, accumulate=1, seq_len=16),
        dict(kind="plain", dp=1, sp=2, chunks=2, accumulate=1, seq_len=16),
    ])


def test_activation_offload_parity_four_processes(dist_pool):
    """1×4 and 2×2 with chunks 2."""
    dist_pool(4).run(run_with_offload, cases=[
        dict(kind="llama", dp=1, sp=4, chunks=2, accumulate=1, seq_len=24),
        dict(kind="hf", dp=2, sp=2, chunks=2, accumulate=1, seq_len=16),
    ])


def run_with_all_three(cases: list[dict]) -> None:
    for case in cases:
        callbacks = [ActivationOffload(), TiledLoss(num_tiles=3), TiledMLP(num_tiles=3)]  # any order: fixed by the strategy
        parity.train_and_compare(**case, callbacks=callbacks)


def test_all_memory_callbacks_together(dist_pool):
    """TiledMLP + TiledLoss + ActivationOffload together at P = 2 (reference and HF Llama) and P = 4."""
    dist_pool(2).run(run_with_all_three, cases=[
        dict(kind="llama", dp=1, sp=2, chunks=2, accumulate=2, seq_len=15),
        dict(kind="hf", dp=1, sp=2, chunks=2, accumulate=1, seq_len=16),
    ])
    dist_pool(4).run(run_with_all_three, cases=[dict(kind="llama", dp=1, sp=4, chunks=2, accumulate=1, seq_len=24)])


def run_with_residency(cases: list[dict]) -> None:
    for case in cases:
        callback = ActivationOffload(keep_inputs=1)
        parity.train_and_compare(**case, callbacks=[callback])
        assert callback._owner.regenerated > 0  # the second block's input came from a forward in the backward


def test_regenerated_inputs_under_fsdp2(dist_pool):
    """keep_inputs=1 at P = 2: the second block's input is regenerated in the backward, its FSDP2-sharded parameters
    gathered for that forward; training equals one process (reference Llama with gradient accumulation, HF Llama)."""
    dist_pool(2).run(run_with_residency, cases=[
        dict(kind="llama", dp=1, sp=2, chunks=2, accumulate=2, seq_len=15),
        dict(kind="hf", dp=1, sp=2, chunks=2, accumulate=1, seq_len=16),
    ])


def run_with_plain_blocks(cases: list[dict]) -> None:
    for case in cases:
        callback = ActivationOffload(checkpoint_blocks=1)
        parity.train_and_compare(**case, callbacks=[callback, TiledMLP(num_tiles=3)])
        assert callback._owner.checkpointed == 1


def test_plain_blocks_under_fsdp2(dist_pool):
    """checkpoint_blocks=1 at P = 2: the first block checkpointed, the second plain (its activations kept, its MLP
    whole under TiledMLP); training equals one process (reference Llama with gradient accumulation, HF Llama)."""
    dist_pool(2).run(run_with_plain_blocks, cases=[
        dict(kind="llama", dp=1, sp=2, chunks=2, accumulate=2, seq_len=15),
        dict(kind="hf", dp=1, sp=2, chunks=2, accumulate=1, seq_len=16),
    ])
