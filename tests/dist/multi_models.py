"""LightningModules that hold more than one language model, or a model beside other modules, as fine-tuning code
writes them (a value head, a frozen probe, DPO's trained policy beside a frozen reference), and their one-process
references: the same ``compute`` on the whole sequence, its targets shifted and positions given as the strategy
gives them to each rank."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import lightning_fpdt
from lightning_fpdt.sequence.loss import shift_labels
from tests.dist.training import VOCAB, TokenDataset
from tests.tuning import freeze_embeddings

HIDDEN = 32
BETA = 0.5
"""DPO's temperature: large enough that the policy's gradient is far from zero in the first steps."""


def hf_llama(seed: int, attention: str = "sdpa") -> nn.Module:
    """A tiny Hugging Face Llama (4 query, 2 kv heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation=attention)
    return LlamaForCausalLM(config)


def token_log_probs(logits: Tensor, targets: Tensor) -> Tensor:
    """``(B, S)`` log-probability of each token's target; 0 where it has none (-100)."""
    return -F.cross_entropy(logits.transpose(1, 2).float(), targets, ignore_index=-100, reduction="none")


class MultiModelLM(L.LightningModule):
    """A Hugging Face model and what sits beside it, by ``case``:

    - ``"probe"``: a frozen linear probe reads the last hidden states under ``no_grad`` (its sequence mean logged);
    - ``"value-head"``: a trained value head regresses per-token rewards beside the LM loss (``sequence_mean``);
    - ``"dpo"``: a trained policy and a frozen reference model of its own weights, DPO's loss of per-sequence
      log-probability sums (``sequence_sum``), the reference's under ``no_grad``;
    - ``"eager"``: ``"value-head"`` with ``attn_implementation="eager"`` and frozen embeddings;
    - ``"right-padding"``: the model alone, batches right-padded with an ``attention_mask``.
    """

    def __init__(self, case: str, seed: int = 3, lr: float = 0.2) -> None:
        super().__init__()
        self.case, self.lr = case, lr
        self.model = hf_llama(seed, "eager" if case == "eager" else "sdpa")
        if case == "eager":
            freeze_embeddings(self.model, seed)
        if case == "probe":
            self.probe = nn.Linear(HIDDEN, 4).requires_grad_(False)
        if case in ("value-head", "eager"):
            self.value_head = nn.Linear(HIDDEN, 1)
        if case == "dpo":
            self.reference = hf_llama(seed + 1).eval().requires_grad_(False)
        self.losses: list[float] = []
        """The loss training_step returned, per step (on every rank: the sequence's)."""
        self.recorded: list[Tensor] = []
        """Per step: the probe's sequence means, or the reference model's log-probability sums."""

    def compute(self, batch: dict[str, Tensor]) -> Tensor:
        """The step's loss from a batch whose ``labels`` are already shifted (as the strategy gives them)."""
        targets = batch["labels"]
        if self.case == "dpo":
            return self.dpo_loss(batch, targets)
        if self.case == "right-padding":
            return self.model(**batch).loss
        out = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=targets,
                         shift_labels=targets, output_hidden_states=True)
        hidden = out.hidden_states[-1]
        if self.case == "probe":
            with torch.no_grad():
                self.recorded.append(lightning_fpdt.sequence_mean(self, self.probe(hidden)).detach().clone())
            return out.loss
        values = self.value_head(hidden).squeeze(-1)  # (B, S/P)
        errors = (values - batch["rewards"]) ** 2
        return out.loss + lightning_fpdt.sequence_mean(self, errors, targets != -100).mean()

    def dpo_loss(self, batch: dict[str, Tensor], targets: Tensor) -> Tensor:
        """Rows ``2i`` (chosen) and ``2i + 1`` (rejected) are a pair."""
        counted = targets != -100
        logits = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        policy = lightning_fpdt.sequence_sum(self, token_log_probs(logits, targets), counted)  # (B,)
        with torch.no_grad():
            ref_logits = self.reference(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            reference = lightning_fpdt.sequence_sum(self, token_log_probs(ref_logits, targets), counted)
        self.recorded.append(reference.detach().clone())
        margin = (policy[0::2] - reference[0::2]) - (policy[1::2] - reference[1::2])
        return -F.logsigmoid(BETA * margin).mean()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.compute(batch)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)


