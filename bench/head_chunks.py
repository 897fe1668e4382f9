"""Peak GPU memory and step time of one Llama-3-8B-geometry layer with head-group chunking.

    python3 -m bench.head_chunks --seq-len 262144 --head-chunks 1,2,4,8 --out head_chunks.jsonl
    python3 -m bench.head_chunks --seq-len 262144 --budget-gib 70          # + extrapolated maximum length per G
    python3 -m bench.head_chunks --device cpu --tiny --seq-len 64          # CPU smoke run of the script itself

One GPU, so the local length is the whole sequence. The layer is the reference Llama's decoder layer (hidden 4096,
32 query / 8 kv heads of 128, MLP 14336, bf16 weights and activations), its attention the FPDT attention with
``head_chunks`` G (``lightning_fpdt.sequence.head_chunks``), sequence chunks of at most 65,536 tokens (``--chunks``) and
the q/k/v/lse chunks and kept outputs offloaded to pinned host memory (``--offload off`` keeps them on the GPU).
Two cases per G, each forward + backward from inputs already on the GPU:

- ``attention``: the attention block alone, ``self_attn(input_layernorm(x))``: the projections, RoPE, the FPDT
  attention and the output projection, all heads at once (G = 1) or group by group.
- ``layer``: the whole decoder layer (residuals, the MLP tiled as ``TiledMLP`` runs it), checkpointed as
  ``ActivationOffload`` does (block input to host memory, the attention not recomputed); ``--no-checkpoint`` runs it
  without (its activations then stay on the GPU between forward and backward).

"peak" is ``max_memory_allocated`` during the case minus what was allocated before it (weights, input, output
gradient). The step time is the median of ``--repeats`` timed runs after one warm-up (which also pins the host
buffers). ``--budget-gib`` also runs every case at half the length and extrapolates the longest length whose peak
(plus the weights and inputs) fits the budget, linearly in the length: with chunks of a fixed size every term of the
peak is linear in the local length (a model, marked "extrapolated"; confirm near it with ``--seq-len``). The JSON
record (one per run, appended to ``--out``) also holds the planner's prediction of the two attention phases
(``lightning_fpdt.planner``) for calibration.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch

from bench.provenance import append_record, stamp, this_command  # noqa: E402
from lightning_fpdt.callbacks.activation_offload import ActivationOffload  # noqa: E402
from lightning_fpdt.flops import ModelGeometry  # noqa: E402
from lightning_fpdt.integrations import install_head_groups  # noqa: E402
from lightning_fpdt.memory import apply_tiled_mlp  # noqa: E402
from lightning_fpdt.models.llama import LlamaConfig, LlamaDecoderLayer  # noqa: E402
from lightning_fpdt.planner import plan_memory  # noqa: E402
from lightning_fpdt.sequence import FPDTAttention  # noqa: E402
from lightning_fpdt.sequence.planning import MAX_CHUNK_TOKENS  # noqa: E402

GIB = 2**30
GEOMETRIES = {
    # Llama-3-8B: one layer
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=1, num_heads=32,
               num_kv_heads=8, head_dim=128, rope_theta=500000.0),
    # the CPU smoke geometry: 16 query / 8 kv heads, so G = 8 is valid as for the 8B one
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=16, num_kv_heads=8,
                 head_dim=4),
}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=262144, help="tokens of the (local = global) sequence")
    parser.add_argument("--head-chunks", default="1,2,4,8", help="comma list of head groups G")
    parser.add_argument("--chunks", type=int, default=None,
                        help=f"FPDT sequence chunks (default: seq_len / {MAX_CHUNK_TOKENS}, at least 1)")
    parser.add_argument("--offload", choices=("on", "off"), default="on", help="attention chunks in host memory")
    parser.add_argument("--no-checkpoint", action="store_true", help="run the whole layer without ActivationOffload")
    parser.add_argument("--cases", default="attention,layer", help="comma list of attention, layer")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per case after one warm-up")
    parser.add_argument("--budget-gib", type=float, default=None,
                        help="also extrapolate the longest length per G whose peak fits this many GiB")
    parser.add_argument("--backend", default="auto", help="attention block kernel: auto, cudnn, flash, math")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="a tiny geometry (CPU smoke test of this script)")
    parser.add_argument("--out", default=None, help="append the JSON record to this JSONL file")
    args = parser.parse_args(argv)
    args.head_chunks = [int(g) for g in args.head_chunks.split(",")]
    args.cases = [c for c in args.cases.split(",") if c]
    unknown = set(args.cases) - {"attention", "layer"}
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}: use attention, layer")
    if args.chunks is None:
        args.chunks = max(1, -(-args.seq_len // MAX_CHUNK_TOKENS))
    if args.seq_len % args.chunks:
        parser.error(f"--seq-len ({args.seq_len}) must be a multiple of --chunks ({args.chunks})")
    return args


class Meter:
    """Peak memory above the starting allocation, and time, of one run (CUDA); time only on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def run(self, fn: Callable[[], None]) -> tuple[Optional[int], float]:
        gc.collect()
        self.sync()
        base = 0
        if self.cuda:
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        fn()
        self.sync()
        seconds = time.perf_counter() - start
        return (torch.cuda.max_memory_allocated() - base if self.cuda else None), seconds


