"""The planner's disk tier: block inputs beyond the host's memory counted in a disk column, fitted against the disk's
free space, chosen by the search only where host memory does not suffice, at the cost of the disk time the compute
does not cover (planner/features/disk_tier.py)."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_fpdt.offload.disk import STAGING_PIECE_BYTES
from lightning_fpdt.planner import format_plan, main, plan_memory, step_seconds
from lightning_fpdt.planner.features.disk_tier import DiskTier
from lightning_fpdt.planner.search import Run

GIB = 2**30
AUTO = dict(chunks="auto", offload="auto", offload_dq="auto", head_chunks="auto", recompute_attention="auto",
            reload_input="auto", prefetch="auto")
# Llama-3.2-3B geometry at 524,288 tokens on one H200 (the GPU the plan fills: 139 GiB less context and fragmentation)
RUN = dict(geometry="llama3-3b", seq_len=1 << 19, num_gpus=1, gpu_memory_gib=131, activation_offload=True,
           tiled_mlp=True, tiled_loss=True, **AUTO)


def test_disk_only_where_host_memory_does_not_suffice():
    """With a host that holds every block input the disk is not used (the same plan as without one); with a host
    that does not, the plan puts the least number of block inputs on disk that fits: one fewer does not fit."""
    roomy = plan_memory(**RUN, host_memory_gib=118, disk_memory_gib=60)
    assert roomy.fits and roomy.options.disk_inputs == 0 and roomy.disk_bytes_per_node == 0
    assert roomy.options == plan_memory(**RUN, host_memory_gib=118).options
    assert not plan_memory(**RUN, host_memory_gib=60).fits
    tight = plan_memory(**RUN, host_memory_gib=60, disk_memory_gib=60)
    k = tight.options.disk_inputs
    assert tight.fits and 0 < k < tight.geometry.num_layers
    assert tight.host_resident_bytes_per_node <= 60 * GIB and tight.disk_bytes_per_node <= 60 * GIB
    fewer = dataclasses.replace(tight.options, disk_inputs=k - 1)
    run = Run(tight.geometry, tight.model, tight.seq_len, 1, 1, 1, tight.gpu_memory_bytes, 60 * GIB,
              disk_memory_bytes=60 * GIB, disk_bytes_per_second=1.5e9)
    assert not run.plan(fewer).fits_host


def test_disk_column_moves_host_bytes():
    """The block inputs on disk leave the pinned column for the disk column (k·A), and the writer's and the reader's
    two staging pieces of 256 MiB each are pinned (not copies of the 3 GiB input); the GPU peak does not change."""
    tight = plan_memory(**RUN, host_memory_gib=60, disk_memory_gib=60)
    k, L = tight.options.disk_inputs, tight.geometry.num_layers
    A = tight.local_tokens * tight.geometry.hidden_size * 2  # one bf16 block input
    assert tight.component("checkpointed block inputs").host_bytes == (L - k) * A
    assert tight.component("block inputs on disk").disk_bytes == k * A == tight.disk_bytes_per_gpu
    staging = 4 * STAGING_PIECE_BYTES
    assert A == 3 * GIB and tight.component("disk staging buffers").host_bytes == staging
    in_ram = Run(tight.geometry, tight.model, tight.seq_len, 1, 1, 1, tight.gpu_memory_bytes, None).plan(
        dataclasses.replace(tight.options, disk_inputs=0))
    assert in_ram.peak_gpu_bytes == tight.peak_gpu_bytes
    assert in_ram.host_bytes_per_node - tight.host_bytes_per_node == k * A - staging


def test_disk_space_limits_the_plan():
    """Block inputs on disk count against its free space: too small a disk is not used (nothing fits, and the
    message says what disk would), and an explicit count over the disk binds on the disk."""
    # an 80 GB GPU: the block inputs cannot move to the GPU instead (kept in part, as partial residency would)
    small = plan_memory(**{**RUN, "gpu_memory_gib": 80}, host_memory_gib=30, disk_memory_gib=5)
    assert not small.fits and small.binding_limit == "host memory"
    assert "block inputs per GPU on disk" in small.recommendation and "the disk tier has 5.00 GiB free" in \
        small.recommendation
    explicit = plan_memory(**{**RUN, **dict(recompute_attention=True)}, host_memory_gib=1000, disk_memory_gib=5,
                           disk_inputs=4)
    assert not explicit.fits_disk and explicit.binding_limit == "disk space"
    assert explicit.largest_component.name == "block inputs on disk"
    with pytest.raises(ValueError, match="needs activation_offload=True and a disk"):
        plan_memory(**RUN, host_memory_gib=60, disk_inputs=2)


def test_disk_cost_is_what_the_compute_does_not_cover():
    """The disk's time counts where the blocks' compute does not hide it: with an infinitely fast disk nothing; with
    a slow one the writes and reads beyond the forward and the attention backward of a block, the first read of the
    backward always; reload_input and no prefetch wait for their reads."""
    tight = plan_memory(**RUN, host_memory_gib=60, disk_memory_gib=60)
    o = tight.options
    run = Run(tight.geometry, tight.model, tight.seq_len, 1, 1, 1, tight.gpu_memory_bytes, 60 * GIB,
              disk_memory_bytes=60 * GIB, disk_bytes_per_second=1.5e9)
    s = run.sizes(o)
    feature = DiskTier()
    assert feature.extra_seconds(s.with_options(disk_inputs=0)) == 0.0
    io = s.A / 1.5e9
    seconds = feature.extra_seconds(s)
    assert io <= seconds <= io * (2 * o.disk_inputs + 1)
    assert feature.extra_seconds(dataclasses.replace(s, disk_rate=1e18)) == pytest.approx(0.0, abs=1e-6)
    assert feature.extra_seconds(s.with_options(prefetch=0)) >= o.disk_inputs * io
    assert feature.extra_seconds(s.with_options(reload_input=True)) == pytest.approx(seconds + o.disk_inputs * io)
    assert step_seconds(s) > step_seconds(s.with_options(disk_inputs=0))


def test_format_plan_and_command_print_the_disk(capsys):
    """`lightning-fpdt plan --disk-gib` plans with the disk tier: a disk column, the disk per host against its free
    space, and offload_dir among the arguments; without --disk-gib the table is as before, and a plan nothing fits
    names the disk tier."""
    args = ["--model", "llama3-3b", "--seq-len", str(1 << 19), "--gpu-memory-gib", "139", "--host-memory-gib", "60",
            "--callbacks", "all"]
    assert main(args + ["--disk-gib", "60", "--disk-gbps", "2"]) == 0
    out = capsys.readouterr().out
    assert "pageable      disk" in out and "block inputs on disk" in out and "disk_inputs=" in out
    assert "disk per host (offload_dir)" in out and "of 60.0 GiB" in out and "offload_dir=" in out
    # every block input kept (no partial residency): without a disk nothing fits
    assert main(args + ["--keep-inputs", "all"]) == 1
    out = capsys.readouterr().out
    assert "disk" not in out
    nothing = plan_memory(**{**RUN, "gpu_memory_gib": 80}, host_memory_gib=30)  # the GPU cannot take the inputs
    assert "--disk-gib N" in nothing.recommendation  # nothing fits: the disk named
    assert "disk per host" in format_plan(plan_memory(**RUN, host_memory_gib=118, disk_memory_gib=60))


def test_a_refusal_names_the_least_disk_that_fits():
    """Too small a disk: the refusal names the least disk any configuration fits with (3 inputs beside partial
    residency, 6 GiB), not the fastest plan's with an unbounded disk (every input kept, all 16 on disk, 32 GiB)."""
    kw = dict(geometry="llama3-1b", seq_len=2**19, num_gpus=1, activation_offload=True, tiled_mlp=True, tiled_loss=True,
              gpu_memory_gib=40, host_memory_gib=12, chunks="auto", offload="auto", offload_dq="auto",
              head_chunks="auto", recompute_attention="auto", reload_input="auto", prefetch="auto",
              keep_inputs="auto")
    refused = plan_memory(**kw, disk_memory_gib=4)
    assert not refused.fits
    assert "it fits with 3 block inputs per GPU on disk, 6.00 GiB per host" in refused.recommendation
    assert plan_memory(**kw, disk_memory_gib=6).fits and not plan_memory(**kw, disk_memory_gib=5).fits
    assert plan_memory(**kw, disk_memory_gib=1000).disk_bytes_per_node == 32 * 2**30


def test_the_plan_states_the_time_each_feature_costs():
    """The printed plan breaks its step estimate down by feature: partial residency names the block forwards it
    regenerates, and the parts add up to the estimate the search ranks by."""
    from lightning_fpdt.planner.phases import plan_sizes
    from lightning_fpdt.planner.search import step_estimate

    plan = plan_memory(geometry="llama3-3b", seq_len=2**20, num_gpus=1, activation_offload=True, tiled_mlp=True,
                       tiled_loss=True, gpu_memory_gib=123, host_memory_gib=116, chunks=16, offload=True,
                       offload_dq=False, recompute_attention=True, keep_inputs=14)
    estimate = dict(step_estimate(plan))
    assert "partial residency: 14 block forwards regenerated in the backward (their attention too)" in estimate
    assert sum(estimate.values()) == pytest.approx(step_seconds(plan_sizes(plan)))
    assert "partial residency: 14 block forwards regenerated" in format_plan(plan)
