"""The full-depth ballast of bench.peers (``--ballast full``): what a run of a few layers holds for the layers it does
not run is what the planner's full depth keeps beyond the layers run, on the GPU, in host memory and on disk."""

from __future__ import annotations

import os
import re

import pytest
import torch

from bench.peers import cli
from bench.peers.full_depth import FullDepth, FullDepthRefused, HeldBallast, full_depth_ballast, plan_fpdt
from lightning_fpdt.flops import ModelGeometry
from lightning_fpdt.models.llama import LlamaConfig

GIB = 2**30
LLAMA_3B = ModelGeometry.from_config(LlamaConfig.from_name("llama3-3b"))


def _args(*extra: str):
    return cli.parse_args(["--system", "fpdt-hf", "--model", "llama3-3b", "--layers", "2", "--ballast", "full",
                           *extra])


def test_fpdt_ballast_is_the_full_plan_beyond_the_layers_run():
    """Every input kept, attention recomputed: the host ballast is the 26 block inputs not run, the GPU ballast the
    difference of the two plans' peaks, and the run's options are the full plan's."""
    seq_len = 131072
    args = _args("--seq-len", str(seq_len), "--chunks", "2", "--offload", "on", "--recompute-attention")
    ballast = full_depth_ballast(args, LLAMA_3B, world_size=1, gpus_per_node=1, gpu_memory_bytes=79 * GIB,
                                 available_host=120 * GIB, disk_free=None)
    full, run = ballast.plan, ballast.run_plan
    assert full.geometry.num_layers == 28 and run.geometry.num_layers == 2
    assert ballast.pinned_bytes == 26 * seq_len * LLAMA_3B.hidden_size * 2  # (S, h) bf16 per block
    assert ballast.gpu_bytes == full.peak_gpu_bytes - run.peak_gpu_bytes > 0
    assert (ballast.pageable_bytes, ballast.disk_bytes) == (0, 0)
    chosen = ballast.strategy_arguments()
    assert chosen["FPDTStrategy"]["chunks"] == 2 and chosen["ActivationOffload"]["recompute_attention"] is True
    record = ballast.record(10.0)
    assert record["regenerated_block_forwards"] == 0 and record["kept_inputs"] == 28
    assert record["step_time_s"] == pytest.approx(10.0 * record["estimated_step_ratio"])
    assert 1 < record["estimated_step_ratio"] < 28 / 2  # every layer's work; the shared parts (lm_head) once


def test_residency_of_the_full_depth_is_counted_in_the_time_and_the_run_keeps_its_inputs():
    """A full plan that keeps 14 of 28 inputs: the run trains every input kept, the record counts 14 regenerating
    forwards, and its step estimate is more than the layers' share."""
    args = _args("--seq-len", str(2**20), "--auto-options")
    ballast = full_depth_ballast(args, LLAMA_3B, world_size=1, gpus_per_node=1, gpu_memory_bytes=139 * GIB,
                                 available_host=118 * GIB, disk_free=None)
    record = ballast.record(100.0)
    assert record["kept_inputs"] < 28 and record["regenerated_block_forwards"] == 28 - record["kept_inputs"]
    assert ballast.strategy_arguments()["ActivationOffload"]["keep_inputs"] == "all"
    assert record["estimated_step_ratio"] > 28 / 2


def test_disk_bytes_of_the_full_depth_are_held_per_gpu():
    """A host too small for the inputs the plan holds: the full depth spills to disk, and the ballast holds its disk
    bytes per GPU."""
    args = _args("--seq-len", str(2**20), "--auto-options", "--cpu-offload-params")
    full, _run = plan_fpdt(args, LLAMA_3B, num_gpus=1, gpus_per_node=1, gpu_memory_bytes=79 * GIB,
                           available_host=118 * GIB, disk_free=200 * GIB)
    assert full.options.disk_inputs > 0
    ballast = full_depth_ballast(args, LLAMA_3B, world_size=1, gpus_per_node=1, gpu_memory_bytes=79 * GIB,
                                 available_host=118 * GIB, disk_free=200 * GIB)
    assert ballast.disk_bytes == full.disk_bytes_per_node > 0
    assert ballast.pageable_bytes > 0  # the host-resident moments of the layers not run


def test_full_depth_that_fits_nothing_is_refused_naming_the_planner():
    """A full depth the machine cannot hold is refused with the planner's answer and the memory that binds (the run
    records it as out of memory there, holding nothing)."""
    with pytest.raises(FullDepthRefused, match="full depth .*28 layers") as refused:
        full_depth_ballast(_args("--seq-len", str(2**22), "--auto-options"), LLAMA_3B, world_size=1, gpus_per_node=1,
                           gpu_memory_bytes=79 * GIB, available_host=100 * GIB, disk_free=None)
    assert refused.value.limit == "host"


