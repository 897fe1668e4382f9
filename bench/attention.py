"""The FPDT attention op alone, forward + backward: memory, TFLOP/s, offload cost, all-to-all share.

One GPU:   python3 -m bench.attention --seq-lens 131072,262144,524288,1048576 --chunk-tokens 32768 --offload on
Several:   torchrun --standalone --nproc_per_node 4 -m bench.attention --seq-lens 262144,524288 --chunk-tokens 65536
Ring:      torchrun --standalone --nproc_per_node 4 -m bench.attention --seq-lens 262144 --ring-size 2 --offload both
           (the Ulysses x ring hybrid of sequence/ring.py: U = GPUs / ring size Ulysses ranks, chunks 1; run
           --ring-size 1 on the same machine for the Ulysses baseline)

Geometry defaults to Llama-3-8B attention (32 heads, 8 kv heads, head dim 128), bf16, causal. ``--seq-lens`` are
global lengths; with P GPUs each holds S/P tokens. FLOPs: causal forward = 2·B·H·S²·D, forward + backward = 3.5 ×
forward. Prints one table row per case and appends one JSON record per case to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from bench.provenance import append_record, stamp, this_command  # noqa: E402
from bench.timing import time_step  # noqa: E402
from lightning_fpdt.offload.host_stash import StashFactory  # noqa: E402
from lightning_fpdt.sequence import all_to_all as a2a  # noqa: E402
from lightning_fpdt.sequence import fpdt_attention, new_sequence_groups  # noqa: E402


class A2ATimer:
    """Wall time of the all-to-alls (synchronised around each start, which then runs the collective alone: the
    overlap of head pieces is given up while timing), to report their share of a step."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._original = a2a.Exchange.start

    def __enter__(self):
        original, timer = self._original, self

        def timed(exchange, *args, **kwargs):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = original(exchange, *args, **kwargs)
            torch.cuda.synchronize()
            timer.seconds += time.perf_counter() - start
            return out

        a2a.Exchange.start = timed
        return self

    def __exit__(self, *exc):
        a2a.Exchange.start = self._original


def run_case(seq_len: int, num_chunks: int, offload: bool, args, rank: int, world: int) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    local = seq_len // world
    gen = torch.Generator(device=device).manual_seed(rank)
    shape_q, shape_kv = (1, local, args.heads, args.head_dim), (1, local, args.kv_heads, args.head_dim)
    q = torch.randn(shape_q, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    k = torch.randn(shape_kv, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    v = torch.randn(shape_kv, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    dout = torch.randn(shape_q, device=device, dtype=torch.bfloat16, generator=gen)
    stashes = StashFactory(offload=offload, offload_dq=offload and not args.keep_dq_on_gpu)
    group = args.groups or (dist.group.WORLD if world > 1 else None)  # (ulysses, ring) pair with --ring-size > 1

    def step():
        out = fpdt_attention(q, k, v, num_chunks=num_chunks, backend=args.backend, stashes=stashes, group=group)
        out.backward(dout)
        q.grad = k.grad = v.grad = None

    times, base, peak = time_step(step, repeat=args.repeat, world=world)
    # what the op must hold whatever it does: out, dq, dk, dv (q, k, v, dout are in `base`)
    io_bytes = 2 * q.numel() * 2 + 2 * k.numel() * 2
    a2a_seconds = 0.0
    if world > 1:
        with A2ATimer() as timer:
            step()
            torch.cuda.synchronize()
        a2a_seconds = timer.seconds
    median = sorted(times)[len(times) // 2]
    flops = 3.5 * 2 * args.heads * seq_len * seq_len * args.head_dim  # global, causal, fwd + bwd
    return dict(
        **_stamp(world), ring=args.ring_size, seq_len=seq_len, chunks=num_chunks, offload=offload,
        heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, backend=args.backend,
        step_s=median, tflops_per_gpu=flops / median / world / 1e12,
        peak_extra_gib=(peak - io_bytes) / 2**30, inputs_gib=base / 2**30,
        a2a_share=a2a_seconds / median, host_gib=stashes.host_bytes / 2**30,
    )


def _stamp(world: int) -> dict:
    return stamp("attention", card=torch.cuda.get_device_name(), gpus=world, command=this_command("-m bench.attention"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-lens", default="131072,262144")
    parser.add_argument("--chunk-tokens", type=int, default=32768, help="global tokens per chunk (u = S / this)")
    parser.add_argument("--chunks", type=int, default=0, help="fixed chunk count instead of --chunk-tokens")
    parser.add_argument("--offload", choices=["on", "off", "both"], default="on")
    parser.add_argument("--keep-dq-on-gpu", action="store_true", help="partial dQ sums stay on the GPU")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--backend", default="cudnn")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ring-size", type=int, default=1,
                        help="ring ranks R of the Ulysses x ring hybrid (GPUs = U x R; chunks are 1 with R > 1)")
    parser.add_argument("--out", default="attention.jsonl", help="JSONL file the records are appended to")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    args.groups = new_sequence_groups(args.ring_size) if world > 1 and args.ring_size > 1 else None
    rows = []
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        for offload in {"on": [True], "off": [False], "both": [False, True]}[args.offload]:
            num_chunks = 1 if args.ring_size > 1 else args.chunks or max(1, seq_len // args.chunk_tokens)
            try:
                row = run_case(seq_len, num_chunks, offload, args, rank, world)
            except torch.OutOfMemoryError:
                row = dict(**_stamp(world), ring=args.ring_size, seq_len=seq_len, chunks=num_chunks, offload=offload,
                           heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, oom=True)
            torch.cuda.empty_cache()
            rows.append(row)
            if rank == 0:
                append_record(args.out, row)
    if rank == 0:
        print(f"{'card':24s} {'gpus':>4s} {'ring':>4s} {'S':>8s} {'u':>3s} {'offl':>5s} {'step s':>8s} "
              f"{'TFLOP/s/gpu':>11s} {'extra GiB':>9s} {'in GiB':>7s} {'a2a %':>6s} {'host GiB':>8s}")
        for r in rows:
            if r.get("oom"):
                print(f"{'':24s} {r['gpus']:4d} {'':>4s} {r['seq_len']:8d} {r['chunks']:3d} "
                      f"{str(r['offload']):>5s}  OOM")
                continue
            print(f"{r['card'][:24]:24s} {r['gpus']:4d} {r['ring']:4d} {r['seq_len']:8d} {r['chunks']:3d} "
                  f"{str(r['offload']):>5s} "
                  f"{r['step_s']:8.3f} {r['tflops_per_gpu']:11.1f} {r['peak_extra_gib']:9.2f} {r['inputs_gib']:7.2f} "
                  f"{100 * r['a2a_share']:6.1f} {r['host_gib']:8.1f}")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
