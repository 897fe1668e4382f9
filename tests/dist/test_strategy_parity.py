"""Whole-training parity: Trainer(strategy="fpdt") on N gloo processes vs one process (docs/design.md §5, §7)."""

from __future__ import annotations

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import lightning_fpdt  # noqa: F401  (registers "fpdt")
from lightning_fpdt import FPDTStrategy
from tests.dist.training import (FirstBatchGradients, LitLM, TokenDataset, build_model, full_state,
                                 reference_training, trainer_kwargs)

# fp32: the parallel run sums the same products in another order (blockwise softmax merge, gradient sums split
# across ranks and all-to-alls), ~1e-7 relative per op; over 3-4 SGD steps of a 2-layer model the parameters
# stay within ~1e-6 of the reference. 2e-5 absolute / 1e-4 relative leaves margin and still catches a lost
# label, a wrong position or a mis-weighted rank (those move the loss by > 1e-2).
TOL = dict(rtol=1e-4, atol=2e-5)
UPDATE_TOL = 1e-2
"""The largest error of a trained parameter against the reference, as a fraction of the reference's change of it:
fp32 rounding leaves ~1e-7 on updates of 1e-4 and more (~1e-3 of them); a wrong gradient is off by its own size."""


def train_and_compare(kind: str, dp: int, sp: int, chunks: int, accumulate: int, seq_len: int, steps: int = 3,
                      batch_size: int = 2, strategy_name: bool = False, callbacks: list | None = None,
                      tuning: str | None = None, **strategy_options) -> L.Trainer:
    """``steps`` optimizer steps under the fpdt strategy against one process without it (and without callbacks);
    ``tuning``: which parameters train (``tests/tuning.py``)."""
    world = dist.get_world_size()
    seed, lr = 1234, 0.5
    dataset = TokenDataset(num_samples=dp * batch_size * steps * accumulate, seq_len=seq_len, seed=7)
    strategy = "fpdt" if strategy_name else FPDTStrategy(sequence_parallel_size=sp, data_parallel_size=dp, chunks=chunks,
                                                         **strategy_options)
    trainer = L.Trainer(strategy=strategy, devices=world, max_steps=steps, accumulate_grad_batches=accumulate,
                        callbacks=callbacks or [], **trainer_kwargs())
    module = LitLM(kind, seed, lr, tuning=tuning)
    trainer.fit(module, DataLoader(dataset, batch_size=batch_size, shuffle=False))
    assert trainer.strategy.sequence_parallel_size == sp and trainer.strategy.data_parallel_size == dp

    ref_params, ref_losses = reference_training(kind, seed=seed, lr=lr, steps=steps, accumulate=accumulate, dp=dp,
                                                dataset=dataset, batch_size=batch_size, tuning=tuning)
    dp_rank = trainer.strategy.device_mesh["data_parallel"].get_local_rank()
    case = f"{kind} dp={dp} sp={sp} chunks={chunks} accumulate={accumulate} S={seq_len} tuning={tuning}"
    compare_training(case, module, ref_params, module.losses, ref_losses[dp_rank], build_model(kind, seed, tuning))
    return trainer


def compare_training(case: str, module: L.LightningModule, ref_params: dict[str, torch.Tensor], losses: list[float],
                     ref_losses: list[float], initial: torch.nn.Module) -> tuple[float, int]:
    """Losses and every parameter as the reference's (:data:`TOL`); every parameter that requires grad in
    ``initial`` (the model before training) moved, the others did not. Returns the worst error against the
    reference, relative to the reference's own change of that parameter, and the count of trainable tensors moved."""
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL,
                               msg=lambda m: f"{case} losses {losses} vs {ref_losses}: {m}")
    params = full_state(module)
    # tied weights: every name of a trainable tensor (state_dict lists each), counted once
    trainable = {name for name, p in initial.named_parameters(remove_duplicate=False) if p.requires_grad}
    count = sum(p.requires_grad for p in initial.parameters())
    worst, moved = 0.0, 0
    for name, start in initial.state_dict().items():
        ref, got = ref_params[name], params["model." + name]
        torch.testing.assert_close(got, ref, **TOL, msg=lambda m: f"{case} {name}: {m}")
        change = (ref - start).abs().max().item()
        if name in trainable:
            assert change > 0, f"{case}: {name} requires grad but the reference did not train it"
            # the error measured against the parameter's own change: a small update (a LoRA A whose B starts at
            # zero) must be right too, not only within TOL of where it started
            error = (got - ref).abs().max().item() / change
            assert error < UPDATE_TOL, f"{case}: {name} moved {change:.2e}, off the reference by {error:.1e} of that"
            worst = max(worst, error)
            moved += 1
        else:
            assert torch.equal(got, start), f"{case}: {name} is frozen but changed"
    moved -= len(trainable) - count  # a tied tensor's second name
    print(f"{case}: {moved} of {count} trainable tensors moved, worst error {worst:.1e} of the update")
    return worst, moved


def run_cases(cases: list[dict]) -> None:
    for case in cases:
        train_and_compare(**case)


def run_synced_accumulation(cases: list[dict]) -> None:
    """Each case once per ``sync_every_batch``: the same training as one process either way; after a window's first
    batch the shards hold its gradients where it reduce-scattered (``True``), and none where it did not (``False``,
    also what ``"auto"`` is on the CPU, where nothing plans)."""
    for case in cases:
        for sync, has_shards in ((True, True), (False, False), ("auto", False)):
            watch = FirstBatchGradients()
            train_and_compare(**case, sync_every_batch=sync, callbacks=[watch])
            assert watch.seen and all(seen == has_shards for seen in watch.seen), (case, sync, watch.seen)


def test_accumulation_synced_every_batch_or_at_the_window_end(dist_pool):
    """Gradient accumulation reduce-scattering every batch or only a window's last trains the same as one process:
    1×2 with chunks 2 and padding, 2×2 (data parallel, FSDP2's gradient divide factor)."""
    dist_pool(2).run(run_synced_accumulation, cases=[dict(kind="llama", dp=1, sp=2, chunks=2, accumulate=2, seq_len=15)])
    dist_pool(4).run(run_synced_accumulation, cases=[dict(kind="llama-mha", dp=2, sp=2, chunks=1, accumulate=2,
                                                          seq_len=16)])


def test_parity_two_processes(dist_pool):
    """1×2: reference Llama with chunks 2 and gradient accumulation 2, a HF Llama, a plain SDPA module; padding."""
    dist_pool(2).run(run_cases, cases=[
        dict(kind="llama", dp=1, sp=2, chunks=2, accumulate=2, seq_len=15),
        dict(kind="hf", dp=1, sp=2, chunks=1, accumulate=1, seq_len=16),
        dict(kind="hf", dp=1, sp=2, chunks=2, accumulate=1, seq_len=16, strategy_name=True),
        dict(kind="plain", dp=1, sp=2, chunks=2, accumulate=1, seq_len=16),
    ])


def test_parity_four_processes(dist_pool):
    """1×4 (kv heads replicated) and 2×2 (data parallel) for the reference and HF Llama, chunks 1 and 2."""
    dist_pool(4).run(run_cases, cases=[
        dict(kind="llama", dp=1, sp=4, chunks=2, accumulate=1, seq_len=24),
        dict(kind="llama-mha", dp=2, sp=2, chunks=1, accumulate=2, seq_len=16),
        dict(kind="hf", dp=2, sp=2, chunks=2, accumulate=1, seq_len=16),
        dict(kind="plain", dp=2, sp=2, chunks=1, accumulate=1, seq_len=14),
    ])
