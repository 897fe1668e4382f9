"""bf16 matmul rates of one decoder block's products and of the lm head, forward- and backward-shaped: the GEMM rates
the results page divides a training step's matmul FLOPs by (its "kernels s", bench/report/speed_of_light.py).

One GPU:   python3 -m bench.gemm --tokens 8192,32768,131072 --out bench/results/gemm-h100.jsonl
Several:   torchrun --standalone --nproc_per_node 4 -m bench.gemm --tokens 32768,131072 --out ...
           (every GPU measures at once, as in a training step, where they share the host's power and cooling)
CPU:       python3 -m bench.gemm --device cpu --tiny          (a smoke run of the script itself)

``--tokens`` are local token counts M (the rows each GPU's projections see: S / GPUs for a sequence shared by the
GPUs). The products are those of the geometry's linear layers (Llama-3-8B by default): the q, k, v and o projections,
the MLP's gate, up and down, and the lm head (hidden × vocab) at min(M, ``--head-tokens``) rows, as its logits grow
with the vocabulary (TiledLoss runs it on tiles of about 2K tokens anyway). A layer ``y = x Wᵀ`` (x (M, K), W (N, K),
as ``nn.Linear`` stores it) is timed as its three products: the forward ``x Wᵀ``, the input gradient ``dy W``
(M, N)·(N, K) and the weight gradient ``dyᵀ x`` (N, M)·(M, K), each 2·M·N·K FLOPs: together 6·M·N·K, the 6·N per token
of ``lightning_fpdt.flops``. Each product runs ``--warmup`` times, then ``--repeats`` times ``--iters`` products
between CUDA events (``time.perf_counter`` on the CPU); its time is the median repeat over the iterations. With several
GPUs, each product's time is the median over the ranks.

One record per token count (kind ``gemm``): every product's shape, seconds and TFLOP/s; ``block_tflops``, the block's
seven layers' products together (their FLOPs over their summed time: the rate of 6·N·tokens of a block), and
``head_tflops``, the lm head's three.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from bench.provenance import append_record, card_name, stamp, this_command  # noqa: E402
from lightning_fpdt.flops import ModelGeometry  # noqa: E402
from lightning_fpdt.models.llama import NAMED_CONFIGS, LlamaConfig  # noqa: E402

PRODUCTS = ("forward", "input grad", "weight grad")
"""The three products of a linear layer in a training step."""
HEAD = "lm head"
"""The layer timed at ``--head-tokens`` rows; every other layer is one of the block's."""


def linear_shapes(geometry: ModelGeometry, tokens: int, head_tokens: int) -> list[tuple[str, int, int, int]]:
    """``(layer, M, N, K)`` of the geometry's linear layers ``y = x Wᵀ``, x (M, K), W (N, K): one block's seven, then
    the lm head at ``min(tokens, head_tokens)`` rows."""
    h, q_width = geometry.hidden_size, geometry.attention_width
    kv_width, mlp = geometry.num_kv_heads * geometry.head_dim, geometry.intermediate_size
    return [("q", tokens, q_width, h), ("k", tokens, kv_width, h), ("v", tokens, kv_width, h),
            ("o", tokens, h, q_width), ("gate", tokens, mlp, h), ("up", tokens, mlp, h), ("down", tokens, h, mlp),
            (HEAD, min(tokens, head_tokens), geometry.vocab_size, h)]


