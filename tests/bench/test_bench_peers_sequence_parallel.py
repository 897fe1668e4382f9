"""bench.peers' Qwen2.5-0.5B geometries and ``--sequence-parallel-size``: the option reaches the strategy and the
full-depth plan, the systems without it refuse it, and a run of several data-parallel groups counts every group's
tokens. CPU only, no training."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from bench.peers import cli, records, systems
from bench.peers.ballast import host_check
from bench.peers.full_depth import plan_fpdt
from bench.peers.hf_llama import HF_GEOMETRIES, named_depth, named_geometry, named_vocab
from lightning_fpdt.callbacks.mfu import _count_global_tokens
from lightning_fpdt.flops import flops_per_token
from lightning_fpdt.sequence.heads import HeadSplit

GIB = 2**30


@pytest.mark.parametrize("name, heads, head_dim", [("qwen2.5-0.5b", 14, 64), ("qwen2.5-0.5b-16h", 16, 56)])
def test_qwen_geometries_resolve(name, heads, head_dim):
    """Qwen2.5-0.5B (14 query heads, split unevenly over 4 GPUs) and its 16-head twin (the even split at sp 4) are
    Qwen2 geometries of 24 layers, 2 kv heads and a tied 151,936-token vocabulary, the same width."""
    assert HF_GEOMETRIES[name][0] == "qwen2"
    geometry = named_geometry(name)
    assert (geometry.num_heads, geometry.num_kv_heads, geometry.head_dim) == (heads, 2, head_dim)
    assert (geometry.hidden_size, geometry.intermediate_size, geometry.attention_width) == (896, 4864, 896)
    assert geometry.tie_word_embeddings and not geometry.head_norms
    assert named_depth(name) == 24 and named_vocab(name) == 151936
    # ~494 M parameters with the tied embedding counted once (the flops count the lm_head, not the lookup)
    assert 490e6 < geometry.nonembedding_parameters < 495e6
    assert HeadSplit(num_heads=heads, num_kv_heads=2, sp_size=4).even == (heads == 16)
    assert flops_per_token(geometry, 131072, "causal") > 0


def parse(system: str, *extra: str) -> argparse.Namespace:
    model = "qwen2.5-0.5b" if system == "fpdt-hf" else "tiny"
    return cli.parse_args(["--system", system, "--model", model, "--seq-len", "64", "--accelerator", "cpu", *extra])


def test_sequence_parallel_size_is_taken_by_the_fpdt_systems_only():
    args = parse("fpdt-hf", "--sequence-parallel-size", "2")
    assert args.sequence_parallel_size == 2 and parse("fpdt").sequence_parallel_size == "auto"
    cli.validate(args, world_size=4)
    cli.validate(parse("fpdt", "--sequence-parallel-size", "4"), world_size=4)
    with pytest.raises(ValueError, match=r"must divide the GPU count \(4\).*\[1, 2, 4\]"):
        cli.validate(parse("fpdt-hf", "--sequence-parallel-size", "3"), world_size=4)
    _module, strategy, _callbacks, _precision = systems._lightning_parts(parse("fpdt", "--sequence-parallel-size", "2"),
                                                                         world_size=4)
    assert strategy._sequence_parallel_size == 2
    for system in ("ring", "alst", "modelparallel"):
        with pytest.raises(ValueError, match=f"FPDTStrategy's option: --system {system} .* fpdt or fpdt-hf"):
            cli.validate(parse(system, "--sequence-parallel-size", "2"), world_size=4)


def test_the_full_depth_plan_and_the_host_check_take_the_sequence_parallel_size():
    """--ballast full plans the full depth at the size given (the rest data parallel), as the strategy runs it; the
    host check of a Hugging Face geometry plans it too."""
    args = parse("fpdt-hf", "--sequence-parallel-size", "2", "--auto-options", "--layers", "2")
    args.seq_len = 65536
    full, run = plan_fpdt(args, named_geometry(args.model), num_gpus=4, gpus_per_node=4, gpu_memory_bytes=79 * GIB,
                          available_host=None, disk_free=None)
    for plan in (full, run):
        assert (plan.options.sequence_parallel_size, plan.options.data_parallel_size) == (2, 2)
    assert (full.geometry.num_layers, run.geometry.num_layers) == (24, 2)
    check = host_check(args, num_gpus=4, gpus_per_node=4, resolved={}, gpu_memory_bytes=79 * GIB,
                       available_bytes=None)
    assert check["layers"] == 24 and check["needed_bytes"] > 0


def test_a_run_of_several_data_parallel_groups_counts_every_groups_tokens():
    """sp 2 x dp 2 on 4 GPUs: MFUMonitor counts a sequence per data-parallel group, and the record's tokens/s,
    TFLOP/s per GPU and MFU divide that count's FLOPs over all 4 GPUs."""
    seq_len = 131072
    strategy = SimpleNamespace(last_batch_geometry=(1, seq_len, seq_len), data_parallel_size=2)
    tokens, counted_len = _count_global_tokens(strategy, 4, batch=None)
    assert (tokens, counted_len) == (2 * seq_len, seq_len)
    geometry = named_geometry("qwen2.5-0.5b")
    info = {"step_times_s": [9.0, 2.0, 2.0], "tokens_per_step": tokens}
    figures = records.summarize(info, geometry_run=geometry, seq_len=seq_len, world_size=4, peak=1e15)
    per_gpu = 2 * seq_len * flops_per_token(geometry, seq_len, "causal") / 2.0 / 4
    assert figures["tokens_per_s"] == pytest.approx(seq_len)  # 2 sequences in 2 s
    assert figures["tflops_per_gpu"] == pytest.approx(per_gpu / 1e12)
    assert figures["mfu"] == pytest.approx(per_gpu / 1e15)


def train_data_parallel_fpdt() -> dict:
    import warnings

    from bench.peers import runner

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MFUMonitor: no peak FLOP/s for a CPU
        return runner.run(cli.parse_args(["--system", "fpdt", "--model", "tiny", "--layers", "1", "--seq-len", "64",
                                          "--steps", "2", "--accelerator", "cpu", "--precision", "32-true",
                                          "--sequence-parallel-size", "1", "--out", "unused.jsonl"]))


def test_an_fpdt_run_at_sequence_parallel_size_1_on_2_ranks_trains_2_sequences_a_step(dist_pool):
    """--sequence-parallel-size 1 on 2 gloo ranks: 2 data-parallel groups, 2 x 64 tokens a step in the record."""
    for record in dist_pool(2).run(train_data_parallel_fpdt):
        assert record["status"] == "ok" and record["options"]["sequence_parallel_size"] == 1
        assert (record["sequence_parallel_size"], record["data_parallel_size"]) == (1, 2)
        assert record["tokens_per_step"] == 2 * 64
        assert record["tflops_per_gpu"] == pytest.approx(
            2 * 64 * record["flops_per_token"] / record["step_time_s"] / 2 / 1e12)
