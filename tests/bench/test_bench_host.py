"""The host readings of the benchmarks (bench/host_readings.py) and how bench.peers aggregates them over ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bench import host_readings
from bench.peers import records
from lightning_fpdt.offload import host_memory
from lightning_fpdt.offload.host_memory import HostMemoryError

MIB = 2**20


def test_span_peak_sees_memory_freed_before_its_end():
    """A span's peak counts a buffer allocated and freed inside it, where the kernel's high-water mark can be reset."""
    peaks = host_readings.ResidentPeaks()
    peaks.start()
    if peaks.reading != "peak":
        pytest.skip("this kernel refuses to reset the peak resident memory (/proc/self/clear_refs)")
    before = host_memory.resident_bytes()
    buffer = torch.rand(64 * MIB // 4)  # 64 MiB, every page written
    del buffer
    peak = peaks.stop()
    assert peak >= before + 60 * MIB  # a few MiB of slack: other pages may have been returned meanwhile
    assert peaks.lifetime_peak >= peak
    assert peaks.stop() is None  # no span open


def test_span_falls_back_to_its_boundaries_where_the_reset_is_refused(monkeypatch):
    """Without the reset a span is the larger reading at its two boundaries, and the reading says "sampled"."""
    readings = iter([100 * MIB, 300 * MIB, 300 * MIB, 200 * MIB])
    monkeypatch.setattr(host_memory, "reset_peak_resident", lambda: False)
    monkeypatch.setattr(host_memory, "resident_bytes", lambda: next(readings))
    peaks = host_readings.ResidentPeaks()
    peaks.start()
    assert peaks.split() == 300 * MIB  # 100 at its start, 300 at its end
    assert peaks.stop() == 300 * MIB  # 300 at its start, 200 at its end
    assert peaks.reading == "sampled"


def test_pinned_bytes_are_the_strategys_and_pytorchs():
    """fpdt: the strategy's own count plus PyTorch's pinned blocks (none on CPU); unknown without the count; the
    other systems pin through PyTorch only."""
    own = int(torch.randint(1, 2**40, ()).item())
    counted = host_readings.pinned_bytes(SimpleNamespace(pinned_host_bytes=own), fpdt=True)
    torch_blocks = host_readings.caching_allocator_pinned_bytes()
    assert torch_blocks == 0 or torch.cuda.is_available()
    assert counted == {"pinned_host_bytes": own + torch_blocks, "pinned_host_bytes_strategy": own,
                       "pinned_host_bytes_caching_allocator": torch_blocks}
    pinned = host_readings.pinned_bytes(SimpleNamespace(), fpdt=True)
    assert pinned["pinned_host_bytes"] is None and pinned["pinned_host_bytes_strategy"] is None
    assert host_readings.pinned_bytes(None, fpdt=False)["pinned_host_bytes"] == torch_blocks


def test_plan_fields_are_the_plans_per_gpu_figures(monkeypatch):
    """The record carries the accepted plan's GPU peak, pinned and resident host bytes and disk bytes per GPU, its
    options, its estimated step and the rates of that estimate, and the most bytes the disk tier's files held (none
    without a disk tier)."""
    gpu, pinned, resident, disk, peak_disk = (int(v) for v in torch.randint(1, 2**40, (5,)))
    plan = SimpleNamespace(peak_gpu_bytes=gpu, host_bytes_per_gpu=pinned, host_resident_bytes_per_gpu=resident,
                           disk_bytes_per_gpu=disk, options=SimpleNamespace(describe=lambda: "sp=4 dp=1 chunks=8"),
                           rates=SimpleNamespace(source="calibrated on a GPU"))
    monkeypatch.setattr(host_readings, "estimated_step_seconds", lambda p: 12.5 if p is plan else None)
    planned = {"planned_peak_gpu_bytes": gpu, "planned_pinned_host_bytes": pinned,
               "planned_resident_host_bytes": resident, "planned_disk_bytes": disk,
               "plan_options": "sp=4 dp=1 chunks=8",
               "estimated_step_s": 12.5, "estimate_rates": "calibrated on a GPU"}
    assert host_readings.plan_fields(SimpleNamespace(memory_plan=plan)) == {**planned, "peak_disk_bytes": None}
    disk_tier = SimpleNamespace(disk=SimpleNamespace(peak_bytes_on_disk=peak_disk))
    tiered = SimpleNamespace(memory_plan=plan, memory=disk_tier)
    assert host_readings.plan_fields(tiered) == {**planned, "peak_disk_bytes": peak_disk}
    assert host_readings.plan_fields(SimpleNamespace()) == dict.fromkeys(host_readings.PLAN_FIELDS)


def _rank(step_rss, pinned=0, reading="peak", lifetime=None):
    return records.RankFigures(peak_gpu=None, peak_reserved=None, lifetime_rss=lifetime or step_rss,
                               step_rss=step_rss, rss_reading=reading, pinned=pinned, pinned_caching_allocator=0)


def test_host_figures_take_the_largest_process_and_sum_each_host():
    """Per process the largest rank; per host the sum of its ranks (ranks 0-1 on host 0, 2-3 on host 1), the
    largest host; one rank without a pinned count makes the run's unknown; one sampled rank makes it "sampled"."""
    rss = [int(v) for v in torch.randint(1, 2**36, (4,))]
    figures = [_rank(r, pinned=i * MIB) for i, r in enumerate(rss)]
    host = records.host_figures(figures, world_size=4, gpus_per_node=2)
    assert host["peak_host_rss_bytes"] == max(rss) and host["peak_host_rss_bytes_per_rank"] == rss
    assert host["peak_host_rss_bytes_per_node"] == max(rss[0] + rss[1], rss[2] + rss[3])
    assert host["pinned_host_bytes"] == 3 * MIB and host["host_rss_reading"] == "peak"
    assert host["host_peak_rss_bytes"] == sum(rss)  # the older field: summed over the ranks
    figures[1] = _rank(rss[1], pinned=None, reading="sampled")
    host = records.host_figures(figures, world_size=4, gpus_per_node=2)
    assert host["pinned_host_bytes"] is None and host["host_rss_reading"] == "sampled"
    only_mine = records.host_figures(figures[:1], world_size=4, gpus_per_node=2)  # a rank failed: no collective
    assert only_mine["peak_host_rss_bytes"] == rss[0] and only_mine["peak_host_rss_bytes_per_node"] is None