def test_alst_full_depth_beyond_the_host_is_refused_before_anything_is_held():
    """ALST keeps every block input in host memory: on one GPU with 125 GiB of host, 786,432 tokens of the 3B
    geometry need 126 GiB of them alone, refused as host-bound (the kernel would end the run without a record);
    524,288 (84 GiB) is held."""
    def alst(seq_len: int):
        args = cli.parse_args(["--system", "alst", "--model", "llama3-3b", "--layers", "2", "--ballast", "full",
                               "--seq-len", str(seq_len)])
        return full_depth_ballast(args, LLAMA_3B, world_size=1, gpus_per_node=1, gpu_memory_bytes=139 * GIB,
                                  available_host=122 * GIB, disk_free=None)

    assert alst(524_288).pinned_bytes == 26 * 524_288 * LLAMA_3B.hidden_size * 2
    with pytest.raises(FullDepthRefused, match=r"alst at full depth \(28 layers\), 786,432 tokens") as refused:
        alst(786_432)
    assert refused.value.limit == "host"
    # what is set against the host is the resident memory (pinned, pageable, the process), and the message says it
    resident, pinned = (float(x) for x in re.search(r"is ([\d.]+) GiB per host \(pinned ([\d.]+)",
                                                     str(refused.value)).groups())
    assert pinned >= 28 * 786_432 * LLAMA_3B.hidden_size * 2 / GIB and resident > pinned


