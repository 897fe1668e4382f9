"""A few real training steps of the reference Llama under Trainer(strategy="fpdt") on the GPUs of one host.

    torchrun --standalone --nproc_per_node N -m bench.smoke_train --model llama3-1b --layers 2 --seq-len 32768 \\
        --chunks 4 --out smoke_train.jsonl

Prints the first-step loss (compare it across GPU counts: same init, same data) and MFUMonitor's summary; with
``--out``, appends one JSON record of the run (step time, TFLOP/s and MFU as the median of the steps after the
first, peak GPU memory and this rank's share of the states) to that file.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from bench.provenance import append_record, stamp, this_command  # noqa: E402
from lightning_fpdt import ActivationOffload, FPDTStrategy, MFUMonitor, TiledLoss, TiledMLP  # noqa: E402
from lightning_fpdt.flops import peak_flops  # noqa: E402
from lightning_fpdt.models.llama import LlamaConfig  # noqa: E402
from lightning_fpdt.models.module import LlamaLM  # noqa: E402

GIB = 2**30


class RandomTokens(Dataset):
    def __init__(self, vocab: int, seq_len: int, n: int) -> None:
        self.vocab, self.seq_len, self.n = vocab, seq_len, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(i)
        ids = torch.randint(0, self.vocab, (self.seq_len,), generator=gen)
        return {"input_ids": ids, "labels": ids}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-1b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--devices", type=int, default=torch.cuda.device_count())
    parser.add_argument("--offload", choices=["auto", "on", "off"], default="auto", help="attention chunk offload")
    parser.add_argument("--callbacks", default="", help="comma list of mlp, loss, offload, checkpoint (no offload)")
    parser.add_argument("--out", default=None, help="append the run's JSON record to this JSONL file")
    return parser.parse_args()


def build_callbacks(chosen: set[str]) -> list[L.Callback]:
    callbacks: list[L.Callback] = [MFUMonitor()]
    callbacks += [TiledMLP()] if "mlp" in chosen else []
    callbacks += [TiledLoss()] if "loss" in chosen else []
    callbacks += [ActivationOffload()] if "offload" in chosen else []
    callbacks += [ActivationOffload(offload=False)] if "checkpoint" in chosen else []
    return callbacks


def speed(monitor: MFUMonitor, world_size: int) -> dict[str, Any]:
    """Step time, TFLOP/s per GPU and MFU: the median of the steps after the first (a warm-up), as MFUMonitor does."""
    steps = monitor.step_records[1:] or monitor.step_records
    if not steps:
        return dict(step_time_s=None, tflops_per_gpu=None, mfu=None)
    peak = peak_flops(torch.cuda.get_device_name(), "bf16")
    tflops = statistics.median(r.flops / r.step_time_s / world_size / 1e12 for r in steps)
    return dict(step_time_s=statistics.median(r.step_time_s for r in steps), tflops_per_gpu=tflops,
                mfu=None if peak is None else tflops * 1e12 / peak)


def main() -> None:
    args = parse_args()
    config = LlamaConfig.from_name(args.model, num_layers=args.layers)
    module = LlamaLM(args.model, lr=1e-4, num_layers=args.layers)
    chosen = {name for name in args.callbacks.split(",") if name}
    callbacks = build_callbacks(chosen)
    strategy = FPDTStrategy(chunks=args.chunks, offload={"auto": "auto", "on": True, "off": False}[args.offload],
                            plan_trial=False)  # the steps timed run one configuration
    trainer = L.Trainer(
        strategy=strategy, accelerator="gpu", devices=args.devices, precision="bf16-mixed",
        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks,
    )
    trainer.fit(module, DataLoader(RandomTokens(config.vocab_size, args.seq_len, 64), batch_size=1))
    if trainer.global_rank != 0:
        return
    peak = torch.cuda.max_memory_allocated() / GIB
    # this rank's share of fp32 parameters, gradients and AdamW's two moments (16 bytes per parameter)
    local_params = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in module.parameters())
    states = 16 * local_params / GIB
    offload = trainer.strategy.resolved_options(args.seq_len).offload
    print(f"RESULT model={args.model} layers={args.layers} S={args.seq_len} gpus={args.devices} "
          f"callbacks={sorted(chosen)} "
          f"sp={trainer.strategy.sequence_parallel_size} chunks={args.chunks} first_loss={module.losses[0]:.5f} "
          f"last_loss={module.losses[-1]:.5f} peak_gib={peak:.1f} states_gib={states:.1f} "
          f"peak_minus_states_gib={peak - states:.1f} offload={offload}")
    if args.out:
        provenance = stamp("smoke_train", card=torch.cuda.get_device_name(), gpus=trainer.world_size,
                           command=this_command("-m bench.smoke_train"))
        append_record(args.out, {
            **provenance, "model": args.model, "layers": args.layers, "seq_len": args.seq_len,
            "sequence_parallel_size": trainer.strategy.sequence_parallel_size, "chunks": args.chunks,
            "offload": offload, "callbacks": sorted(chosen), "steps": args.steps,
            **speed(callbacks[0], trainer.world_size), "peak_gib": peak, "states_gib": states,
            "peak_minus_states_gib": peak - states, "first_loss": module.losses[0], "last_loss": module.losses[-1],
        })


if __name__ == "__main__":
    main()
