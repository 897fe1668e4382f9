"""LightningModules as users write them, under the fpdt strategy on gloo processes against one process: a
nanoGPT-style module (embeddings, a ModuleList of blocks and a tied head held directly), the loss a plain module
logs, and batches the strategy must refuse or warn about (docs/design.md §5, §7)."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import lightning_fpdt
from lightning_fpdt import FPDTStrategy
from tests.dist.training import VOCAB, PlainBlock, TokenDataset, full_state, reference_batch, trainer_kwargs

# fp32, as the whole-training parity tests: the parallel run sums the same products in another order (~1e-7
# relative per op); over 3 SGD steps of a 2-layer model the parameters stay within ~1e-6 of the reference
TOL = dict(rtol=1e-4, atol=2e-5)


class NanoGPT(L.LightningModule):
    """The most common way to write a small GPT: every part an attribute of the LightningModule itself, the head
    tied to the token embedding, F.scaled_dot_product_attention in the blocks, the loss logged in training_step."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2, max_len: int = 64) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.wte = nn.Embedding(VOCAB, dim)
        self.wpe = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(PlainBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as nanoGPT does
        self.logged: list[float] = []

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def local_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self(batch["input_ids"], batch["position_ids"])
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = lightning_fpdt.sequence_loss(self, self.local_loss(batch))  # the README's one line
        self.log("train_loss", loss)
        self.logged.append(float(self.trainer.callback_metrics["train_loss"]))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def nanogpt_reference(dataset: TokenDataset, steps: int, batch_size: int) -> tuple[dict, list[float]]:
    """One process, plain PyTorch: globally shifted labels and positions by hand; the batches in the order Lightning's
    DistributedSampler (shuffle, seed 0) gives the one data-parallel group."""
    module = NanoGPT()
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    losses = []
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    for batch in list(DataLoader(dataset, batch_size=batch_size, sampler=sampler))[:steps]:
        opt.zero_grad()
        loss = module.local_loss(reference_batch("plain", batch))
        losses.append(loss.item())
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in module.state_dict().items()}, losses


def nanogpt_matches_one_process(chunks: int) -> None:
    steps, batch_size = 3, 2
    dataset = TokenDataset(num_samples=steps * batch_size, seq_len=16, seed=3)
    module = NanoGPT()
    trainer = L.Trainer(strategy=FPDTStrategy(sequence_parallel_size=dist.get_world_size(), chunks=chunks),
                        devices=dist.get_world_size(), max_steps=steps, **trainer_kwargs())
    trainer.fit(module, DataLoader(dataset, batch_size=batch_size, shuffle=False))
    # each sample is masked unevenly, so the ranks' local means differ from the sequence's: the logged value is
    # the sequence's token mean only if it went through lightning_fpdt.sequence_loss
    ref_state, ref_losses = nanogpt_reference(dataset, steps, batch_size)
    torch.testing.assert_close(torch.tensor(module.logged), torch.tensor(ref_losses), **TOL)
    state = full_state(module)
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, **TOL, msg=lambda m: f"{name}: {m}")


def test_nanogpt_style_module_trains_as_one_process(dist_pool):
    """Embeddings, a ModuleList of blocks and a tied head on the LightningModule itself train exactly as one
    process does (FSDP2 units: each block, then the rest as one), and the loss it logs through
    lightning_fpdt.sequence_loss is the sequence's token mean on every rank."""
    dist_pool(2).run(nanogpt_matches_one_process, chunks=2)


def test_sequence_loss_is_the_loss_itself_without_fpdt():
    """Under another strategy lightning_fpdt.sequence_loss returns the loss unchanged (one process holds the whole
    sequence), so the README's training_step runs anywhere."""
    module = NanoGPT()
    L.Trainer(**trainer_kwargs(devices=1, max_steps=1)).fit(
        module, DataLoader([reference_batch("plain", b) for b in DataLoader(TokenDataset(2, 16, seed=3), 2)],
                           batch_size=None)
    )
    assert len(module.logged) == 1 and module.logged[0] > 0


class Recording(NanoGPT):
    """Returns its local loss for the strategy to reduce; notes the step whose batch had no target."""

    def __init__(self) -> None:
        super().__init__()
        self.targetless_steps: list[int] = []

    def training_step(self, batch, batch_idx):
        if bool((batch["labels"] == -100).all()) and dist.get_rank() == 0:
            self.targetless_steps.append(self.trainer.global_step)
        return self.local_loss(batch)


class TargetlessData(torch.utils.data.Dataset):
    """Step 1's batch has no target (every label -100); the others are ordinary."""

    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": torch.full_like(ids, -100) if i == 1 else ids}


def targetless_step_warns_once() -> None:
    trainer = L.Trainer(strategy=FPDTStrategy(sequence_parallel_size=2, chunks=2), devices=2, max_steps=3,
                        **trainer_kwargs())
    module = Recording()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(TargetlessData(), batch_size=1, shuffle=False))
    messages = [str(w.message) for w in caught if "no token with a target" in str(w.message)]
    if dist.get_rank() == 0:  # the warning comes from rank 0 alone
        (step,) = module.targetless_steps
        assert len(messages) == 1 and f"at global step {step} " in messages[0], messages
    assert trainer.global_step == 3 and all(torch.isfinite(p).all() for p in full_state(module).values())


def test_a_step_without_targets_trains_at_zero_and_warns_once(dist_pool):
    """A batch whose labels are all -100 gives loss 0.0 (no NaN, the weights stay finite) and one warning that names
    the global step."""
    dist_pool(2).run(targetless_step_warns_once)


def labels_of_another_length_are_refused() -> None:
    trainer = L.Trainer(strategy=FPDTStrategy(sequence_parallel_size=2), devices=2, max_steps=1, **trainer_kwargs())
    batches = [{"input_ids": torch.zeros(1, 32, dtype=torch.long), "labels": torch.zeros(1, 16, dtype=torch.long)}]
    with pytest.raises(ValueError, match=r"batch\['labels'\] has shape \(1, 16\) but input_ids has \(1, 32\): "
                                         r"sequences of 32 tokens need 32 labels"):
        trainer.fit(Recording(), DataLoader(batches, batch_size=None))


def test_labels_of_another_length_are_refused(dist_pool):
    """Labels shorter than input_ids raise a ValueError naming both shapes before any rank computes."""
    dist_pool(2).run(labels_of_another_length_are_refused)


def test_sequence_loss_outside_a_trainer():
    """A module not attached to a Trainer (a step called by hand) gets its loss back unchanged."""
    loss = torch.tensor(2.5)
    assert lightning_fpdt.sequence_loss(NanoGPT(), loss) is loss