def build_layer(args: argparse.Namespace, head_chunks: int, *, case: str, device: torch.device, dtype: torch.dtype
                ) -> tuple[LlamaDecoderLayer, FPDTAttention]:
    torch.manual_seed(0)
    config = LlamaConfig(**GEOMETRIES["tiny" if args.tiny else "8b"])
    with torch.device(device):
        layer = LlamaDecoderLayer(config).to(dtype)
    backend = "math" if device.type == "cpu" else args.backend
    attention = FPDTAttention(num_chunks=args.chunks, backend=backend, offload=args.offload == "on",
                              head_chunks=head_chunks)
    if head_chunks > 1:
        install_head_groups(layer.self_attn, attention)
    else:
        layer.self_attn.attention_fn = attention.for_layer()
    if case == "layer":
        apply_tiled_mlp(layer, num_tiles="auto")  # untiled, the 14336-wide MLP would dominate the layer's peak
        if not args.no_checkpoint:
            ActivationOffload(offload=args.offload == "on").fpdt_transform(layer, [layer])
    return layer, attention


def run_case(args: argparse.Namespace, case: str, head_chunks: int, seq_len: int, device: torch.device,
             dtype: torch.dtype) -> dict[str, Any]:
    layer, attention = build_layer(args, head_chunks, case=case, device=device, dtype=dtype)
    hidden = layer.self_attn.o_proj.out_features
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, seq_len, hidden, device=device, dtype=dtype, generator=gen).requires_grad_()
    grad_out = torch.randn(1, seq_len, hidden, device=device, dtype=dtype, generator=gen)
    position_ids = torch.arange(seq_len, device=device).unsqueeze(0)

    def step() -> None:
        if case == "attention":
            y = layer.self_attn(layer.input_layernorm(x), position_ids)
        else:
            y = layer(x, position_ids)
        y.backward(grad_out)
        x.grad = None
        for p in layer.parameters():
            p.grad = None

    meter = Meter(device)
    record: dict[str, Any] = dict(case=case, head_chunks=head_chunks, seq_len=seq_len, status="ok")
    try:
        meter.run(step)  # warm-up: kernels chosen, pinned host buffers allocated
        calls = attention.kernel_calls
        runs = [meter.run(step) for _ in range(args.repeats)]
    except torch.OutOfMemoryError:
        record["status"] = "oom"
        return record
    finally:
        layer = None  # the layer's memory goes before the next case (step holds it through its cell)
    peaks = [p for p, _ in runs if p is not None]
    record.update(
        peak_gib=max(peaks) / GIB if peaks else None,
        step_s=statistics.median(s for _, s in runs),
        attention_calls_per_step=(attention.kernel_calls - calls) // args.repeats,
        host_gib=attention.stashes.host_bytes / GIB,
    )
    return record


def planner_prediction(args: argparse.Namespace, head_chunks: int, seq_len: int) -> dict[str, float]:
    """The planner's two attention phases for this layer (``lightning_fpdt.planner``), in GiB."""
    config = LlamaConfig(**GEOMETRIES["tiny" if args.tiny else "8b"])
    geometry = ModelGeometry.from_config(config)
    plan = plan_memory(geometry=geometry, seq_len=seq_len, num_gpus=1, chunks=args.chunks, offload=args.offload == "on",
                       offload_dq=False, activation_offload=not args.no_checkpoint, tiled_mlp=True, tiled_loss=True,
                       precision="bf16-true", head_chunks=head_chunks)
    return {phase: plan.phase_bytes[phase] / GIB for phase in ("attention forward", "attention backward")}


