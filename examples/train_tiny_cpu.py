"""Train the tiny reference Llama with Trainer(strategy="fpdt") on 2 CPU processes (gloo), FPDT chunks = 2.

The task: a sequence of random tokens followed by the same tokens again. The second half can only be predicted by
attending to the first, which lies on the other sequence-parallel rank, so the loss there falls below chance
(ln V) only if the sharded attention works.

    python examples/train_tiny_cpu.py
"""

from __future__ import annotations

import math

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_fpdt  # noqa: F401  (registers "fpdt")
from lightning_fpdt import FPDTStrategy
from lightning_fpdt.models.module import LlamaLM

VOCAB, HALF = 32, 32


class RepeatTask(Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        prefix = torch.randint(0, VOCAB, (HALF,), generator=torch.Generator().manual_seed(i))
        ids = torch.cat([prefix, prefix])
        labels = ids.clone()
        labels[: HALF + 1] = -100  # score only the copied half (its first token is unpredictable)
        return {"input_ids": ids, "labels": labels}


def main() -> None:
    torch.set_num_threads(1)
    module = LlamaLM("tiny", lr=3e-3, vocab_size=VOCAB, num_layers=2)
    trainer = L.Trainer(
        strategy=FPDTStrategy(sequence_parallel_size=2, chunks=2), accelerator="cpu", devices=2, max_steps=300,
        logger=False, enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=10,
    )
    trainer.fit(module, DataLoader(RepeatTask(), batch_size=8))
    if trainer.global_rank == 0:
        first, last = sum(module.losses[:10]) / 10, sum(module.losses[-10:]) / 10
        print(f"copy-task loss: first 10 steps {first:.3f}, last 10 steps {last:.3f}, chance ln({VOCAB}) = "
              f"{math.log(VOCAB):.3f}")


if __name__ == "__main__":
    main()
