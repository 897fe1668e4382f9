"""The planner's longest full-depth sequence for a model on a machine, with and without the features that take the
block inputs past host RAM (partial residency, the disk tier): ``python3 -m bench.planner_limits``.

A prediction of ``lightning_fpdt.planner.plan_memory``, every memory option "auto" (with and without
``cpu_offload_params``, the longer kept), not a measurement: docs/planner.md prints its table beside the measured
full-depth records of docs/benchmarks.md."""

from __future__ import annotations

import argparse
from typing import Any, Optional

from lightning_fpdt.flops import ModelGeometry
from lightning_fpdt.planner import plan_memory
from lightning_fpdt.planner.components import plannable_gpu_bytes

LLAMA_3_1_70B = ModelGeometry(num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, head_dim=128,
                              intermediate_size=28672, vocab_size=128256)
"""Llama-3.1-70B's sizes (its Hugging Face config)."""
MODELS: dict[str, Any] = {"llama3-8b": "llama3-8b", "llama3.1-70b": LLAMA_3_1_70B}
FEATURES = {
    "inputs in RAM": dict(keep_inputs="all", disk=False),
    "+ partial residency": dict(keep_inputs="auto", disk=False),
    "+ residency and disk": dict(keep_inputs="auto", disk=True),
}
MIB = 2**20


def fits(model: Any, seq_len: int, *, gpus: int, gpu_gib: float, host_gib: float, disk_gib: Optional[float],
         disk_gbps: float, keep_inputs: Any) -> Optional[str]:
    """The options of the fastest plan that fits (with or without host-resident states), or ``None``."""
    for offload_params in (False, True):
        plan = plan_memory(
            geometry=model, seq_len=seq_len, num_gpus=gpus, gpus_per_node=gpus, activation_offload=True,
            tiled_mlp=True, tiled_loss=True, cpu_offload_params=offload_params,
            gpu_memory_gib=plannable_gpu_bytes(int(gpu_gib * 2**30)) / 2**30, host_memory_gib=host_gib,
            chunks="auto", offload="auto", offload_dq="auto", head_chunks="auto", recompute_attention="auto",
            reload_input="auto", prefetch="auto", keep_inputs=keep_inputs,
            disk_memory_gib=disk_gib, disk_gbps=disk_gbps, disk_inputs="auto" if disk_gib else 0,
        )
        if plan.fits:
            o = plan.options
            return (f"kept {o.keep_inputs}, disk {o.disk_inputs}, chunks {o.chunks}, G {o.head_chunks}"
                    + (", states on host" if offload_params else ""))
    return None


def longest(model: Any, *, step: int, limit: int, **kwargs: Any) -> tuple[int, Optional[str]]:
    """The longest multiple of ``step`` up to ``limit`` that fits (bisection: fitting is monotone in the length)."""
    low, high, found = 0, limit // step, None
    while low < high:
        middle = (low + high + 1) // 2
        options = fits(model, middle * step, **kwargs)
        if options is not None:
            low, found = middle, options
        else:
            high = middle - 1
    return low * step, found


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python3 -m bench.planner_limits", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=8, help="GPUs of one host")
    parser.add_argument("--gpu-memory-gib", type=float, default=79.0, help="usable memory of one GPU")
    parser.add_argument("--host-memory-gib", type=float, nargs="+", default=[1024.0, 2048.0])
    parser.add_argument("--disk-gib", type=float, default=3500.0, help="free space of the host's NVMe")
    parser.add_argument("--disk-gbps", type=float, default=6.0, help="the NVMe's read and write rate, GB/s")
    parser.add_argument("--step-mib", type=int, default=512, help="lengths tried: multiples of this many Mi tokens")
    parser.add_argument("--limit-mib", type=int, default=32768)
    args = parser.parse_args(argv)
    print("| model | host RAM | block inputs | longest S | plan |\n|---|---|---|---|---|")
    for name, model in MODELS.items():
        for host in args.host_memory_gib:
            for label, feature in FEATURES.items():
                length, options = longest(
                    model, step=args.step_mib * 1024, limit=args.limit_mib * 1024, gpus=args.gpus,
                    gpu_gib=args.gpu_memory_gib, host_gib=host, disk_gib=args.disk_gib if feature["disk"] else None,
                    disk_gbps=args.disk_gbps, keep_inputs=feature["keep_inputs"])
                print(f"| {name} | {host / 1024:g} TiB | {label} | {length / MIB:g}M | {options or 'nothing fits'} |",
                      flush=True)


if __name__ == "__main__":
    main()