def product_operands(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, product: str
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The two operands of one product of ``y = x Wᵀ``: x (M, K), W (N, K), dy (M, N)."""
    if product == "forward":
        return x, weight.t()  # (M, K)·(K, N) -> (M, N)
    if product == "input grad":
        return dy, weight  # (M, N)·(N, K) -> (M, K)
    return dy.t(), x  # (N, M)·(M, K) -> (N, K)


def seconds_per_product(a: torch.Tensor, b: torch.Tensor, *, warmup: int, repeats: int, iters: int) -> float:
    """Median over ``repeats`` of the seconds of one ``a @ b``, each repeat ``iters`` products between CUDA events
    (``perf_counter`` on the CPU), after ``warmup`` products."""
    out = torch.empty(a.shape[0], b.shape[1], device=a.device, dtype=a.dtype)
    cuda = a.device.type == "cuda"
    for _ in range(warmup):
        torch.matmul(a, b, out=out)
    if dist.is_initialized():
        dist.barrier()  # the GPUs run each product together, as in a step
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                torch.matmul(a, b, out=out)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / iters)
        else:
            begin = time.perf_counter()
            for _ in range(iters):
                torch.matmul(a, b, out=out)
            times.append((time.perf_counter() - begin) / iters)
    return statistics.median(times)


def measure(geometry: ModelGeometry, tokens: int, args: argparse.Namespace, device: torch.device
            ) -> list[dict[str, Any]]:
    """Every product of :func:`linear_shapes` at ``tokens`` rows: its shape ``(m, n, k)`` (``(m, k)·(k, n)``), FLOPs
    and this rank's seconds."""
    gen = torch.Generator(device=device).manual_seed(tokens)
    rows = []
    for layer, m, n, k in linear_shapes(geometry, tokens, args.head_tokens):
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
        weight = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen)
        dy = torch.randn(m, n, device=device, dtype=torch.bfloat16, generator=gen)
        for product in PRODUCTS:
            a, b = product_operands(x, weight, dy, product)
            seconds = seconds_per_product(a, b, warmup=args.warmup, repeats=args.repeats, iters=args.iters)
            rows.append(dict(layer=layer, product=product, m=a.shape[0], n=b.shape[1], k=a.shape[1],
                             flops=2 * a.shape[0] * b.shape[1] * a.shape[1], seconds=seconds))
        del x, weight, dy
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def summarize(rows_per_rank: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The record's figures from every rank's rows: each product's seconds the median over the ranks, its TFLOP/s;
    the block's and the lm head's rate (FLOPs over summed seconds), overall and per rank."""
    products = [dict(row, seconds=statistics.median(rank[i]["seconds"] for rank in rows_per_rank))
                for i, row in enumerate(rows_per_rank[0])]
    for row in products:
        row["tflops"] = row["flops"] / row["seconds"] / 1e12

    def rate(rows: list[dict[str, Any]], head: bool) -> float:
        chosen = [row for row in rows if (row["layer"] == HEAD) == head]
        return sum(row["flops"] for row in chosen) / sum(row["seconds"] for row in chosen) / 1e12

    return dict(products=products, block_tflops=rate(products, False), head_tflops=rate(products, True),
                block_tflops_per_rank=[rate(rank, False) for rank in rows_per_rank],
                head_tflops_per_rank=[rate(rank, True) for rank in rows_per_rank])


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default=None,
                        help="comma list of local token counts M (default 8192,32768,131072; 64 with --tiny)")
    parser.add_argument("--head-tokens", type=int, default=None,
                        help="rows of the lm head's products, at most M (default 8192; 64 with --tiny)")
    parser.add_argument("--model", default="llama3-8b", choices=sorted(NAMED_CONFIGS),
                        help="the geometry whose linear layers are timed")
    parser.add_argument("--tiny", action="store_true", help="the tiny geometry and token counts (CPU smoke test)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed products before each product's repeats")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per product (the median is kept)")
    parser.add_argument("--iters", type=int, default=10, help="products per timed repeat")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", default=None, help="JSONL file the records are appended to")
    args = parser.parse_args(argv)
    if args.tiny:
        args.model = "tiny"
    args.tokens = [int(t) for t in (args.tokens or ("64" if args.tiny else "8192,32768,131072")).split(",")]
    args.head_tokens = args.head_tokens or (64 if args.tiny else 8192)
    for name, values in (("--tokens", args.tokens), ("--head-tokens", [args.head_tokens])):
        if any(value < 1 for value in values):
            parser.error(f"{name} ({values}) must be positive")
    return args


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu --tiny for the CPU smoke test")
    if world > 1:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    geometry = ModelGeometry.from_config(LlamaConfig.from_name(args.model))
    command = this_command("-m bench.gemm", sys.argv[1:] if argv is None else argv)
    records = []
    for tokens in args.tokens:
        rows = measure(geometry, tokens, args, device)
        rows_per_rank = [rows]
        if world > 1:
            rows_per_rank = [None] * world
            dist.all_gather_object(rows_per_rank, rows)
        record = dict(**stamp("gemm", card=card_name(device), gpus=world, command=command), model=args.model,
                      dtype="bf16", tokens=tokens, head_tokens=min(tokens, args.head_tokens), warmup=args.warmup,
                      repeats=args.repeats, iters=args.iters, **summarize(rows_per_rank))
        records.append(record)
        if args.out and (world == 1 or dist.get_rank() == 0):
            append_record(args.out, record)
    if world == 1 or dist.get_rank() == 0:
        print(format_table(records))
    if world > 1:
        dist.destroy_process_group()
    return records


def format_table(records: list[dict[str, Any]]) -> str:
    """Each token count's layers with the TFLOP/s of their three products, then the block's and the lm head's."""
    lines = []
    for record in records:
        lines += [f"gemm, {record['model']}, {record['tokens']:,} local tokens (lm head {record['head_tokens']:,}) on "
                  f"{record['gpus']} x {record['card']}, bf16, TFLOP/s",
                  f"{'layer':<8} {'M x N x K':>22} " + " ".join(f"{p:>11}" for p in PRODUCTS)]
        products = record["products"]
        for i in range(0, len(products), len(PRODUCTS)):
            forward = products[i]
            shape = f"{forward['m']} x {forward['n']} x {forward['k']}"
            rates = " ".join(f"{row['tflops']:11.4g}" for row in products[i:i + len(PRODUCTS)])
            lines.append(f"{forward['layer']:<8} {shape:>22} {rates}")
        lines.append(f"block {record['block_tflops']:.4g}, lm head {record['head_tflops']:.4g}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
