"""Strategy life cycle on two gloo processes: evaluation, fit-then-validate, batch errors (docs/design.md §5)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, SequentialSampler

import lightning_fpdt  # noqa: F401
from lightning_fpdt import FPDTStrategy
from tests.dist.training import VOCAB, LitLM, TokenDataset, build_model, model_loss, trainer_kwargs


class EvalLM(LitLM):
    def validation_step(self, batch, batch_idx):
        loss = model_loss(self.kind, self.model, batch)
        self.val_losses.append(loss.item())
        return loss


def fit_then_validate() -> None:
    dataset = TokenDataset(num_samples=4, seq_len=16, seed=3)
    module = EvalLM("llama", seed=5, lr=0.0)  # lr 0: validation sees the initial weights
    module.val_losses = []
    strategy = FPDTStrategy(sequence_parallel_size=2, data_parallel_size=1, chunks=2)
    # inference_mode stays at its default (True): the strategy must make evaluation work by itself
    trainer = L.Trainer(strategy=strategy, devices=2, max_steps=1, **trainer_kwargs())
    trainer.fit(module, DataLoader(dataset, batch_size=2))
    fsdp_units = sum(isinstance(m, FSDPModule) for m in module.modules())
    trainer.validate(module, DataLoader(dataset, batch_size=2))
    assert sum(isinstance(m, FSDPModule) for m in module.modules()) == fsdp_units  # not wrapped twice
    # the reference: one process, the same initial model, the same validation batches (no shuffling in eval)
    ref_model = build_model("llama", seed=5)
    with torch.no_grad():
        ref = [model_loss("llama", ref_model, batch).item() for batch in DataLoader(dataset, batch_size=2)]
    torch.testing.assert_close(torch.tensor(module.val_losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)


def test_validation_after_fit_without_inference_mode_false(dist_pool):
    """validate() after fit() works under the default inference_mode, equals one process, and wraps once."""
    dist_pool(2).run(fit_then_validate)


class TupleLoader(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        return torch.randint(0, 64, (8,)), torch.randint(0, 64, (8,))


class MaskedTokens(TokenDataset):
    def __getitem__(self, i):
        mask = torch.ones(self.input_ids.shape[1], dtype=torch.long)
        mask[-3:] = 0
        return {**super().__getitem__(i), "attention_mask": mask}


def bad_batches() -> None:
    for dataset, match in [
        (TupleLoader(), "shards batches by their 'input_ids'"),
        (MaskedTokens(2, 8, 0), r"attention_mask'\] has zeros"),
    ]:
        trainer = L.Trainer(strategy=FPDTStrategy(sequence_parallel_size=2), devices=2, max_steps=1,
                            **trainer_kwargs())
        with pytest.raises(ValueError, match=match):
            trainer.fit(LitLM("llama", seed=0, lr=0.1), DataLoader(dataset, batch_size=2))
    trainer = L.Trainer(strategy=FPDTStrategy(sequence_parallel_size=2, chunks=2, pad_to_multiple=False), devices=2,
                        max_steps=1, **trainer_kwargs())
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by .* = 4: pad it to 12"):
        trainer.fit(LitLM("llama", seed=0, lr=0.1), DataLoader(TokenDataset(2, 10, 0), batch_size=2))


def test_batch_errors(dist_pool):
    """A batch without input_ids, a padding mask with zeros, or an undivisible length (padding off) raise."""
    dist_pool(2).run(bad_batches)


class OneBadToken(TokenDataset):
    """Random tokens with one id past the vocabulary in sample 3 (the second batch's second row)."""

    def __getitem__(self, i):
        sample = super().__getitem__(i)
        if i == 3:
            sample = {**sample, "input_ids": sample["input_ids"].clone()}
            sample["input_ids"][11] = VOCAB + 5
        return sample


class CountingLM(LitLM):
    def training_step(self, batch, batch_idx):
        self.forwards += 1
        return super().training_step(batch, batch_idx)


def out_of_vocabulary_ids() -> None:
    for kind in ("llama", "hf"):
        module = CountingLM(kind, seed=0, lr=0.1)
        module.forwards = 0
        trainer = L.Trainer(strategy=FPDTStrategy(sequence_parallel_size=2, chunks=2), devices=2, max_steps=4,
                            **trainer_kwargs())
        # no shuffling: the bad sample is in the second batch, before that batch's forward
        loader = DataLoader(OneBadToken(8, 16, seed=4), batch_size=2, sampler=SequentialSampler(range(8)))
        source = "config.vocab_size" if kind == "llama" else "input embedding"
        with pytest.raises(ValueError, match=rf"holds token id {VOCAB + 5} at batch row 1, token 11 of 16 .*vocabulary "
                                             rf"has {VOCAB} ids .*{source}"):
            trainer.fit(module, loader)
        assert module.forwards == 1 and trainer.global_step == 1
    trainer = L.Trainer(strategy=FPDTStrategy(sequence_parallel_size=2, pad_token_id=VOCAB), devices=2, max_steps=1,
                        **trainer_kwargs())
    with pytest.raises(ValueError, match=rf"pad_token_id={VOCAB}\) is outside the model's vocabulary of {VOCAB} ids"):
        trainer.fit(LitLM("llama", seed=0, lr=0.1), DataLoader(TokenDataset(2, 16, 0), batch_size=2))


def test_out_of_vocabulary_ids_are_refused_before_their_forward(dist_pool):
    """A batch holding an id past the vocabulary (reference Llama and Hugging Face Llama) raises a ValueError on
    every rank that names the id, its place and the vocabulary before that batch's forward; a padding id outside
    the vocabulary is refused at setup."""
    dist_pool(2).run(out_of_vocabulary_ids)
