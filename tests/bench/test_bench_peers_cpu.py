"""python3 -m bench.peers on 2 gloo CPU processes: the fpdt and modelparallel systems write well-formed records with the
same first loss, the ranks agree on an out-of-memory status; ring is CUDA-only, so only its option checks run here."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed as dist

from bench.peers import cli, records, runner, search, systems
from bench.provenance import current_commit
from bench.report import page

SEQ_LEN = 64
COMMON = ["--model", "tiny", "--layers", "1", "--seq-len", str(SEQ_LEN), "--steps", "2", "--accelerator", "cpu",
          "--precision", "32-true", "--ballast", "auto", "--check-host", "--out", "unused.jsonl"]


def train_both_systems() -> dict[str, dict]:
    """Every rank: one fpdt run (2 chunks, attention offload on), one more in 2 head groups, and one modelparallel run
    of the same model and data."""
    records = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MFUMonitor: no peak FLOP/s for a CPU
        for system, extra in (("fpdt", ["--chunks", "2"]), ("modelparallel", [])):
            records[system] = runner.run(cli.parse_args(["--system", system, *COMMON, *extra]))
        grouped = cli.parse_args(["--system", "fpdt", *COMMON, "--chunks", "2", "--head-chunks", "2"])
        records["fpdt head groups"] = runner.run(grouped)
    return records


def test_fpdt_and_modelparallel_records(dist_pool):
    """Both systems: status ok on every rank, figures filled in, same first loss (same init, same first sample)."""
    ranks = dist_pool(2).run(train_both_systems)
    for rank, by_system in enumerate(ranks):
        for name, record in by_system.items():
            system = name.split()[0]
            json.dumps(record)  # a JSON line as written
            assert record["status"] == "ok" and record["ranks_answered"] == [0, 1], (rank, system)
            assert record["gpus"] == 2 and record["layers"] == 1 and record["full_layers"] == 2
            assert record["steps_done"] == 2 and all(t > 0 for t in record["step_times_s"])
            assert record["step_time_s"] == record["step_times_s"][1] and record["timed_steps"] == 1
            assert record["tokens_per_s"] == pytest.approx(record["tokens_per_step"] / record["step_time_s"])
            assert record["tflops_per_gpu"] > 0 and record["mfu"] is None  # no peak FLOP/s for a CPU
            # the ballast of the layer not run: tiny's block is 36,992 parameters x 16 B, sharded over 2 ranks, and
            # under modelparallel its checkpointed input (64 tokens x 64 x 4 B) too; fpdt offloads that
            kept = 0 if system == "fpdt" else SEQ_LEN * 64 * 4
            assert (record["ballast_state_bytes"], record["ballast_bytes"]) == (36_992 * 16 // 2, 36_992 * 8 + kept)
            assert record["host_check"]["layers"] == 2 and record["host_check"]["fits"] is True
            assert record["command"].startswith(f"torchrun --standalone --nproc_per_node 2 -m bench.peers --system "
                                                f"{system} --model tiny")
            assert record["commit"] == current_commit() and record["card"] == "cpu"
            assert record["host_peak_rss_bytes"] > 0  # both ranks, summed
            # the host: each process's peak over the timed steps, the largest rank, the host's ranks summed (one
            # host here); nothing pinned on CPU (modelparallel pins through PyTorch only; fpdt's own count is 0 or
            # unknown); the fpdt strategy's plan where it carries one, none for the baseline
            per_rank = record["peak_host_rss_bytes_per_rank"]
            assert len(per_rank) == 2 and all(rss > 0 for rss in per_rank), system
            assert record["peak_host_rss_bytes"] == max(per_rank)
            assert record["peak_host_rss_bytes_per_node"] == sum(per_rank) <= record["host_peak_rss_bytes"]
            assert record["host_rss_reading"] in ("peak", "sampled")
            assert record["pinned_host_bytes_caching_allocator"] == 0
            if system == "modelparallel":
                assert record["pinned_host_bytes_per_rank"] == [0, 0] and record["planned_peak_gpu_bytes"] is None
            else:
                assert record["pinned_host_bytes"] in (None, 0)
                assert (record["plan_options"] is None) == (record["planned_resident_host_bytes"] is None)
    fpdt, modelparallel = ranks[0]["fpdt"], ranks[0]["modelparallel"]
    # fpdt: the 2 ranks share one sequence (sp 2); modelparallel: each rank trains its own sequence (dp 2)
    assert (fpdt["sequence_parallel_size"], fpdt["chunks"], fpdt["tokens_per_step"]) == (2, 2, SEQ_LEN)
    assert fpdt["options"]["offload"] is True and "TiledLoss" in fpdt["options"]["callbacks"]
    assert (modelparallel["data_parallel_size"], modelparallel["tokens_per_step"]) == (2, 2 * SEQ_LEN)
    # fp32, 1 layer, 64 tokens: the chunked, offloaded, tiled path and plain SDPA sum the same products in another
    # order (~1e-7 relative); 1e-4 still catches a wrong shift, a lost chunk or a different sample (~1e-1)
    assert fpdt["first_loss"] == pytest.approx(modelparallel["first_loss"], abs=1e-4)
    assert ranks[1]["fpdt"]["first_loss"] == fpdt["first_loss"]  # the group's loss, the same on both ranks
    grouped = ranks[0]["fpdt head groups"]  # --head-chunks reaches the strategy: the same loss, in another order
    assert grouped["options"]["head_chunks"] == 2 and fpdt["options"]["head_chunks"] == 1
    assert grouped["first_loss"] == pytest.approx(fpdt["first_loss"], abs=1e-4)
    # the records feed the report: the figures appear with their command
    doc = page.render_markdown([r for records in ranks[:1] for r in records.values()])
    assert fpdt["command"] in doc and "| cpu | 2 | tiny |" in doc


def profiled_fpdt_run(out: str) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = [a if a != "unused.jsonl" else out for a in COMMON]
        return runner.run(cli.parse_args(["--system", "fpdt", *args, "--chunks", "2", "--profile-step", "1"]))


def test_profiled_step_lands_in_the_record(dist_pool, tmp_path):
    """--profile-step 1: the second step runs under torch.profiler on every rank; the summary is in the record and
    rank 0 writes it beside --out (CPU here: no device time, the wall time and the structure only)."""
    out = str(tmp_path / "peers.jsonl")
    ranks = dist_pool(2).run(profiled_fpdt_run, out=out)
    for record in ranks:
        profile = record["profile"]
        assert profile["wall_s"] > 0 and profile["busy_s"] == 0.0 and profile["wait_s"] == profile["wall_s"]
    written = json.loads((tmp_path / "profile-fpdt-64-1layers.json").read_text())
    assert written["wall_s"] == ranks[0]["profile"]["wall_s"]


def agree(statuses: dict[int, str], key: str, timeout_s: float):
    """Ranks named in ``statuses`` post theirs; the others stay away, as a rank stuck in a collective would."""
    rank = dist.get_rank()
    if rank not in statuses:
        return None
    return records.agree_on_status(statuses[rank], key=key, timeout_s=timeout_s)


def out_of_memory_on_rank_zero() -> dict:
    """run() whose system runs out of memory on rank 0 only; rank 1 finishes its steps."""

    def system(args, *, info, **kwargs):
        info.update(tokens_per_step=SEQ_LEN, step_times_s=[0.1], losses=[5.0], peak_gpu_bytes_per_step=[None])
        if dist.get_rank() == 0:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    original = systems.SYSTEM_FUNCTIONS["fpdt"]
    systems.SYSTEM_FUNCTIONS["fpdt"] = system
    try:
        return runner.run(cli.parse_args(["--system", "fpdt", *COMMON, "--agree-timeout-s", "30"]))
    finally:
        systems.SYSTEM_FUNCTIONS["fpdt"] = original


def test_ranks_agree_on_out_of_memory(dist_pool):
    """One rank out of memory makes the run "oom" on every rank; a rank that never answers is left out after the
    timeout instead of hanging the others."""
    pool = dist_pool(2)
    assert pool.run(agree, statuses={0: "oom", 1: "ok"}, key="test/agree/1", timeout_s=30) == [("oom", [0, 1])] * 2
    assert pool.run(agree, statuses={0: "ok", 1: "ok"}, key="test/agree/2", timeout_s=30) == [("ok", [0, 1])] * 2
    assert pool.run(agree, statuses={0: "ok"}, key="test/agree/3", timeout_s=0.5) == [("oom", [0]), None]
    records = pool.run(out_of_memory_on_rank_zero)
    for record in records:
        assert record["status"] == "oom" and record["ranks_answered"] == [0, 1]
    assert records[0]["limit"] == "gpu" and "Tried to allocate" in records[0]["error"]
    assert records[1]["limit"] is None and records[1]["steps_done"] == 1  # rank 1 learnt it from rank 0


def test_cuda_only_options_are_checked_on_cpu():
    """ring is CUDA-only (torch dispatches only the CUDA SDPA kernels to ring attention), so is FSDP2's CPU offload:
    on CPU only their checks run, with the other option checks."""
    args = cli.parse_args(["--system", "ring", "--model", "tiny", "--seq-len", "64", "--accelerator", "cpu"])
    with pytest.raises(ValueError, match="only the CUDA SDPA kernels"):
        cli.validate(args, world_size=2)
    args = cli.parse_args(["--system", "ring", "--model", "tiny", "--seq-len", "66", "--accelerator", "cpu"])
    with pytest.raises(ValueError, match=r"multiple of 2 x GPUs = 8: .* pick 72"):
        cli.validate(args, world_size=4)
    with pytest.raises(ValueError, match="--cpu-offload-params needs a GPU"):
        cli.validate(cli.parse_args(["--system", "modelparallel", "--model", "tiny", "--cpu-offload-params",
                                         "--accelerator", "cpu"]), world_size=1)
    with pytest.raises(ValueError, match=r"--gpu-memory-gib \(79.0\) caps a GPU's memory"):
        cli.validate(cli.parse_args(["--system", "fpdt", "--model", "tiny", "--gpu-memory-gib", "79",
                                         "--accelerator", "cpu"]), world_size=1)
    with pytest.raises(ValueError, match="between 1 and the depth of tiny"):
        cli.validate(cli.parse_args(["--system", "fpdt", "--model", "tiny", "--layers", "3"]), world_size=1)
    args = cli.parse_args(["--system", "modelparallel", "--model", "tiny", "--rotate-method", "alltoall",
                             "--accelerator", "cpu"])
    with pytest.warns(UserWarning, match="--rotate-method alltoall has no effect on --system modelparallel"):
        cli.validate(args, world_size=1)
    ring_search = cli.parse_args(["--system", "ring", "--max-length", "--gpus", "4", "--length-multiple", "12"])
    with pytest.raises(ValueError, match="must be a multiple of 2 x GPUs"):
        search.max_length_search(ring_search)