class RewardTokens(TokenDataset):
    """Random tokens (uneven -100 prefixes) with a random per-token reward for the value head."""

    def __init__(self, num_samples: int, seq_len: int, seed: int) -> None:
        super().__init__(num_samples, seq_len, seed)
        self.rewards = torch.randn(num_samples, seq_len, generator=torch.Generator().manual_seed(seed + 1))

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {**super().__getitem__(i), "rewards": self.rewards[i]}


class RightPadded(TokenDataset):
    """Random tokens, each sample right-padded by an ``attention_mask`` (1 to 6 zeros at the end, labels -100)."""

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        sample = super().__getitem__(i)
        mask = torch.ones_like(sample["input_ids"])
        mask[len(mask) - 1 - i % 6:] = 0
        return {"input_ids": sample["input_ids"], "labels": sample["labels"].masked_fill(mask == 0, -100),
                "attention_mask": mask}


class Pairs(Dataset):
    """DPO pairs: a chosen and a rejected sequence of random tokens sharing a prompt (labels -100 there)."""

    def __init__(self, num_pairs: int, seq_len: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(0, VOCAB, (num_pairs, 2, seq_len), generator=gen)
        self.input_ids[:, 1, : seq_len // 3] = self.input_ids[:, 0, : seq_len // 3]
        self.labels = self.input_ids.clone()
        self.labels[:, :, : seq_len // 3] = -100

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


def collate_pairs(samples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Pairs stacked into rows: chosen, rejected, chosen, rejected, ..."""
    return {key: torch.cat([s[key] for s in samples]) for key in samples[0]}


def dataset_of(case: str, samples: int, seq_len: int) -> tuple[Dataset, Any]:
    """The data of ``case`` and its collate function."""
    if case == "dpo":
        return Pairs(samples, seq_len, seed=5), collate_pairs
    if case == "right-padding":
        return RightPadded(samples, seq_len, seed=5), None
    return RewardTokens(samples, seq_len, seed=5), None


def one_process_batch(batch: dict[str, Tensor], case: str) -> dict[str, Tensor]:
    """What the strategy gives the ranks, for the whole sequence: labels shifted, positions; the right-padding case
    keeps its mask and unshifted labels (one process runs the model with the mask, as its user does)."""
    if case == "right-padding":
        return batch
    seq_len = batch["input_ids"].shape[1]
    return {**batch, "labels": shift_labels(batch["labels"]),
            "position_ids": torch.arange(seq_len).expand_as(batch["input_ids"])}


def one_process_training(case: str, dataset: Dataset, collate: Any, *, steps: int,
                         batch_size: int) -> MultiModelLM:
    """The module trained alone, on the batches Lightning's DistributedSampler (shuffle, seed 0) gives the group."""
    module = MultiModelLM(case)
    optimizer = module.configure_optimizers()
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    for batch in list(DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate))[:steps]:
        optimizer.zero_grad()
        loss = module.compute(one_process_batch(batch, case))
        module.losses.append(float(loss.detach()))
        loss.backward()
        optimizer.step()
    return module


def worst_error(got: dict[str, Tensor], ref: dict[str, Tensor], start: dict[str, Tensor],
                prefix: Optional[str] = None) -> float:
    """The largest error of a parameter against the reference, as a fraction of the reference's change of it (a
    parameter the reference did not change must be equal)."""
    worst = 0.0
    for name, value in ref.items():
        if prefix is not None and not name.startswith(prefix):
            continue
        change = (value - start[name]).abs().max().item()
        error = (got[name] - value).abs().max().item()
        if change == 0:
            assert error == 0, f"{name} is unchanged alone but changed under the strategy (by {error:.2e})"
            continue
        worst = max(worst, error / change)
    return worst
