"""``deepspeed-fpdt``: DeepSpeed's FPDT attention (``deepspeed.sequence.fpdt_layer``, the FPDT paper's own code) alone,
forward + backward, measured as bench/attention.py measures this project's op.

One GPU:   python3 -m bench.peers.deepspeed_fpdt --seq-lens 262144 --chunk-tokens 65536 --offload on
Several:   torchrun --standalone --nproc_per_node 4 -m bench.peers.deepspeed_fpdt --seq-lens 524288 \\
               --chunk-tokens 65536 --offload on

DeepSpeed's op is Megatron-shaped: it takes the layer's normed input ``(S/P, B, hidden)`` and the fused QKV weight
and bias, and does the QKV projection, the all-to-alls, the rotary embedding and the chunked attention inside one
autograd function (``_FPDTGPUOffloadingAttentionImpl_`` with ``--offload on``: q, k, v, out, lse and the input chunks
in pinned host memory; ``_FPDTGPUAttentionImpl_`` with ``--offload off``). Its ``flash_attn`` kernels are PyTorch's
FlashAttention-2 (bench/peers/flash_shim.py) unless a real flash-attn is installed. The case run here: Llama-3-8B
attention geometry by default, bf16, causal, batch 1, no bias (zeros: the op requires one), rotary embedding of the
global positions; chunks of ``--chunk-tokens`` global tokens (DeepSpeed's ``chunk_size``), ``S / chunk`` of them on
every GPU.

Figures, as in bench/attention.py: TFLOP/s per GPU with the attention's causal FLOPs only (3.5 × 2·H·S²·D), although
the timed step also runs the QKV projection's forward and backward (``6·S·hidden·(H + 2·Hkv)·D`` more FLOPs, about 2%
at 256K tokens of Llama-3-8B); "extra GiB": the peak GPU memory of one forward + backward minus its inputs (in
``base``) and what it must return (out, the input's gradient, the weight's gradient). Records are ``kind:
attention`` with ``system: deepspeed-fpdt``.

What is not built: a training system with this attention. DeepSpeed's FPDT expects Megatron-DeepSpeed's layer around
it (fused QKV weight and bias, ``[s, b, h]`` activations, the token order of ``FPDT_InputConstruct``, which places
chunks ``r, P + r, 2P + r, ...`` of the sequence on GPU ``r``, with the labels and positions permuted alike), and its
chunks and offload live inside the autograd function, so a checkpointed Hugging Face layer would run (and offload)
the attention twice. Swapping it into the Hugging Face Llama under ZeRO-3 would need the q, k, v weights gathered as
external parameters and that token order through the model and loss.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist

from bench.peers.flash_shim import install as install_flash_attn
from bench.provenance import append_record, stamp, this_command
from bench.timing import time_step

SYSTEM = "deepspeed-fpdt"


def rotary_tables(seq_len: int, head_dim: int, *, theta: float, device: torch.device,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of the global positions, each ``(S, 1, 1, D)`` as DeepSpeed's op takes them (it permutes them
    to ``(1, S, 1, D)``); the half-split rotation of Llama (DeepSpeed's ``_rotate_half``)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # (S, D/2)
    angles = torch.cat([angles, angles], dim=-1)[:, None, None]  # (S, 1, 1, D)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def attention_flops(seq_len: int, heads: int, head_dim: int) -> float:
    """Global causal forward + backward FLOPs of the attention alone: 3.5 × 2·H·S²·D (bench/attention.py's)."""
    return 3.5 * 2 * heads * seq_len * seq_len * head_dim


def run_case(seq_len: int, chunk_tokens: int, offload: bool, args: argparse.Namespace, world: int) -> dict[str, Any]:
    """One forward + backward warm-up, then ``args.repeat`` timed ones: the record of the case."""
    from deepspeed.sequence.fpdt_layer import _FPDTGPUAttentionImpl_, _FPDTGPUOffloadingAttentionImpl_

    device = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    local, hidden = seq_len // world, args.heads * args.head_dim
    num_chunks = max(1, seq_len // chunk_tokens)  # DeepSpeed: local tokens × P / chunk_size
    qkv_rows = (args.heads + 2 * args.kv_heads) * args.head_dim
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    x = torch.randn(local, 1, hidden, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    weight = (torch.randn(qkv_rows, hidden, device=device, dtype=torch.bfloat16, generator=gen)
              / hidden**0.5).requires_grad_()
    bias = torch.zeros(qkv_rows, device=device, dtype=torch.bfloat16)
    rotary = rotary_tables(seq_len, args.head_dim, theta=args.rope_theta, device=device, dtype=torch.bfloat16)
    impl = _FPDTGPUOffloadingAttentionImpl_ if offload and num_chunks > 1 else _FPDTGPUAttentionImpl_

    def step() -> torch.Tensor:
        # scatter the heads (dim 2) and gather the sequence (dim 1) of (B, S/P, H, D): FPDT_Attention's defaults
        out = impl.apply(x, None, None, rotary, group, 2, 0, hidden, args.heads * args.head_dim, args.head_dim,
                         args.kv_heads * args.head_dim, weight, bias, 0.0, num_chunks, offload)
        out.backward(dout)
        x.grad = weight.grad = None
        return out

    dout = torch.randn(1, local, args.heads, args.head_dim, device=device, dtype=torch.bfloat16, generator=gen)
    times, base, peak = time_step(step, repeat=args.repeat, world=world)
    io_bytes = (dout.numel() + x.numel() + weight.numel()) * 2  # out, the input's and the weight's gradients
    median = sorted(times)[len(times) // 2]
    offloaded = impl is _FPDTGPUOffloadingAttentionImpl_
    host_bytes = _host_bytes(seq_len, world, num_chunks, hidden, args) if offloaded else 0
    return dict(
        **_stamp(world), system=SYSTEM, kernels=args.kernels, ring=1, seq_len=seq_len, chunks=num_chunks,
        chunk_tokens=chunk_tokens, offload=offloaded, heads=args.heads,
        kv_heads=args.kv_heads, head_dim=args.head_dim, backend="flash", step_s=median,
        tflops_per_gpu=attention_flops(seq_len, args.heads, args.head_dim) / median / world / 1e12,
        peak_extra_gib=(peak - io_bytes) / 2**30, inputs_gib=base / 2**30, a2a_share=None, host_gib=host_bytes / 2**30,
    )


def _host_bytes(seq_len: int, world: int, num_chunks: int, hidden: int, args: argparse.Namespace) -> int:
    """Pinned host bytes of the offloaded op, from its code: every chunk's input (S/P·hidden), q, out (S·H/P·D each),
    k, v (S·Hkv/P·D each) in bf16 and lse (S·H/P) in fp32; in backward also dq's fp32 sums of every chunk but the
    first (DeepSpeed's ``SequenceChunk`` copies)."""
    tokens = seq_len // world  # per GPU: its S/P input tokens, or S tokens of H/P heads after the all-to-all
    heads, kv_heads = args.heads * tokens, args.kv_heads * tokens
    forward = 2 * (tokens * hidden + 2 * heads * args.head_dim + 2 * kv_heads * args.head_dim) + 4 * heads
    dq_sums = 4 * heads * args.head_dim * (num_chunks - 1) // num_chunks
    return forward + dq_sums


def _stamp(world: int) -> dict[str, Any]:
    return stamp("attention", card=torch.cuda.get_device_name(), gpus=world,
                 command=this_command("-m bench.peers.deepspeed_fpdt"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 -m bench.peers.deepspeed_fpdt",
                                     description="DeepSpeed's FPDT attention op alone: TFLOP/s and peak GPU memory.")
    parser.add_argument("--seq-lens", default="262144", help="global lengths, comma-separated")
    parser.add_argument("--chunk-tokens", type=int, default=65536, help="global tokens per chunk (DeepSpeed's "
                        "chunk_size; S / this chunks on every GPU)")
    parser.add_argument("--offload", choices=["on", "off", "both"], default="on")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rope-theta", type=float, default=500000.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default="attention.jsonl", help="JSONL file the records are appended to")
    return parser


def check(args: argparse.Namespace, world: int) -> None:
    """``ValueError`` for a case DeepSpeed's op cannot run (it asserts instead)."""
    if args.heads % world or not (args.kv_heads % world == 0 or world % args.kv_heads == 0):
        raise ValueError(f"--heads ({args.heads}) must be a multiple of the GPU count ({world}), and --kv-heads "
                         f"({args.kv_heads}) a multiple or a divisor of it")
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        chunks = max(1, seq_len // args.chunk_tokens)
        if seq_len % (world * chunks):
            raise ValueError(f"--seq-lens {seq_len} must be a multiple of GPUs ({world}) × chunks ({chunks}) = "
                             f"{world * chunks}: DeepSpeed splits each GPU's S/P tokens into equal chunks")


def main(argv: Any = None) -> None:
    args = build_parser().parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    check(args, world)
    args.kernels = install_flash_attn()  # before DeepSpeed's FPDT module reads flash_attn
    import deepspeed

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    deepspeed.init_distributed(dist_backend="nccl")
    rows = []
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        for offload in {"on": [True], "off": [False], "both": [False, True]}[args.offload]:
            try:
                row = run_case(seq_len, args.chunk_tokens, offload, args, world)
            except torch.OutOfMemoryError:
                row = dict(**_stamp(world), system=SYSTEM, kernels=args.kernels, ring=1, seq_len=seq_len,
                           chunks=max(1, seq_len // args.chunk_tokens), offload=offload, heads=args.heads,
                           kv_heads=args.kv_heads, head_dim=args.head_dim, oom=True)
            torch.cuda.empty_cache()
            rows.append(row)
            if rank == 0:
                append_record(args.out, row)
    if rank == 0:
        print(f"{'system':15s} {'card':24s} {'gpus':>4s} {'S':>8s} {'u':>3s} {'offl':>5s} {'step s':>8s} "
              f"{'TFLOP/s/gpu':>11s} {'extra GiB':>9s} {'host GiB':>8s}")
        for r in rows:
            if r.get("oom"):
                print(f"{SYSTEM:15s} {'':24s} {r['gpus']:4d} {r['seq_len']:8d} {r['chunks']:3d} "
                      f"{str(r['offload']):>5s}  OOM")
                continue
            print(f"{SYSTEM:15s} {r['card'][:24]:24s} {r['gpus']:4d} {r['seq_len']:8d} {r['chunks']:3d} "
                  f"{str(r['offload']):>5s} {r['step_s']:8.3f} {r['tflops_per_gpu']:11.1f} "
                  f"{r['peak_extra_gib']:9.2f} {r['host_gib']:8.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
