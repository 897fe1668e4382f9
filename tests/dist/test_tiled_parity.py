"""TiledMLP and TiledLoss under Trainer(strategy=FPDTStrategy(...)) on N gloo processes vs one untiled process.

The parallel runs apply the callbacks' transforms inside the strategy (before FSDP2), so they also check that the
recomputing MLP backward and the precomputed loss gradients reach FSDP2's sharded gradients, and that the lm_head
weight is gathered where the tiled loss reads it.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.callbacks.tiled_loss import TiledLoss, tiled_cross_entropy
from lightning_fpdt.callbacks.tiled_mlp import TiledMLP
from lightning_fpdt.memory import find_mlps
from tests.dist.training import LitLM, TokenDataset, full_state, reference_training, trainer_kwargs

# fp32, as in test_strategy_parity: the parallel run sums the same products in another order (blockwise softmax
# merge, gradients split across ranks and tiles, fp32 tile accumulators), ~1e-7 relative per op; after 3 SGD steps
# of a 2-layer model parameters agree to ~1e-6. 2e-5 absolute / 1e-4 relative keeps margin and still catches a lost
# tile, a gradient counted twice or an unscaled loss gradient (those move the loss or a parameter by > 1e-3).
TOL = dict(rtol=1e-4, atol=2e-5)

# 3 tiles over 8-24 local tokens: uneven tiles, and a shard whose labels are all -100 in some steps (TokenDataset)
CALLBACKS = {"mlp": lambda: TiledMLP(num_tiles=3), "loss": lambda: TiledLoss(num_tiles=3)}


def train_tiled_and_compare(kind: str, tiles: list[str], dp: int, sp: int, chunks: int, seq_len: int,
                            accumulate: int = 1, steps: int = 3, batch_size: int = 2) -> None:
    world = dist.get_world_size()
    seed, lr = 1234, 0.5
    dataset = TokenDataset(num_samples=dp * batch_size * steps * accumulate, seq_len=seq_len, seed=7)
    strategy = FPDTStrategy(sequence_parallel_size=sp, data_parallel_size=dp, chunks=chunks)
    trainer = L.Trainer(strategy=strategy, devices=world, max_steps=steps, accumulate_grad_batches=accumulate,
                        callbacks=[CALLBACKS[name]() for name in tiles], **trainer_kwargs())
    module = LitLM(kind, seed, lr)
    trainer.fit(module, DataLoader(dataset, batch_size=batch_size, shuffle=False))

    case = f"{kind} {tiles} dp={dp} sp={sp} chunks={chunks} accumulate={accumulate} S={seq_len}"
    mlps = find_mlps([module.model])
    assert mlps and all(getattr(m, "_fpdt_tiled_mlp", False) == ("mlp" in tiles) for m in mlps), case
    assert getattr(module.model, "_fpdt_tiled_loss", False) == ("loss" in tiles), case

    ref_params, ref_losses = reference_training(kind, seed=seed, lr=lr, steps=steps, accumulate=accumulate, dp=dp,
                                                dataset=dataset, batch_size=batch_size)  # untiled, one process
    dp_rank = trainer.strategy.device_mesh["data_parallel"].get_local_rank()
    torch.testing.assert_close(torch.tensor(module.losses), torch.tensor(ref_losses[dp_rank]), **TOL,
                               msg=lambda m: f"{case} losses {module.losses} vs {ref_losses[dp_rank]}: {m}")
    params = full_state(module)
    for name, ref in ref_params.items():
        torch.testing.assert_close(params["model." + name], ref, **TOL, msg=lambda m: f"{case} {name}: {m}")

    if "loss" in tiles:
        # outside the model's forward FSDP2 holds the lm_head weight sharded: the tiled loss must refuse it
        weight = module.model.lm_head.weight
        with pytest.raises(ValueError, match="sharded DTensor weight"):
            tiled_cross_entropy(torch.randn(4, weight.shape[1]), weight, torch.zeros(4, dtype=torch.long))


def run_cases(cases: list[dict]) -> None:
    for case in cases:
        train_tiled_and_compare(**case)


def test_tiled_parity_two_processes(dist_pool):
    """P = 2: each callback alone and both, reference Llama (chunks 2, accumulation 2, padding), HF Llama, plain."""
    dist_pool(2).run(run_cases, cases=[
        dict(kind="llama", tiles=["mlp"], dp=1, sp=2, chunks=2, seq_len=15, accumulate=2),
        dict(kind="llama", tiles=["loss"], dp=1, sp=2, chunks=2, seq_len=15, accumulate=2),
        dict(kind="llama", tiles=["mlp", "loss"], dp=1, sp=2, chunks=2, seq_len=15, accumulate=2),
        dict(kind="hf", tiles=["loss"], dp=1, sp=2, chunks=2, seq_len=16),
        dict(kind="hf", tiles=["mlp", "loss"], dp=1, sp=2, chunks=1, seq_len=16),
        dict(kind="plain", tiles=["mlp"], dp=1, sp=2, chunks=2, seq_len=16),
    ])


def test_tiled_parity_four_processes(dist_pool):
    """P = 4 (1×4, kv heads replicated) and 2×2 (data parallel): each callback alone and both, reference and HF."""
    dist_pool(4).run(run_cases, cases=[
        dict(kind="llama", tiles=["mlp"], dp=1, sp=4, chunks=2, seq_len=24),
        dict(kind="llama", tiles=["loss"], dp=1, sp=4, chunks=2, seq_len=24),
        dict(kind="llama", tiles=["mlp", "loss"], dp=1, sp=4, chunks=2, seq_len=24),
        dict(kind="hf", tiles=["mlp"], dp=2, sp=2, chunks=2, seq_len=16),
        dict(kind="hf", tiles=["loss"], dp=2, sp=2, chunks=2, seq_len=16),
        dict(kind="hf", tiles=["mlp", "loss"], dp=2, sp=2, chunks=1, seq_len=16, accumulate=2),
    ])