def test_timed_steps_leave_out_the_warm_up_and_the_profiled_step():
    """The host peak is taken over the steps the step time is taken over."""
    assert records.timed([9, 1, 2, 3], profile_step=2) == [1, 3]
    assert records.timed([9, 1], profile_step=1) == [1]
    assert records.timed([9]) == [9]


def test_host_memory_errors_count_as_the_hosts_limit():
    """The library's HostMemoryError and the planner's refusal, old and new wording, are the host's limit."""
    assert records.out_of_memory(HostMemoryError("host memory ran short: a stash needs 2.00 GiB more")) == "host"
    assert records.out_of_memory(ValueError("this run needs 912.4 GiB of host memory per host, 800.1 GiB of it "
                                            "pinned, and the host has 500.0 GiB available")) == "host"
    assert records.out_of_memory(ValueError("this run needs 900 GiB of pinned host memory per host")) == "host"
    assert records.out_of_memory(ValueError("another rank refused the run: its host lacks the pinned memory (see its "
                                            "log)")) == "host"
    assert records.out_of_memory(ValueError("host_memory_gib must be positive")) is None


def _with_host(record: dict, *, rss: int, pinned: int, plan: tuple = None) -> dict:
    record.update(peak_host_rss_bytes=rss, pinned_host_bytes=pinned)
    if plan:
        gpu, resident, planned_pinned = plan
        record.update(planned_peak_gpu_bytes=gpu, planned_resident_host_bytes=resident,
                      planned_pinned_host_bytes=planned_pinned, plan_options="sp=4 dp=1 chunks=8 offload=on")
    return record


def test_page_shows_host_peaks_and_plan_ratios_beside_gpu_peaks():
    """Wherever a run's GPU peak is shown its host peak and pinned bytes are too (– for records without them); a run
    carrying its plan gets plan / measured for GPU (its peak less the ballast), host and pinned; so does a traced
    step, whose own page plan is left out where an option stayed unresolved."""
    from bench.report import page
    from tests.bench.test_bench_report import GIB, H100, run_record

    rss, pinned, resident = (int(v) * GIB // 10 for v in torch.randint(10, 1000, (3,)))
    new = _with_host(run_record("fpdt", gpus=4, layers=2, seq_len=262_144, peak_gib=60.0, ballast_gib=20.0),
                     rss=rss, pinned=pinned, plan=(int(44 * GIB), resident, pinned))
    old = run_record("ring", gpus=4, layers=2, seq_len=262_144, peak_gib=50.0)
    trace = {"kind": "memory_trace", "card": H100, "gpus": 1, "model": "hf", "geometry": "llama3-3b", "layers": 28,
             "seq_len": 65_536, "chunks": 2, "offload": True, "offload_dq": False, "head_chunks": None,
             "recompute_attention": False, "cpu_offload_params": False, "peak_gpu_bytes_per_step": [int(40 * GIB)],
             "peak_host_rss_bytes": rss, "pinned_host_bytes": pinned, "planned_peak_gpu_bytes": int(42 * GIB),
             "planned_resident_host_bytes": resident,
             "command": "python3 -m bench.memory_trace train --model hf --geometry llama3-3b", "commit": "abc1234"}
    doc = page.render_markdown([new, old, trace])
    lines = doc.splitlines()
    host = f"| {rss / GIB:.1f} | {pinned / GIB:.1f} |"

    def rows(*cells: str) -> list[str]:
        return [line for line in lines if all(cell in line for cell in cells)]

    assert len(rows("| fpdt |", "| 60.0 |", host)) == 3  # the throughput, host-check and every-run tables
    assert len(rows("| ring |", "| 50.0 | – | – |")) == 3
    plan_row = rows("| fpdt |", "sp=4 dp=1 chunks=8 offload=on")
    assert len(plan_row) == 1
    assert (f"| 40.0 | 44.0 | 1.100 | {rss / GIB:.1f} | {resident / GIB:.1f} | {resident / rss:.3f} | "
            f"{pinned / GIB:.1f} | {pinned / GIB:.1f} | 1.000 |") in plan_row[0]
    traced = rows("| llama3-3b (28 layers, hf) |")
    assert len(traced) == 1 and "head_chunks unknown" in traced[0]
    assert (f"| 40.00 | – | – | – | {rss / GIB:.2f} | {pinned / GIB:.2f} | {42 / 40:.3f} | {resident / rss:.3f} |"
            in traced[0])
