"""LlamaLM(meta_init=True) under Trainer(strategy="fpdt") on two gloo processes: each rank allocates only its FSDP2
shards and initialises them with the model's own init (docs/design.md §5)."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.callbacks import ActivationOffload, MFUMonitor, TiledLoss, TiledMLP
from lightning_fpdt.models.llama import RMSNorm
from lightning_fpdt.models.module import LlamaLM
from tests.dist.training import VOCAB, TokenDataset, trainer_kwargs


class InitialWeights(L.Callback):
    """At fit start (after the strategy's setup, before any step): the full parameters, gathered on every rank."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = pl_module.model
        self.meta = [name for name, p in model.named_parameters() if p.is_meta]
        self.full = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}  # collective
        self.tied_at_start = model.lm_head.weight is model.model.embed_tokens.weight
        self.norms = sorted(f"{name}.weight" for name, m in model.named_modules() if isinstance(m, RMSNorm))
        self.normal = sorted(
            f"{name}.weight" for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))
        )


def fit_meta_init(tied: bool, precision: str, memory_callbacks: bool) -> dict:
    L.seed_everything(0)  # the same on every rank, as the CLI's seed_everything does
    module = LlamaLM("tiny", meta_init=True, vocab_size=VOCAB, tie_word_embeddings=tied, lr=1e-2)
    initial = InitialWeights()
    callbacks = [TiledMLP(), TiledLoss(), ActivationOffload(), MFUMonitor()] if memory_callbacks else []
    trainer = L.Trainer(strategy=FPDTStrategy(sequence_parallel_size=2, chunks=2), devices=2, max_steps=2,
                        precision=precision, callbacks=[*callbacks, initial], **trainer_kwargs())
    trainer.fit(module, DataLoader(TokenDataset(8, 16, seed=1), batch_size=2))
    model = module.model
    return dict(
        meta=initial.meta, full=initial.full, norms=initial.norms, normal=initial.normal, losses=module.losses,
        tied_at_start=initial.tied_at_start, tied_at_end=model.lm_head.weight is model.model.embed_tokens.weight,
        initializer_range=model.config.initializer_range,
    )


@pytest.mark.parametrize(
    "tied, precision, memory_callbacks",
    [(False, "32-true", False), (True, "bf16-true", True)],  # bf16-true: the meta module is converted before setup
    ids=["untied-fp32", "tied-bf16-memory-callbacks"],
)
def test_meta_init_materialises_shards_with_the_model_init(dist_pool, tied, precision, memory_callbacks):
    """Meta-built weights come out of setup with the Llama's own init (normal, norms at 1), tied weights shared, the
    same full tensors on both ranks, distinct shards, and train to a finite loss (also with every memory callback)."""
    results = dist_pool(2).run(fit_meta_init, tied=tied, precision=precision, memory_callbacks=memory_callbacks)
    first = results[0]
    assert first["meta"] == []
    assert len(first["losses"]) == 2 and all(math.isfinite(loss) for loss in first["losses"])
    assert first["tied_at_start"] is tied and first["tied_at_end"] is tied
    for other in results[1:]:  # all-gathered, so the same full tensors on every rank
        assert other["full"].keys() == first["full"].keys()
        for name, value in first["full"].items():
            torch.testing.assert_close(other["full"][name], value, rtol=0, atol=0, msg=name)
    full, std = first["full"], first["initializer_range"]
    assert first["norms"] and all(torch.equal(full[name], torch.ones_like(full[name])) for name in first["norms"])
    # named_parameters lists a tied weight once, under the embedding
    normal = [name for name in first["normal"] if name in full]
    assert len(normal) == 16 - tied  # embedding, 2 layers x 7 projections (q, k, v, o, gate, up, down), lm_head
    for name in normal:
        weight = full[name].float()  # bf16 rounds each draw by at most 2^-9 of itself: far below the tolerances
        n = weight.numel()  # 2048 (k_proj, v_proj) to 8192 (gate, up, down)
        # n iid N(0, std²) draws: the sample std has standard error std / sqrt(2n) (1.6% of std at n = 2048), the
        # mean std / sqrt(n); 5 standard errors fail by chance with probability ~1e-6 per check (and the draws are
        # seeded), while nn.Linear's Kaiming init (std 0.051 to 0.072 here) or nn.Embedding's N(0, 1) are far outside
        assert abs(weight.std().item() - std) < 5 * std / math.sqrt(2 * n), name
        assert abs(weight.mean().item()) < 5 * std / math.sqrt(n), name
        # every row a fresh draw: ranks seeded alike must not draw equal shards (FSDP2 shards dim 0)
        assert torch.unique(weight, dim=0).shape[0] == weight.shape[0], name
