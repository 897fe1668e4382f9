"""The planner's longest sequence and its step time on several hosts, one sequence-parallel group over all their
GPUs, the layout (``ring_size="auto"``) chosen by the step-time estimate: ``python3 -m bench.planner_hosts``.

A prediction of ``lightning_fpdt.planner.plan_memory``, every memory option "auto" (with and without
``cpu_offload_params``, the longer kept), not a measurement: docs/multi_node.md prints its
table. Lengths tried: powers of two and 1.5 times them (:func:`longest`).
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any, Optional

from lightning_fpdt.flops import ModelGeometry
from lightning_fpdt.planner import plan_memory
from lightning_fpdt.planner.components import MemoryPlan, plannable_gpu_bytes
from lightning_fpdt.planner.layout_summary import heads_a_rank, layout_name
from lightning_fpdt.planner.search import step_estimate

QWEN2_5_7B = ModelGeometry(num_layers=28, hidden_size=3584, num_heads=28, num_kv_heads=4, head_dim=128,
                           intermediate_size=18944, vocab_size=152064)
"""Qwen2.5-7B's sizes (its Hugging Face config; the q/k/v biases, 0.01% of the parameters, are not counted)."""
MODELS: dict[str, Any] = {"llama3-8b": "llama3-8b", "qwen2.5-7b": QWEN2_5_7B}
MIB = 2**20


def lengths(smallest: int, largest: int) -> list[int]:
    """Powers of two from ``smallest`` and 1.5 times each, up to ``largest``."""
    found, power = [], smallest
    while power <= largest:
        found += [power] + ([power * 3 // 2] if power * 3 // 2 <= largest else [])
        power *= 2
    return found


def plan_at(model: Any, seq_len: int, *, hosts: int, gpus_per_node: int, gpu_gib: float, host_gib: float,
            inter_host_gbps: Optional[float]) -> Optional[MemoryPlan]:
    """The fastest plan that fits with the states on the GPU, else on the host, every option "auto", or ``None``."""
    for offload_params in (False, True):
        plan = plan_memory(
            geometry=model, seq_len=seq_len, num_gpus=hosts * gpus_per_node, gpus_per_node=gpus_per_node,
            sequence_parallel_size=hosts * gpus_per_node, ring_size="auto", activation_offload=True, tiled_mlp=True,
            tiled_loss=True, cpu_offload_params=offload_params,
            gpu_memory_gib=plannable_gpu_bytes(int(gpu_gib * 2**30)) / 2**30, host_memory_gib=host_gib,
            chunks="auto", offload="auto", offload_dq="auto", head_chunks="auto", recompute_attention="auto",
            reload_input="auto", prefetch="auto", keep_inputs="auto", checkpoint_blocks="auto",
            inter_host_gbps=inter_host_gbps,
        )
        if plan.fits:
            return plan
    return None


def seconds(plan: MemoryPlan) -> float:
    """The plan's step-time estimate, one batch."""
    return sum(part for _, part in step_estimate(plan))


def longest(model: Any, *, smallest: int, largest: int, **kwargs: Any) -> tuple[int, Optional[MemoryPlan]]:
    """The longest of :func:`lengths` that fits, and its plan (``0, None``: not even the smallest): up the powers of
    two while they fit, then 1.5 times the last that fits (fitting is monotone in the length; a length that does not
    fit is the slow one to plan, every layout's search running out, so at most two are tried)."""
    found: tuple[int, Optional[MemoryPlan]] = (0, None)
    for length in lengths(smallest, largest)[::2]:
        plan = plan_at(model, length, **kwargs)
        if plan is None:
            break
        found = (length, plan)
    if found[1] is not None and found[0] * 3 // 2 <= largest:
        plan = plan_at(model, found[0] * 3 // 2, **kwargs)
        if plan is not None:
            found = (found[0] * 3 // 2, plan)
    return found


def row(name: str, hosts: int, args: argparse.Namespace) -> str:
    """One line of the table: the model, the hosts, the longest length, the layout, the step time, the command."""
    length, plan = longest(MODELS[name], smallest=args.smallest_mib * MIB, largest=args.largest_mib * MIB,
                           hosts=hosts, gpus_per_node=args.gpus_per_node, gpu_gib=args.gpu_memory_gib,
                           host_gib=args.host_memory_gib, inter_host_gbps=args.inter_host_gbps)
    command = "python3 -m bench.planner_hosts " + shlex.join(
        ["--models", name, "--hosts", str(hosts)] + (["--inter-host-gbps", f"{args.inter_host_gbps:g}"]
                                                      if args.inter_host_gbps is not None else []))
    if plan is None:
        return f"| {name} | {hosts} × {args.gpus_per_node} | nothing fits | | | `{command}` |"
    o, g = plan.options, plan.geometry
    ulysses = o.sequence_parallel_size // o.ring_size
    heads = heads_a_rank(g.num_heads // o.head_chunks, g.num_kv_heads // o.head_chunks, ulysses)
    layout = (f"{layout_name(o.sequence_parallel_size, o.ring_size)}, {heads} query head{'' if heads == '1' else 's'} "
              f"a rank" + (f" in each of {o.head_chunks} head groups" if o.head_chunks > 1 else "")
              + (", states on the host" if o.cpu_offload_params else ""))
    return (f"| {name} | {hosts} × {args.gpus_per_node} | {length / MIB:g}M | {layout} | {seconds(plan):,.0f} s | "
            f"`{command}` |")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python3 -m bench.planner_hosts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0,
                        help="memory of one GPU (planned less the CUDA context and fragmentation, as the strategy "
                             "does)")
    parser.add_argument("--host-memory-gib", type=float, default=2048.0, help="memory of one host (a DGX H100: 2 TiB)")
    parser.add_argument("--inter-host-gbps", type=float, default=None,
                        help="GB/s one GPU sends to other hosts (default: the planner's)")
    parser.add_argument("--smallest-mib", type=int, default=1, help="the shortest length tried, Mi tokens")
    parser.add_argument("--largest-mib", type=int, default=256, help="the longest length tried, Mi tokens")
    args = parser.parse_args(argv)
    print("| model | hosts × GPUs | longest S (predicted) | layout auto picks | step (predicted) | command |\n"
          "|---|---|---|---|---|---|")
    for name in args.models:
        for hosts in args.hosts:
            print(row(name, hosts, args), flush=True)


if __name__ == "__main__":
    main()
