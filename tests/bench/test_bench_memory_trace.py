"""bench/memory_trace.py: the replay of an allocator history (on a hand-written history), its options, and a traced
run on two gloo CPU processes with the host's readings per phase."""

import json

from bench import memory_trace
from bench.memory_trace import MARK_BYTES, format_summary, summarise


def _frame(file: str, name: str) -> dict:
    return {"filename": f"/x/lightning_fpdt/{file}", "line": 1, "name": name}


def _history() -> dict:
    mlp = [_frame("memory/tiled_mlp.py", "tiled_mlp_backward")]
    attn = [_frame("sequence/fpdt.py", "fpdt_backward")]
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": []},
        {"action": "alloc", "addr": 2, "size": 50, "frames": []},
        {"action": "free_completed", "addr": 2, "size": 50, "frames": []},
        {"action": "alloc", "addr": 9, "size": MARK_BYTES, "frames": []},
        {"action": "free_completed", "addr": 9, "size": MARK_BYTES, "frames": []},
        {"action": "alloc", "addr": 3, "size": 40, "frames": mlp},
        {"action": "alloc", "addr": 4, "size": 30, "frames": mlp},
        {"action": "free_completed", "addr": 4, "size": 30, "frames": mlp},
        {"action": "alloc", "addr": 5, "size": 60, "frames": attn},
        {"action": "free_completed", "addr": 3, "size": 40, "frames": mlp},
        {"action": "free_requested", "addr": 5, "size": 60, "frames": attn},
        {"action": "alloc", "addr": 6, "size": 20, "frames": attn},
        {"action": "free_completed", "addr": 5, "size": 60, "frames": attn},
    ]
    return {"device_traces": [events], "fpdt_marks": ["step1"]}


def test_peak_is_the_largest_sum_of_live_allocations_after_the_marker():
    """The peak counts what was alive before the marker, skips the marker, and counts a tensor freed when its free is
    requested."""
    summary = summarise(_history(), since="step1")
    assert summary["base_bytes"] == 100
    assert summary["peak_bytes"] == 200  # 100 + 40 + 60
    assert summary["peak_phase"] == "attention backward"
    assert summary["phase_peaks"] == {"attention backward": 200, "MLP backward": 170}
    assert summary["at_peak_by_phase"] == {"other": 100, "attention backward": 60, "MLP backward": 40}
    sites = dict(summary["at_peak_by_site"])
    assert sites["lightning_fpdt/sequence/fpdt.py:1 fpdt_backward"] == 60
    assert sites["<autograd>"] == 100
    # each phase's highest count, and what was alive then: the MLP's two tiles, then the attention's chunk beside the
    # MLP's first tile
    mlp = "lightning_fpdt/memory/tiled_mlp.py:1 tiled_mlp_backward"
    attn = "lightning_fpdt/sequence/fpdt.py:1 fpdt_backward"
    assert summary["phase_peak_sites"] == {"attention backward": [("<autograd>", 100), (attn, 60), (mlp, 40)],
                                           "MLP backward": [("<autograd>", 100), (mlp, 70)]}
    assert "alive at the highest count of 'MLP backward', by site:" in format_summary(summary)


def _options(*argv: str):
    args = memory_trace.build_parser().parse_args(["train", "--seq-len", "64", *argv])
    memory_trace.resolve_option_defaults(args)
    return memory_trace.strategy_options(args), memory_trace.offload_options(args), args


def test_memory_options_keep_their_defaults_and_pass_auto_through():
    """Today's flags and defaults hold; --auto-options (alias --callbacks-auto) leaves every option not given at
    "auto", passed to the strategy and ActivationOffload as the string."""
    strategy, offload, args = _options()
    assert strategy == dict(chunks="auto", offload="auto", offload_dq="auto", head_chunks=1, cpu_offload_params=False,
                            sync_every_batch="auto")
    assert offload == dict(recompute_attention=False, reload_input=False, prefetch=1)
    assert (args.model, args.geometry, args.layers) == ("reference", "llama3-8b", 2)
    strategy, offload, _ = _options("--recompute-attention", "--reload-input", "--prefetch", "0", "--chunks", "8",
                                    "--offload", "on", "--head-chunks", "2")
    assert strategy == dict(chunks=8, offload=True, offload_dq="auto", head_chunks=2, cpu_offload_params=False,
                            sync_every_batch="auto")
    assert offload == dict(recompute_attention=True, reload_input=True, prefetch=0)
    for flag in ("--auto-options", "--callbacks-auto"):
        strategy, offload, _ = _options(flag, "--offload-dq", "off", "--sync-every-batch", "on")
        assert strategy == dict(chunks="auto", offload="auto", offload_dq=False, head_chunks="auto",
                                cpu_offload_params=False, sync_every_batch=True)
        assert offload == dict(recompute_attention="auto", reload_input="auto", prefetch="auto")
    _, _, args = _options("--model", "hf", "--geometry", "llama3-3b", "--layers", "full")
    assert (args.model, args.geometry, args.layers) == ("hf", "llama3-3b", 28)  # Llama-3.2-3B's depth


