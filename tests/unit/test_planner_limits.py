"""bench.planner_limits: the longest full-depth length the planner fits on a machine, with and without partial
residency (the table of docs/planner.md)."""

from __future__ import annotations

from bench.planner_limits import longest


def test_partial_residency_takes_a_host_further():
    """Llama-3.2-1B geometry on one 40 GiB GPU with 64 GiB of host memory, lengths in steps of 256K up to 1M: every
    block input in RAM stops at 768K; keeping only some (the others regenerated) reaches the 1M tried."""
    common = dict(step=2**18, limit=2**20, gpus=1, gpu_gib=40, host_gib=64, disk_gib=None, disk_gbps=1.5)
    in_ram, options = longest("llama3-1b", keep_inputs="all", **common)
    assert in_ram == 3 * 2**18 and options.startswith("kept all")
    resident, options = longest("llama3-1b", keep_inputs="auto", **common)
    assert resident == 2**20 and options.startswith("kept 8")
