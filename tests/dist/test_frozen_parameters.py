"""Frozen parameters and adapters (``tests/tuning.py``) with the memory callbacks: after three optimizer steps every
parameter equals one process's without callbacks, each one that requires grad moved and each frozen one did not; on
1 process (the callbacks under Lightning's own strategy) and 2 (under ``strategy="fpdt"``)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_fpdt import ActivationOffload, TiledLoss, TiledMLP
from tests.dist import test_strategy_parity as parity
from tests.dist.training import LitLM, TokenDataset, build_model, reference_training, trainer_kwargs

pytest.importorskip("peft")

CALLBACKS = {
    "offload": lambda: [ActivationOffload()],
    "offload-recompute": lambda: [ActivationOffload(recompute_attention=True)],
    "offload-reload": lambda: [ActivationOffload(reload_input=True, prefetch=0)],
    "offload-keep1": lambda: [ActivationOffload(keep_inputs=1)],
    "offload-keep1-mlp": lambda: [ActivationOffload(keep_inputs=1), TiledMLP(num_tiles=3)],
    "offload-plain-mlp": lambda: [ActivationOffload(checkpoint_blocks=1), TiledMLP(num_tiles=3)],
    "all": lambda: [ActivationOffload(), TiledMLP(num_tiles=3), TiledLoss(num_tiles=3)],
}
"""The memory callbacks of a case, by name (built in the process that trains)."""


def run_frozen(cases: list[dict]) -> None:
    for case in cases:
        case = dict(case)
        callbacks, accumulate = CALLBACKS[case.pop("callbacks")](), case.pop("accumulate", 1)
        parity.train_and_compare(**case, dp=1, sp=2, accumulate=accumulate, callbacks=callbacks)


def test_frozen_parameters_two_processes(dist_pool):
    """sp=2 under the fpdt strategy: frozen embeddings (every callback, head groups, partial residency, the input
    reloaded, accumulation, a plain SDPA module, a block left plain), a frozen first block (the attention recomputed),
    only the MLPs, LoRA on the attention (every callback, a block left plain; peft's zero-initialised B, whose A trains
    from the second step) and on the MLP."""
    dist_pool(2).run(run_frozen, cases=[
        dict(kind="hf", tuning="embeddings", callbacks="all", chunks=2, seq_len=16),
        dict(kind="llama", tuning="embeddings", callbacks="offload-reload", chunks=2, seq_len=15, accumulate=2,
             head_chunks=2),
        dict(kind="llama", tuning="embeddings", callbacks="offload-keep1-mlp", chunks=2, seq_len=16),
        dict(kind="llama", tuning="first-block", callbacks="offload-recompute", chunks=2, seq_len=16),
        dict(kind="hf", tuning="mlps", callbacks="all", chunks=2, seq_len=16),
        dict(kind="plain", tuning="embeddings", callbacks="offload", chunks=2, seq_len=16),
        dict(kind="hf", tuning="lora-attention", callbacks="all", chunks=2, seq_len=16),
        dict(kind="llama", tuning="lora-default", callbacks="offload-keep1", chunks=1, seq_len=16),
        dict(kind="hf", tuning="lora-mlp", callbacks="offload-keep1-mlp", chunks=2, seq_len=16),
        dict(kind="hf", tuning="lora-attention", callbacks="offload-plain-mlp", chunks=2, seq_len=16),
        dict(kind="llama", tuning="embeddings", callbacks="offload-plain-mlp", chunks=2, seq_len=16),
    ])


@pytest.mark.parametrize("kind,tuning,callbacks", [
    ("hf", "embeddings", "all"),
    ("llama", "embeddings", "offload-keep1"),
    ("llama", "first-block", "offload-keep1-mlp"),
    ("hf", "mlps", "all"),
    ("hf", "lora-attention", "all"),
    ("hf", "lora-mlp", "offload"),
])
def test_frozen_parameters_one_process(kind, tuning, callbacks):
    """One process, the callbacks applied at setup under Lightning's own strategy: the same training as without
    them (a Hugging Face model's KV cache included, which the checkpointed blocks must not fill twice)."""
    seed, lr, steps = 1234, 0.5, 3
    dataset = TokenDataset(num_samples=2 * steps, seq_len=16, seed=7)
    module = LitLM(kind, seed, lr, tuning=tuning)
    trainer = L.Trainer(devices=1, max_steps=steps, callbacks=CALLBACKS[callbacks](), **trainer_kwargs())
    # the order the reference reads (the DistributedSampler Lightning installs for several processes)
    order = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    trainer.fit(module, DataLoader(dataset, batch_size=2, sampler=order))
    ref_params, ref_losses = reference_training(kind, seed=seed, lr=lr, steps=steps, accumulate=1, dp=1,
                                                dataset=dataset, batch_size=2, tuning=tuning)
    parity.compare_training(f"{kind} 1 process tuning={tuning} callbacks={callbacks}", module, ref_params,
                            module.losses, ref_losses[0], build_model(kind, seed, tuning))


def test_adapter_dropout_is_drawn_again_in_the_recompute():
    """LoRA with dropout under ActivationOffload: the recompute (and a forward regenerating an input) draws the masks
    the first forward drew, so the gradients are those of the same forward without checkpointing."""
    from lightning_fpdt.memory import find_blocks

    batch = TokenDataset(num_samples=2, seq_len=16, seed=3)[0]
    batch = {k: v[None] for k, v in batch.items()}
    grads = []
    for offload in (None, ActivationOffload(keep_inputs=1)):
        model = build_model("hf", 1234, "lora-dropout")
        if offload is not None:
            offload.fpdt_transform(model, find_blocks(model))
        torch.manual_seed(5)
        model(**batch).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 16
    for name, grad in grads[0].items():
        # fp32, the same products in the same order: rounding only
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def run_untrained(seq_len: int) -> None:
    import torch.distributed as dist

    from lightning_fpdt import FPDTStrategy, GradientCheck

    def fit(callbacks: list) -> None:
        module = LitLM("llama", 1234, 0.5)
        module.model.extra = torch.nn.Linear(4, 4)  # never called
        trainer = L.Trainer(strategy=FPDTStrategy(sequence_parallel_size=2, chunks=2, heartbeat_timeout=None), devices=dist.get_world_size(),
                            max_steps=2, callbacks=callbacks, **trainer_kwargs())
        trainer.fit(module, DataLoader(TokenDataset(num_samples=4, seq_len=seq_len, seed=7), batch_size=2))

    with pytest.raises(RuntimeError, match=r"No gradient at all for 2: model.extra.weight, model.extra.bias\."):
        fit([ActivationOffload(), GradientCheck(steps=2)])
    fit([ActivationOffload(), GradientCheck(allow=["model.extra.*"])])


def test_untrained_parameter_stops_every_rank(dist_pool):
    """Under the fpdt strategy a parameter no gradient reaches stops every rank at the same step with its name
    (none waits in a collective for another); allowed by name, the same fit ends normally."""
    dist_pool(2).run(run_untrained, seq_len=16)