def allocated_before_gib(args: argparse.Namespace, dtype: torch.dtype, seq_len: int) -> float:
    """What is allocated before a case and so not in its "peak": the layer's weights, the input and the output
    gradient (``2·S·hidden``)."""
    g = GEOMETRIES["tiny" if args.tiny else "8b"]
    h, attn, kv = g["hidden_size"], g["num_heads"] * g["head_dim"], g["num_kv_heads"] * g["head_dim"]
    weights = 2 * h * attn + 2 * h * kv + 3 * h * g["intermediate_size"] + 2 * h
    return (weights + 2 * seq_len * h) * torch.empty((), dtype=dtype).element_size() / GIB


def extrapolate(short: dict, long: dict, budget_gib: float, before: Callable[[int], float]) -> Optional[int]:
    """Longest length whose peak plus what was allocated before (``before(seq_len)``) fits ``budget_gib``, on the
    line through the two measured lengths (both terms are linear in the length)."""
    if short.get("peak_gib") is None or long.get("peak_gib") is None:
        return None
    totals = [(r["seq_len"], r["peak_gib"] + before(r["seq_len"])) for r in (short, long)]
    (s0, t0), (s1, t1) = totals
    slope = (t1 - t0) / (s1 - s0)  # GiB per token
    if slope <= 0:
        return None
    return int(s1 + (budget_gib - t1) / slope)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu --tiny for the CPU smoke test")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = []
    for head_chunks in args.head_chunks:
        for case in args.cases:
            row = run_case(args, case, head_chunks, args.seq_len, device, dtype)
            row["planner_gib"] = planner_prediction(args, head_chunks, args.seq_len)
            if args.budget_gib is not None and row["status"] == "ok":
                half = run_case(args, case, head_chunks, args.seq_len // 2, device, dtype)
                row["max_seq_len_extrapolated"] = extrapolate(
                    half, row, args.budget_gib, lambda n: allocated_before_gib(args, dtype, n))
            rows.append(row)
            print(f"  {case:<9} G={head_chunks}: {row}", file=sys.stderr, flush=True)
    command = this_command("-m bench.head_chunks", sys.argv[1:] if argv is None else argv)
    record = dict(
        **stamp("head_chunks", card=card, gpus=1, command=command),
        geometry="tiny" if args.tiny else "llama3-8b (1 layer)", seq_len=args.seq_len,
        chunks=args.chunks, offload=args.offload, checkpoint=not args.no_checkpoint, dtype=str(dtype),
        budget_gib=args.budget_gib, rows=rows,
    )
    print(format_table(record))
    if args.out:
        append_record(args.out, record)
    return record


def format_table(record: dict[str, Any]) -> str:
    lines = [f"head-group chunking, {record['geometry']}, S = {record['seq_len']:,} tokens on one {record['card']}, "
             f"chunks {record['chunks']}, offload {record['offload']}, {record['dtype']}",
             f"{'case':<10} {'G':>3} {'peak GiB':>9} {'vs G=1':>7} {'step s':>8} {'vs G=1':>7} "
             f"{'planner fwd/bwd GiB':>20} {'max S (extrap.)':>16}"]
    base = {r["case"]: r for r in record["rows"] if r["head_chunks"] == 1 and r["status"] == "ok"}
    for r in record["rows"]:
        if r["status"] != "ok":
            lines.append(f"{r['case']:<10} {r['head_chunks']:>3} {'OOM':>9}")
            continue
        ref = base.get(r["case"])
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        peak_ratio = (f"{r['peak_gib'] / ref['peak_gib']:.2f}" if ref and r["peak_gib"] and ref["peak_gib"] else "")
        time_ratio = f"{r['step_s'] / ref['step_s']:.2f}" if ref else ""
        planned = r["planner_gib"]
        planner = f"{planned['attention forward']:.2f}/{planned['attention backward']:.2f}"
        longest = r.get("max_seq_len_extrapolated")
        lines.append(f"{r['case']:<10} {r['head_chunks']:>3} {peak:>9} {peak_ratio:>7} {r['step_s']:>8.3f} "
                     f"{time_ratio:>7} {planner:>20} {'' if longest is None else f'{longest:,}':>16}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
