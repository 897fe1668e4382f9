"""Your own training loop with Fabric(strategy="fpdt"): a tiny Llama learns to copy a random sequence, each sequence
split over 2 CPU processes (gloo), 2 FPDT chunks per rank (docs/fabric.md).

The second half of every sample repeats its first half, so the loss on the second half can only fall by attending
across the whole sequence, half of which sits on the other process.

    python examples/fabric_loop.py                                  # Fabric starts the 2 processes
    torchrun --nproc_per_node 2 examples/fabric_loop.py             # or torchrun does
    python examples/fabric_loop.py --accelerator cuda --precision bf16-mixed   # on 2 GPUs (NCCL)
"""

from __future__ import annotations

import argparse

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, Dataset

import lightning_fpdt  # noqa: F401  (registers "fpdt" with Fabric)
from lightning_fpdt import FPDTFabricStrategy
from lightning_fpdt.models.llama import LlamaConfig, LlamaForCausalLM

VOCAB = 16


class CopyTask(Dataset):
    """Random tokens, then the same tokens again; a target only where it can be predicted (the repeat)."""

    def __init__(self, num_samples: int, seq_len: int, seed: int) -> None:
        half = torch.randint(0, VOCAB, (num_samples, seq_len // 2), generator=torch.Generator().manual_seed(seed))
        self.input_ids = torch.cat([half, half], dim=1)
        self.labels = self.input_ids.clone()
        self.labels[:, : seq_len // 2 + 1] = -100  # labels are the tokens themselves; the strategy shifts them

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--checkpoint", default="checkpoints/fabric-copy")
    parser.add_argument("--accelerator", default="cpu", help="cpu (gloo) or cuda (NCCL)")
    parser.add_argument("--precision", default="32-true", help="e.g. bf16-mixed on GPUs")
    args = parser.parse_args()

    strategy = FPDTFabricStrategy(sequence_parallel_size=2, chunks=2)
    fabric = Fabric(strategy=strategy, accelerator=args.accelerator, devices=2, precision=args.precision)
    fabric.launch()
    fabric.seed_everything(0)

    model = LlamaForCausalLM(LlamaConfig.from_name("tiny", vocab_size=VOCAB, num_heads=4, num_kv_heads=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)  # the FPDT attention and loss, FSDP2
    loader = fabric.setup_dataloaders(  # the same samples on both ranks, each rank its half of every sequence
        DataLoader(CopyTask(num_samples=args.steps * 8, seq_len=args.seq_len, seed=0), batch_size=8, shuffle=True))

    model.train()
    for step, batch in enumerate(loader):
        loss = model(**batch)  # the sequence's token-mean loss, the same on both ranks
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % 25 == 0 or step == len(loader) - 1:
            fabric.print(f"step {step:4d}  loss {loss.item():.3f}  (this rank holds {batch['input_ids'].shape[1]} "
                         f"of {args.seq_len} tokens)")

    fabric.save(args.checkpoint, {"model": model, "optimizer": optimizer, "step": len(loader)})
    fabric.print(f"saved {args.checkpoint}")


if __name__ == "__main__":
    main()
