"""Packed documents in the FPDT attention op: time of forward + backward with per-document masking against the same
sequence as one document, and the block kernel calls each makes.

One GPU:   python3 -m bench.packed --seq-lens 32768,131072 --doc-lens 2048,8192 --chunk-tokens 32768
Several:   torchrun --standalone --nproc_per_node 4 -m bench.packed --seq-lens 262144 --doc-lens 8192
           --chunk-tokens 65536
Per-segment calls instead of one varlen flash call per block: add --no-varlen.

Geometry defaults to Llama-3-8B attention (32 heads, 8 kv heads, head dim 128), bf16. Documents have random lengths,
uniform in [1, 2·doc_len) (mean doc_len), the same on every rank. "useful" TFLOP/s counts only the attention the
documents need: causal forward 2·B·H·Σ L_d²·D, forward + backward 3.5 × forward (bench/attention.py's
convention).
Prints one row per case and appends one JSON record per case to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from bench.provenance import append_record, stamp, this_command  # noqa: E402
from lightning_fpdt.sequence import fpdt as fpdt_module  # noqa: E402
from lightning_fpdt.sequence import fpdt_attention  # noqa: E402
from lightning_fpdt.sequence.documents import DocumentBoundaries  # noqa: E402


def random_documents(seq_len: int, doc_len: int, seed: int) -> DocumentBoundaries:
    gen = torch.Generator().manual_seed(seed)
    starts, position = [0], 0
    while True:
        position += int(torch.randint(1, 2 * doc_len, (1,), generator=gen))
        if position >= seq_len:
            return DocumentBoundaries(((*starts,),), seq_len)
        starts.append(position)


def counting(kernel):
    """Wrap a kernel's forward/backward to count calls."""
    kernel.calls = 0
    for name in ("forward", "backward"):
        method = getattr(kernel, name)

        def counted(*args, __method=method, **kwargs):
            kernel.calls += 1
            return __method(*args, **kwargs)

        setattr(kernel, name, counted)
    return kernel


def run_case(seq_len: int, doc_len: int, args, rank: int, world: int) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    local = seq_len // world
    num_chunks = max(1, seq_len // args.chunk_tokens)
    gen = torch.Generator(device=device).manual_seed(rank)
    shape_q, shape_kv = (1, local, args.heads, args.head_dim), (1, local, args.kv_heads, args.head_dim)
    q, k, v = (torch.randn(s, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
               for s in (shape_q, shape_kv, shape_kv))
    dout = torch.randn(shape_q, device=device, dtype=torch.bfloat16, generator=gen)
    group = dist.group.WORLD if world > 1 else None
    documents = random_documents(seq_len, doc_len, seed=0) if doc_len else None
    kernels, varlens = [], []
    original, original_varlen = fpdt_module.make_kernel, fpdt_module.varlen_kernel_for
    fpdt_module.make_kernel = lambda *a: kernels.append(counting(original(*a))) or kernels[-1]
    fpdt_module.varlen_kernel_for = lambda *a: varlens.append(
        None if original_varlen(*a) is None else counting(original_varlen(*a))) or varlens[-1]
    times = []
    try:
        for _ in range(args.repeats + 1):  # the first is a warm-up
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = fpdt_attention(q, k, v, group=group, num_chunks=num_chunks, backend=args.backend,
                                 documents=documents)
            torch.autograd.grad(out, (q, k, v), dout)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    finally:
        fpdt_module.make_kernel, fpdt_module.varlen_kernel_for = original, original_varlen
    step = sorted(times[1:])[len(times[1:]) // 2]
    lengths = ([b - a for a, b in zip(documents.starts[0], documents.starts[0][1:] + (seq_len,))]
               if documents else [seq_len])
    flops = 3.5 * 2 * args.heads * sum(n * n / 2 for n in lengths) * args.head_dim  # useful causal flops
    provenance = stamp("packed", card=torch.cuda.get_device_name(), gpus=world,
                       command=this_command("-m bench.packed"))
    return dict(**provenance, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                seq_len=seq_len, chunks=num_chunks, doc_len=doc_len, documents=len(lengths), backend=args.backend,
                varlen=not args.no_varlen, step_s=step,
                kernel_calls=kernels[-1].calls + (varlens[-1].calls if varlens and varlens[-1] else 0),
                useful_tflops_per_gpu=flops / step / world / 1e12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", default="32768,131072")
    parser.add_argument("--doc-lens", default="0,2048,8192", help="mean document lengths; 0 = one document")
    parser.add_argument("--chunk-tokens", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-varlen", action="store_true", help="one kernel call per document segment")
    parser.add_argument("--out", default="packed.jsonl", help="JSONL file the records are appended to")
    args = parser.parse_args()
    if args.no_varlen:
        fpdt_module.varlen_kernel_for = lambda *a: None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    rank = dist.get_rank() if world > 1 else 0
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        for doc_len in (int(d) for d in args.doc_lens.split(",")):
            record = run_case(seq_len, doc_len, args, rank, world)
            if rank == 0:
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()),
                      flush=True)
                append_record(args.out, record)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