def test_a_refused_full_depth_is_an_out_of_memory_record(tmp_path, monkeypatch):
    """The run writes the refusal as a record (status oom, the binding memory, "planned:" and the planner's answer)
    instead of ending without one."""
    import warnings

    from bench.peers import runner

    def refuse(*args, **kwargs):
        raise FullDepthRefused("tiny at full depth (2 layers), 64 tokens: nothing fits the host", "host")

    monkeypatch.setattr(runner, "full_depth_ballast", refuse)
    argv = ["--system", "fpdt", "--model", "tiny", "--layers", "1", "--seq-len", "64", "--steps", "1",
            "--accelerator", "cpu", "--precision", "32-true", "--ballast", "full", "--chunks", "2",
            "--out", str(tmp_path / "unused.jsonl")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        record = runner.run(cli.parse_args(argv))
    assert record["status"] == "oom" and record["limit"] == "host" and "full_depth" not in record
    assert record["error"].startswith("planned: tiny at full depth")


def test_alst_holds_the_block_inputs_of_the_layers_not_run_in_host_memory():
    """DeepSpeed keeps every checkpointed block input on the host: S/W·h bf16 per layer not run."""
    args = cli.parse_args(["--system", "alst", "--model", "llama3-3b", "--layers", "2", "--ballast", "full",
                           "--seq-len", "65536"])
    ballast = full_depth_ballast(args, LLAMA_3B, world_size=2, gpus_per_node=2, gpu_memory_bytes=79 * GIB,
                                 available_host=None, disk_free=None)
    assert ballast.pinned_bytes == 26 * 32768 * LLAMA_3B.hidden_size * 2 and ballast.plan is None


def test_held_ballast_takes_the_disk_blocks_and_gives_everything_back(tmp_path):
    """The disk ballast is a file of allocated blocks (not sparse) in --offload-dir, taken by hold_disk (at the first
    batch, after the strategy's setup checks) and removed at release; the host ballast is resident from the start."""
    ballast = FullDepth(gpu_bytes=0, pinned_bytes=3 * 4096 + 5, pageable_bytes=8192, disk_bytes=2**20)
    held = HeldBallast(ballast, device=torch.device("cpu"), offload_dir=str(tmp_path), rank=3)
    path = held.path
    assert os.path.basename(path) == "full-depth-ballast-rank3.bin" and not os.path.exists(path)
    held.hold_disk()
    held.hold_disk()
    assert os.path.getsize(path) == 2**20 and os.stat(path).st_blocks * 512 >= 2**20
    assert held.allocator.allocated_bytes == 3 * 4096 + 5 and sum(int(p.sum()) for p in held.pinned) == 3 * 4096 + 5
    held.release()
    held.release()
    assert not os.path.exists(path) and held.pinned is None and held.allocator.allocated_bytes == 0


def test_disk_ballast_needs_a_directory():
    """Disk bytes to hold and no --offload-dir: a ValueError naming the option."""
    with pytest.raises(ValueError, match="--offload-dir"):
        HeldBallast(FullDepth(0, 0, 0, 4096), device=torch.device("cpu"), offload_dir=None, rank=0)


@pytest.mark.parametrize("argv, message", [
    (["--system", "modelparallel", "--ballast", "full"], "keeps its block inputs on the GPU"),
    (["--system", "alst", "--offload-dir", "/tmp/x"], "disk tier"),
])
def test_options_full_ballast_refuses(argv, message):
    """--ballast full only where host and disk are planned; --offload-dir only for the fpdt systems."""
    args = cli.parse_args([*argv, "--accelerator", "cpu"])
    with pytest.raises(ValueError, match=message):
        cli._check_memory_options(args)


def test_a_run_with_the_full_depth_ballast_writes_its_plan_and_holdings(tmp_path):
    """One CPU process, 1 of tiny's 2 layers: the run trains with the full plan's options and records what it held
    and the full depth's step estimate; nothing stays in --offload-dir."""
    import warnings

    from bench.peers import runner

    argv = ["--system", "fpdt", "--model", "tiny", "--layers", "1", "--seq-len", "64", "--steps", "2",
            "--accelerator", "cpu", "--precision", "32-true", "--ballast", "full", "--chunks", "2",
            "--offload-dir", str(tmp_path), "--out", str(tmp_path / "unused.jsonl")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MFUMonitor: no peak FLOP/s for a CPU
        record = runner.run(cli.parse_args(argv))
    full = record["full_depth"]
    assert record["status"] == "ok" and record["options"]["ballast"] == "full"
    assert record["options"]["full_depth_arguments"]["FPDTStrategy"]["chunks"] == 2
    assert full["held"]["pinned_bytes"] > 0 and full["held"]["gpu_bytes"] == record["ballast_bytes"] > 0
    assert full["step_time_s"] == pytest.approx(record["step_time_s"] * full["estimated_step_ratio"])
    assert not any(name.startswith("full-depth-ballast") for name in os.listdir(tmp_path))


def _run_full_depth(monkeypatch, tmp_path, train):
    """runner._train_full_depth with a disk ballast of 64 KiB and ``train`` in place of the run."""
    from bench.peers import runner
    from bench.peers.records import RunContext

    ballast = FullDepth(gpu_bytes=0, pinned_bytes=0, pageable_bytes=0, disk_bytes=2**16)
    monkeypatch.setattr(runner, "full_depth_ballast", lambda *a, **k: ballast)
    monkeypatch.setattr(runner, "_train", train)
    args = _args("--seq-len", "4096", "--offload-dir", str(tmp_path), "--accelerator", "cpu")
    context = RunContext(world_size=1, gpus_per_node=1, card="cpu", card_memory=None, usable_memory=None,
                         memory_cap=None, full_geometry=LLAMA_3B, geometry_run=LLAMA_3B, peak=None)
    return runner._train_full_depth(args, context, torch.device("cpu"), {}, None)


def test_disk_ballast_is_taken_at_the_first_batch(monkeypatch, tmp_path):
    """The disk ballast's file appears only when the run calls ``args.at_first_batch`` (after the strategy's setup,
    whose checkpoint-folder check must see the disk as a full-depth run's setup sees it), and is gone after."""
    path = tmp_path / "full-depth-ballast-rank0.bin"
    seen = []

    def train(args, context, device, info, ballast_size):
        seen.append(path.exists())
        args.at_first_batch()
        seen.append(path.exists() and path.stat().st_size == 2**16)
        return "ok", None, None

    status, *_ = _run_full_depth(monkeypatch, tmp_path, train)
    assert status == "ok" and seen == [False, True] and not path.exists()


def test_a_run_that_never_takes_the_disk_ballast_is_an_error(monkeypatch, tmp_path):
    """A system that trains without calling ``at_first_batch`` would claim a disk it never held: refused."""
    with pytest.raises(RuntimeError, match="disk ballast"):
        _run_full_depth(monkeypatch, tmp_path, lambda *a: ("ok", None, None))


def test_auto_options_keep_a_chunk_count_given():
    """--auto-options leaves the chunks to the planner unless a count is given: then the full depth and the layers run
    are planned with it (a neighbour of the planner's choice, measured with everything else auto)."""
    auto, _ = plan_fpdt(_args("--seq-len", str(2**20), "--auto-options"), LLAMA_3B, num_gpus=1, gpus_per_node=1,
                        gpu_memory_bytes=139 * GIB, available_host=118 * GIB, disk_free=None)
    chunks = 2 * auto.options.chunks
    full, run = plan_fpdt(_args("--seq-len", str(2**20), "--auto-options", "--chunks", str(chunks)), LLAMA_3B,
                          num_gpus=1, gpus_per_node=1, gpu_memory_bytes=139 * GIB, available_host=118 * GIB,
                          disk_free=None)
    assert full.options.chunks == run.options.chunks == chunks
