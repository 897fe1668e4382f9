"""A few real training steps of the reference Llama under Trainer(strategy="fpdt") on the GPUs of one host.

    torchrun --nproc_per_node N bench/smoke_train.py --model llama3-1b --layers 2 --seq-len 32768 --chunks 4

Prints the first-step loss (compare it across GPU counts: same init, same data) and MFUMonitor's summary.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_fpdt import ActivationOffload, FPDTStrategy, MFUMonitor, TiledLoss, TiledMLP
from lightning_fpdt.models.llama import LlamaConfig
from lightning_fpdt.models.module import LlamaLM


class RandomTokens(Dataset):
    def __init__(self, vocab: int, seq_len: int, n: int) -> None:
        self.vocab, self.seq_len, self.n = vocab, seq_len, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(i)
        ids = torch.randint(0, self.vocab, (self.seq_len,), generator=gen)
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-1b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--devices", type=int, default=torch.cuda.device_count())
    parser.add_argument("--offload", choices=["auto", "on", "off"], default="auto", help="attention chunk offload")
    parser.add_argument("--callbacks", default="", help="comma list of mlp, loss, offload, checkpoint (no offload)")
    args = parser.parse_args()
    config = LlamaConfig.from_name(args.model, num_layers=args.layers)
    module = LlamaLM(args.model, lr=1e-4, num_layers=args.layers)
    chosen = {name for name in args.callbacks.split(",") if name}
    callbacks = [MFUMonitor()]
    callbacks += [TiledMLP()] if "mlp" in chosen else []
    callbacks += [TiledLoss()] if "loss" in chosen else []
    callbacks += [ActivationOffload()] if "offload" in chosen else []
    callbacks += [ActivationOffload(offload=False)] if "checkpoint" in chosen else []
    trainer = L.Trainer(
        strategy=FPDTStrategy(chunks=args.chunks, offload={"auto": "auto", "on": True, "off": False}[args.offload]), accelerator="gpu", devices=args.devices, precision="bf16-mixed",
        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks,
    )
    trainer.fit(module, DataLoader(RandomTokens(config.vocab_size, args.seq_len, 64), batch_size=1))
    if trainer.global_rank == 0:
        peak = torch.cuda.max_memory_allocated() / 2**30
        # this rank's share of fp32 parameters, gradients and AdamW's two moments (16 bytes per parameter)
        local_params = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in module.parameters())
        states = 16 * local_params / 2**30
        print(f"RESULT model={args.model} layers={args.layers} S={args.seq_len} gpus={args.devices} "
              f"callbacks={sorted(chosen)} "
              f"sp={trainer.strategy.sequence_parallel_size} chunks={args.chunks} first_loss={module.losses[0]:.5f} "
              f"last_loss={module.losses[-1]:.5f} peak_gib={peak:.1f} states_gib={states:.1f} "
              f"peak_minus_states_gib={peak - states:.1f} offload={trainer.strategy.offload_for(args.seq_len)}")


if __name__ == "__main__":
    main()