def traced_cpu_run(out: str, extra: tuple = ()) -> dict:
    """Every rank: two steps of tiny at one layer on CPU (``extra``: more arguments); rank 0 returns its record."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return memory_trace.main(["train", "--accelerator", "cpu", "--geometry", "tiny", "--layers", "1",
                                  "--seq-len", "64", "--chunks", "2", "--offload", "on", "--precision", "32-true",
                                  "--steps", "2", "--out", out, *extra])


def test_accumulated_steps_trace_every_batch(dist_pool, tmp_path):
    """With --accumulate-grad-batches a step is a window of batches, each traced: two steps of two batches record
    four batches, and the record says how many a step accumulates and whether its batches reduce-scattered (the
    page plans it with them; "auto" without a plan, on the CPU: at the window's end)."""
    out = tmp_path / "trace.jsonl"
    record, _ = dist_pool(2).run(traced_cpu_run, out=str(out), extra=("--accumulate-grad-batches", "2"))
    assert record["accumulate_grad_batches"] == 2 and record["sync_every_batch"] is False
    assert len(record["host_phase_peak_rss_bytes_per_step"]) == len(record["pinned_host_bytes_per_step"]) == 4
    assert record["command"].endswith("--accumulate-grad-batches 2")


def test_traced_steps_record_the_hosts_peak_in_each_phase(dist_pool, tmp_path):
    """Each step records rank 0's peak resident memory in its forward, backward and optimizer phases, the step's peak
    as the largest of them, the pinned bytes at its end (none pinned on CPU) and the plan's fields; the summary
    prints a host line per phase."""
    out = tmp_path / "trace.jsonl"
    record, other = dist_pool(2).run(traced_cpu_run, out=str(out))
    assert other == {} and json.loads(out.read_text()) == record
    assert (record["card"], record["gpus"], record["geometry"], record["layers"]) == ("cpu", 2, "tiny", 1)
    assert record["command"].startswith("torchrun --standalone --nproc_per_node 2 -m bench.memory_trace train ")
    assert record["host_rss_reading"] in ("peak", "sampled")
    steps = record["host_phase_peak_rss_bytes_per_step"]
    assert len(steps) == 2 and all(set(step) == {"forward", "backward", "optimizer"} for step in steps)
    assert all(value > 0 for step in steps for value in step.values())
    assert record["peak_host_rss_bytes_per_step"] == [max(step.values()) for step in steps]
    assert record["peak_host_rss_bytes"] == max(record["peak_host_rss_bytes_per_step"])
    assert record["pinned_host_bytes_caching_allocator"] == 0
    assert record["pinned_host_bytes"] in (None, 0) and len(record["pinned_host_bytes_per_step"]) == 2
    assert record["peak_gpu_bytes_per_step"] == [None, None] and record["peak_phase"] is None  # no trace on CPU
    assert (record["chunks"], record["offload"], record["head_chunks"], record["prefetch"]) == (2, True, 1, 1)
    if record["planned_peak_gpu_bytes"] is not None:  # a strategy that carries its memory plan
        assert record["planned_resident_host_bytes"] >= record["planned_pinned_host_bytes"] >= 0
        assert isinstance(record["plan_options"], str)
    summary = (tmp_path / "trace.txt").read_text()
    for phase in ("forward", "backward", "optimizer", "step"):
        assert any(line.split()[:1] == [phase] and line.endswith("GiB") for line in summary.splitlines()), phase
