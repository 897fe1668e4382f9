"""Training on packed documents under Trainer(strategy="fpdt") equals training on each document separately, the
loss being the token-weighted mean of the documents' losses (docs/design.md §5, §7)."""

from __future__ import annotations

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import lightning_fpdt  # noqa: F401  (registers "fpdt")
from lightning_fpdt import FPDTStrategy
from lightning_fpdt.callbacks.activation_offload import ActivationOffload
from lightning_fpdt.callbacks.tiled_loss import TiledLoss
from lightning_fpdt.callbacks.tiled_mlp import TiledMLP
from tests.dist.test_strategy_parity import compare_training
from tests.dist.training import VOCAB, LitLM, build_model, trainer_kwargs

# The tolerances are test_strategy_parity's (compare_training): the parallel run sums the same products in another
# order (~1e-7 relative per op); after 2 SGD steps of a 2-layer model parameters agree to ~1e-6. A token attending
# across a document, a lost or extra target at a document edge or a wrong RoPE position moves the loss by > 1e-2.


class PackedDataset(Dataset):
    """Random documents packed back to back; lengths include 1 and documents crossing every shard edge.

    ``fields`` picks what a sample carries besides input_ids/labels: ``document_ids`` and/or ``position_ids``
    (restarting at 0 per document, as PackedTokenDataset emits them). Labels at document starts are -100 when
    ``mask_starts`` (as PackedTokenDataset does); otherwise the strategy must drop those targets itself.
    """

    def __init__(self, num_samples: int, seq_len: int, seed: int, fields: tuple[str, ...],
                 mask_starts: bool = True) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.samples, self.documents = [], []
        for i in range(num_samples):
            cuts = sorted(set(torch.randint(1, seq_len, (4,), generator=gen).tolist()) | {1 + i % 3})
            starts = [0] + [c for c in cuts if 0 < c < seq_len]
            ends = starts[1:] + [seq_len]
            ids = torch.randint(0, VOCAB, (seq_len,), generator=gen)
            document_ids = torch.cat([torch.full((e - s,), d) for d, (s, e) in enumerate(zip(starts, ends))])
            labels = ids.clone()
            if mask_starts:
                labels[starts[1:]] = -100
            sample = {"input_ids": ids, "labels": labels}
            if "document_ids" in fields:
                sample["document_ids"] = document_ids
            if "position_ids" in fields:
                sample["position_ids"] = torch.cat([torch.arange(e - s) for s, e in zip(starts, ends)])
            self.samples.append(sample)
            self.documents.append([ids[s:e] for s, e in zip(starts, ends)])

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.samples[i]


def packed_loss(kind: str, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if kind == "hf":
        return model(**{k: v for k, v in batch.items() if k != "document_ids"}).loss
    return model(**batch)


class LitPacked(LitLM):
    """LitLM whose batches carry document ids (which a Hugging Face model does not take)."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return packed_loss(self.kind, self.model, batch)


def separate_documents_training(kind: str, dataset: PackedDataset, *, seed: int, lr: float, steps: int,
                                batch_size: int, tuning: str | None = None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, no packing: every document alone through the model; the step's loss is the token-weighted mean
    of the documents' mean losses (a document of n tokens has n - 1 targets)."""
    model = build_model(kind, seed, tuning)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    # the order Lightning's DistributedSampler(shuffle=True, seed=0) gives the single data-parallel group
    order = list(DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0))
    losses = []
    for step in range(steps):
        opt.zero_grad()
        documents = [doc for i in order[step * batch_size:(step + 1) * batch_size] for doc in dataset.documents[i]]
        targets = sum(len(doc) - 1 for doc in documents)
        total = sum(packed_loss(kind, model, {"input_ids": doc[None], "labels": doc[None]}) * (len(doc) - 1)
                    for doc in documents if len(doc) > 1)
        loss = total / targets
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach() for k, v in model.state_dict().items()}, losses


def train_packed_and_compare(kind: str, sp: int, chunks: int, seq_len: int, fields: tuple[str, ...],
                             steps: int = 2, batch_size: int = 2, mask_starts: bool = True,
                             memory_callbacks: bool = False, tuning: str | None = None) -> None:
    seed, lr = 4321, 0.5
    dataset = PackedDataset(num_samples=batch_size * steps, seq_len=seq_len, seed=11, fields=fields,
                            mask_starts=mask_starts)
    strategy = FPDTStrategy(sequence_parallel_size=sp, data_parallel_size=1, chunks=chunks)
    # ActivationOffload's first pass keeps the attention's plan (documents included) for the recompute
    callbacks = [ActivationOffload(), TiledLoss(num_tiles=3), TiledMLP(num_tiles=3)] if memory_callbacks else []
    trainer = L.Trainer(strategy=strategy, devices=dist.get_world_size(), max_steps=steps, callbacks=callbacks,
                        **trainer_kwargs())
    module = LitPacked(kind, seed, lr, tuning=tuning)
    trainer.fit(module, DataLoader(dataset, batch_size=batch_size, shuffle=False))
    assert trainer.strategy._context.attention.documents is not None, "the packed batch did not turn masking on"

    ref_params, ref_losses = separate_documents_training(kind, dataset, seed=seed, lr=lr, steps=steps,
                                                         batch_size=batch_size, tuning=tuning)
    case = f"{kind} sp={sp} chunks={chunks} S={seq_len} fields={fields} mask_starts={mask_starts} " \
           f"memory_callbacks={memory_callbacks} tuning={tuning}"
    compare_training(case, module, ref_params, module.losses, ref_losses, build_model(kind, seed, tuning))


def run_cases(cases: list[dict]) -> None:
    for case in cases:
        train_packed_and_compare(**case)


def test_packed_training_two_processes(dist_pool):
    """sp=2: reference Llama from document_ids (chunks 2, padded length), from position resets with labels not
    masked at document starts (the strategy drops those targets), and a HF Llama."""
    dist_pool(2).run(run_cases, cases=[
        dict(kind="llama", sp=2, chunks=2, seq_len=15, fields=("document_ids",)),
        dict(kind="llama", sp=2, chunks=1, seq_len=16, fields=("position_ids",), mask_starts=False),
        dict(kind="hf", sp=2, chunks=2, seq_len=16, fields=("document_ids", "position_ids")),
        # frozen embeddings under every memory callback: the checkpointed blocks train on packed documents
        dict(kind="llama", sp=2, chunks=2, seq_len=16, fields=("document_ids",), memory_callbacks=True,
             tuning="embeddings"),
    ])


def test_packed_training_four_processes(dist_pool):
    """sp=4 (kv heads replicated), chunks 2: documents crossing rank and chunk edges, both id sources; with
    ActivationOffload + TiledMLP + TiledLoss (no attention recompute: the recompute reuses the packed result)."""
    dist_pool(4).run(run_cases, cases=[
        dict(kind="llama", sp=4, chunks=2, seq_len=22, fields=("document_ids", "position_ids")),
        dict(kind="llama", sp=4, chunks=2, seq_len=22, fields=("document_ids",), memory_callbacks=True),
    ])
