"""The elementwise work of a transformer block, eager against compiled: RMSNorm, RoPE and SwiGLU, forward + backward.

One GPU:  python3 -m bench.elementwise --tokens 8192,16384,32768
CPU smoke: python3 -m bench.elementwise --device cpu --tiny

Each op on one rank's tokens of the Llama-3-8B geometry (hidden 4096, 32 query and 8 kv heads of 128, intermediate
14336) in bf16: the package's own (``lightning_fpdt.fused.ops``) with ``FUSED_OPS`` off (token tiles, fp32 inside)
and on (its fused kernels), the plain form Hugging Face writes (one kernel per PyTorch op), and that form through
``torch.compile``. The floor is the bytes each op must move (its inputs read once, its
outputs written once, forward and backward) at the card's measured copy bandwidth (a device-to-device copy, bytes
read plus written). Prints one row per op and token count; appends one record per row (kind ``elementwise``) to
``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Callable

import torch

from bench.provenance import append_record, stamp  # noqa: E402
from lightning_fpdt.fused import ops  # noqa: E402

GEOMETRY = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336)
TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128)


def time_ms(fn: Callable[[], None], device: torch.device, repeat: int) -> float:
    """Median milliseconds of ``fn`` after two warm-up calls (CUDA events on a GPU, the host clock elsewhere)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            import time

            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device-to-device copy, read plus written."""
    n = 2**28 if device.type == "cuda" else 2**22
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * n / (time_ms(lambda: dst.copy_(src), device, 10) / 1e3)


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm as Hugging Face writes it (fp32 inside)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def plain_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, theta: float = 500000.0) -> tuple:
    """RoPE as Hugging Face writes it (rotate-half), the angles from the positions in fp32."""
    head_dim = q.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=q.device, dtype=torch.float32) / head_dim))
    angles = positions[..., None].float() * inv_freq
    angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]
    cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    return rotate(q), rotate(k)


def plain_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def cases(tokens: int, g: dict, device: torch.device, dtype: torch.dtype) -> dict[str, tuple]:
    """``name -> (package's function, plain function, inputs, bytes moved forward + backward)``."""
    def randn(*shape, grad=True):
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(grad)

    x, w = randn(1, tokens, g["hidden"]), randn(g["hidden"])
    q, k = randn(1, tokens, g["heads"], g["head_dim"]), randn(1, tokens, g["kv_heads"], g["head_dim"])
    positions = torch.arange(tokens, device=device)[None]
    gate, up = randn(1, tokens, g["intermediate"]), randn(1, tokens, g["intermediate"])
    e = torch.finfo(dtype).bits // 8
    return {
        # forward reads x, writes y; backward reads x, dy, writes dx (and the weight's gradient, small)
        "rmsnorm": (lambda x, w: ops.rms_norm(x, w, 1e-5), plain_rms_norm, (x, w), 5 * x.numel() * e),
        # q and k each read and written forward, their gradients read and written backward
        "rope": (lambda q, k: (ops.rotary(q, positions, 500000.0), ops.rotary(k, positions, 500000.0)),
                 lambda q, k: plain_rope(q, k, positions), (q, k), 4 * (q.numel() + k.numel()) * e),
        # forward reads gate and up, writes their product; backward reads gate, up, dy, writes dgate, dup
        "swiglu": (ops.swiglu, plain_swiglu, (gate, up), 8 * gate.numel() * e),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="8192,16384,32768", help="local token counts (comma-separated)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny geometry (a smoke run on the CPU)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", default="elementwise.jsonl")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    geometry = TINY if args.tiny else GEOMETRY
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + written)")
    print(f"{'op':<8} {'tokens':>7} {'package ms':>11} {'fused ms':>9} {'plain ms':>9} {'compiled ms':>12} "
          f"{'floor ms':>9}")
    for tokens in [int(t) for t in args.tokens.split(",")]:
        for name, (package, plain, inputs, moved) in cases(tokens, geometry, device, dtype).items():
            backend = "inductor" if device.type == "cuda" else "aot_eager"
            # the package's op both ways (FUSED_OPS off: the tiled eager forms; on: its fused kernels)
            variants = {"package_eager": (package, False), "package_fused": (package, True), "plain": (plain, False),
                        "compiled": (torch.compile(plain, backend=backend, dynamic=False), False)}
            results = {}
            for label, (run, fused) in variants.items():
                if run is None:
                    continue

                def step(run=run):
                    outputs = run(*inputs)
                    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
                    torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
                ops.FUSED_OPS.enabled = fused
                try:
                    results[label] = time_ms(step, device, args.repeat)
                finally:
                    ops.FUSED_OPS.enabled = "auto"
            floor = moved / bandwidth * 1e3
            cells = [f"{results[label]:>{width}.3f}" if label in results else f"{'-':>{width}}"
                     for label, width in (("package_eager", 11), ("package_fused", 9), ("plain", 9),
                                          ("compiled", 12))]
            print(f"{name:<8} {tokens:>7} {' '.join(cells)} {floor:>9.3f}")
            record = stamp("elementwise", card=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           gpus=1, command=" ".join(sys.argv))
            record.update(op=name, tokens=tokens, geometry=geometry, dtype=str(dtype), floor_ms=floor,
                          copy_bandwidth=bandwidth, **{f"{label}_ms": value for label, value in results.items()})
            append_record(args.out, record)


if __name__ == "__main__":
    main()
