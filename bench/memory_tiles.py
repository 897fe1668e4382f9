"""Peak GPU memory of the tiled loss and the tiled MLP against their untiled forms, Llama-3-8B layer geometry.

    python3 -m bench.memory_tiles --out memory_tiles.jsonl   # 512K-token loss, 256K-token MLP, bf16, one GPU
    python3 -m bench.memory_tiles --loss-tokens 262144 --mlp-tokens 131072 --small-loss-tokens 8192

Every case runs forward + backward on one GPU, from inputs already on it: the loss from final hidden states
``(N, 4096)`` and a ``(128256, 4096)`` lm_head weight, the MLP (gate/up 14336 wide, down) from its input
``(1, N, 4096)`` and an output gradient. "peak" is ``max_memory_allocated`` during the case minus what was allocated
before it (the inputs, the weights, the output gradient); "grads" is the part of it any backward leaves behind (the
input gradient and the weight gradients), so ``peak - grads`` is the working memory of the computation itself.
The untiled loss is not run at the long length (its fp32 logits alone exceed any GPU): it is run at a short length
to give the ratio, and its size at the long length is given from the fp32 logits alone. A case that does not fit
prints OOM. Times are of one run each, for orientation (not a throughput benchmark). With ``--out``, one JSON record
per case is appended to that file.
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from bench.provenance import append_record, stamp, this_command  # noqa: E402
from lightning_fpdt.memory import apply_tiled_mlp, auto_loss_tiles, auto_mlp_tiles, tiled_cross_entropy  # noqa: E402
from lightning_fpdt.models.llama import LlamaConfig, LlamaMLP  # noqa: E402

GIB = 2**30
DEVICE = "cuda"


@dataclass
class Row:
    case: str
    tokens: int
    tiles: str
    peak_gib: Optional[float]
    grads_gib: Optional[float]
    ms: Optional[float]
    note: str = ""


def tiles_arg(value: str) -> Union[str, int]:
    return value if value == "auto" else int(value)


def measure(run: Callable[[], None]) -> tuple[Optional[int], Optional[float]]:
    """``(peak bytes above what was allocated before, milliseconds)``, or ``(None, None)`` when it ran out of memory."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        return None, None
    return torch.cuda.max_memory_allocated() - base, start.elapsed_time(end)


def free() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def loss_case(tokens: int, *, tiled: bool, args: argparse.Namespace) -> Row:
    device, dtype = torch.device(DEVICE), torch.bfloat16
    hidden = torch.randn(tokens, args.hidden, device=device, dtype=dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, device=device, dtype=dtype) * 0.02).requires_grad_()
    targets = torch.randint(0, args.vocab, (tokens,), device=device)
    targets[: tokens // 10] = -100  # some ignored tokens, as with masked prompts

    def run() -> None:
        if tiled:
            loss, _ = tiled_cross_entropy(hidden, weight, targets, num_tiles=args.loss_tiles)
        else:  # what a model does without TiledLoss: full logits, upcast to fp32 for the cross-entropy
            loss = F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=-100)
        loss.backward()

    try:
        peak, ms = measure(run)
    finally:
        hidden.grad = weight.grad = None
    grads = (hidden.numel() + weight.numel()) * dtype.itemsize  # hidden.grad + weight.grad
    tiles = "-"
    if tiled:
        tiles = str(args.loss_tiles) if args.loss_tiles != "auto" else f"auto={auto_loss_tiles(tokens, args.vocab)}"
    return Row(f"loss {'tiled' if tiled else 'untiled'}", tokens, tiles, peak and peak / GIB,
               grads / GIB if peak else None, ms)


def mlp_case(tokens: int, *, tiled: bool, args: argparse.Namespace) -> Row:
    device, dtype = torch.device(DEVICE), torch.bfloat16
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_layers=1, num_heads=32, num_kv_heads=8)
    with torch.device(device):
        mlp = LlamaMLP(config).to(dtype)
    if tiled:
        apply_tiled_mlp(mlp, num_tiles=args.mlp_tiles)
    x = torch.randn(1, tokens, args.hidden, device=device, dtype=dtype).requires_grad_()
    grad_out = torch.randn_like(x)

    def run() -> None:
        mlp(x).backward(grad_out)

    try:
        peak, ms = measure(run)
    finally:
        x.grad = None
        mlp.zero_grad(set_to_none=True)
    grads = (x.numel() + sum(p.numel() for p in mlp.parameters())) * dtype.itemsize
    tiles = "-"
    if tiled:
        tiles = str(args.mlp_tiles) if args.mlp_tiles != "auto" else (
            f"auto={auto_mlp_tiles(tokens, args.intermediate, dtype.itemsize)}"
        )
    return Row(f"mlp {'tiled' if tiled else 'untiled'}", tokens, tiles, peak and peak / GIB,
               grads / GIB if peak else None, ms)


def fmt(value: Optional[float], spec: str = "8.2f") -> str:
    return "OOM".rjust(int(spec.split(".")[0])) if value is None else format(value, spec)


def write_records(rows: list[Row], args: argparse.Namespace) -> None:
    """One record per case: the row, its work (peak minus grads), the geometry and where it ran."""
    provenance = stamp("memory_tiles", card=torch.cuda.get_device_name(), gpus=1,
                       command=this_command("-m bench.memory_tiles"))
    for row in rows:
        work = None if row.peak_gib is None else row.peak_gib - row.grads_gib
        append_record(args.out, {**provenance, "hidden": args.hidden, "intermediate": args.intermediate,
                                 "vocab": args.vocab, "dtype": "bf16", **asdict(row), "work_gib": work})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loss-tokens", type=int, default=524288, help="local tokens of the long tiled loss")
    parser.add_argument("--small-loss-tokens", type=int, default=16384,
                        help="tokens where the tiled and the untiled loss both run")
    parser.add_argument("--mlp-tokens", type=int, default=262144, help="tokens of the MLP cases")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--loss-tiles", type=tiles_arg, default="auto")
    parser.add_argument("--mlp-tiles", type=tiles_arg, default="auto")
    parser.add_argument("--skip-untiled-mlp", action="store_true", help="do not run the untiled MLP")
    parser.add_argument("--out", default=None, help="append one JSON record per case to this JSONL file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/memory_tiles.py measures GPU memory: it needs a CUDA device")

    torch.manual_seed(0)
    warm = torch.randn(256, 256, device=DEVICE, dtype=torch.bfloat16)
    (warm @ warm).sum().item()  # cuBLAS handle and workspace exist before the first measurement
    rows = []
    for tokens, tiled in ((args.small_loss_tokens, False), (args.small_loss_tokens, True), (args.loss_tokens, True)):
        rows.append(loss_case(tokens, tiled=tiled, args=args))
        free()  # the case's tensors died with its frame
    logits_gib = args.loss_tokens * args.vocab * 4 / GIB
    rows.append(Row("loss untiled (not run)", args.loss_tokens, "-", None, None, None,
                    f">= {logits_gib:.1f} GiB: the fp32 logits alone"))
    for tiled in (False, True):
        if tiled or not args.skip_untiled_mlp:
            rows.append(mlp_case(args.mlp_tokens, tiled=tiled, args=args))
            free()

    print()
    print(f"card: {torch.cuda.get_device_name()}  (torch {torch.__version__}); hidden {args.hidden}, intermediate "
          f"{args.intermediate}, vocab {args.vocab}, bf16; forward + backward")
    print(f"{'case':<24} {'tokens':>8} {'tiles':>10} {'peak GiB':>9} {'grads GiB':>9} {'work GiB':>9} {'ms':>9}  note")
    for r in rows:
        if r.peak_gib is None and r.note:
            print(f"{r.case:<24} {r.tokens:>8} {r.tiles:>10} {'-':>9} {'-':>9} {'-':>9} {'-':>9}  {r.note}")
            continue
        work = None if r.peak_gib is None else r.peak_gib - r.grads_gib
        print(f"{r.case:<24} {r.tokens:>8} {r.tiles:>10} {fmt(r.peak_gib, '9.2f')} {fmt(r.grads_gib, '9.2f')} "
              f"{fmt(work, '9.2f')} {fmt(r.ms, '9.1f')}  {r.note}")
    by_case = {(r.case, r.tokens): r.peak_gib for r in rows}

    def ratio(tiled: tuple, untiled: tuple) -> str:
        a, b = by_case.get(tiled), by_case.get(untiled)
        return "n/a" if a is None or b is None else f"{a / b:.3f} (1/{b / a:.1f})"

    small, mlp = args.small_loss_tokens, args.mlp_tokens
    print(f"loss peak tiled / untiled at {small} tokens: {ratio(('loss tiled', small), ('loss untiled', small))}")
    print(f"mlp peak tiled / untiled at {mlp} tokens: {ratio(('mlp tiled', mlp), ('mlp untiled', mlp))}")
    if args.out:
        write_records(rows, args)


if __name__ == "__main__":
    main()
