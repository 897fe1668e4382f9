"""The planner on several hosts: the step-time estimate charges the traffic that leaves a host, and a
sequence-parallel group spanning hosts takes the layout (ring size) that estimate ranks fastest among those that fit."""

from __future__ import annotations

import json
import re

import pytest

from bench.planner_hosts import lengths
from lightning_fpdt.planner import plan_memory
from lightning_fpdt.planner.commands import main
from lightning_fpdt.planner.cost import network_seconds, ring_network_seconds, ring_transfer_bytes
from lightning_fpdt.planner.geometry import resolve_geometry
from lightning_fpdt.planner.phases import plan_sizes
from lightning_fpdt.planner.rates import INTER_HOST_BYTES, NVLINK_BYTES
from lightning_fpdt.planner.search import step_estimate, step_seconds
from lightning_fpdt.sequence.sizes import resolve_ring_size

LLAMA_4 = resolve_geometry("llama3-8b", num_layers=4)
"""Llama-3-8B's layers, four of them: the figures per layer are the full model's, the plans faster."""
GIVEN = dict(activation_offload=True, tiled_mlp=True, tiled_loss=True, chunks=1, offload=False, offload_dq=False)
"""Every option explicit: no search but the ring's."""
QWEN2_5_7B = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
              "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}
"""Qwen2.5-7B's config.json (its sizes): 28 query heads, 4 kv heads."""


def spanning(**overrides):
    """Llama-3-8B's layers at 262,144 tokens on 2 hosts of 8 GPUs, one sequence over all 16."""
    return plan_memory(**{**dict(geometry=LLAMA_4, seq_len=262144, num_gpus=16, gpus_per_node=8,
                                 sequence_parallel_size=16, gpu_memory_gib=139.0, **GIVEN), **overrides})


def test_inter_host_all_to_all_is_charged():
    """A Ulysses group of 16 over hosts of 8 sends 8 of a rank's 15 peers' bytes over the network: the estimate adds
    those bytes at the inter-host rate less NVLink's; within one host the estimate has no network term."""
    plan = spanning(ring_size=1)
    s = plan_sizes(plan)
    per_token = (2 * 32 + 2 * 16) * 128 * 2  # q, output, and k, v replicated to 16 heads, bf16; forward + backward
    leaving = 2 * 4 * (262144 // 16) * per_token * 8 / 16
    assert network_seconds(s) == pytest.approx(leaving / INTER_HOST_BYTES - leaving / NVLINK_BYTES)
    estimate = dict(step_estimate(plan))
    assert estimate["the network: Ulysses all-to-alls across hosts (8 of 15 peers on other hosts, 40 GB/s)"] == \
        pytest.approx(network_seconds(s))
    slower = spanning(ring_size=1, inter_host_gbps=10)
    assert network_seconds(plan_sizes(slower)) == pytest.approx(leaving / 10e9 - leaving / NVLINK_BYTES)
    one_host = plan_sizes(spanning(ring_size=1, gpus_per_node=16))
    assert network_seconds(one_host) == 0 and step_seconds(one_host) == pytest.approx(
        step_seconds(s) - network_seconds(s))


def test_ring_passes_hide_behind_the_blocks_unless_the_network_is_too_slow():
    """The ring's K/V passes (R - 1 forward, R - 1 backward, R fp32 gradient passes) cost only their time beyond the
    ring's block computes they overlap: nothing at 40 GB/s, their excess at 0.1 GB/s."""
    s = plan_sizes(spanning(ring_size=2))
    share = 2 * (262144 // 2) * 1 * 128  # k and v of the share, one kv head a rank (8 over U = 8)
    assert ring_transfer_bytes(s) == 4 * share * (2 * 1 * 2 + 2 * 4)
    assert ring_network_seconds(s) == 0
    crawling = plan_sizes(spanning(ring_size=2, inter_host_gbps=0.1))
    assert ring_network_seconds(crawling) > 0


def test_auto_takes_the_ring_on_a_slow_network_and_ulysses_on_a_fast_one():
    """ring_size "auto" on a group spanning hosts: every ring the heads allow is planned, the fastest that fits taken;
    at 10 GB/s ring 2 x Ulysses 8 (its passes hidden, the all-to-alls inside a host), at 1000 GB/s (faster than
    NVLink) plain Ulysses 16, its chunks searched as without a ring; each layout's estimate is kept."""
    slow = spanning(ring_size="auto", chunks="auto", inter_host_gbps=10)
    assert slow.fits and slow.options.ring_size == 2
    assert [ring for ring, _ in slow.layouts] == [1, 2, 4, 8, 16]
    seconds = dict(slow.layouts)
    assert seconds[2] == pytest.approx(step_seconds(plan_sizes(slow))) and seconds[2] < seconds[1]
    fast = spanning(ring_size="auto", chunks="auto", inter_host_gbps=1000)
    assert fast.fits and fast.options.ring_size == 1 and dict(fast.layouts)[1] < dict(fast.layouts)[2]
    assert fast.options.chunks >= 262144 // 65536  # its chunks searched from where "auto" starts, not the ring's 1
    assert spanning(ring_size="auto", chunks="auto").options.ring_size == 2  # the default network: the ring


def test_explicit_sizes_are_untouched():
    """An explicit ring size is planned as given on any network, with no layouts compared; the strategy's "auto" (no
    length, no network) is the smallest ring whose Ulysses groups stay inside a host, no ring where the options
    given refuse one, and the sizes' rule inside one host."""
    for ring in (1, 4):
        for gbps in (1, 1000):
            plan = spanning(ring_size=ring, inter_host_gbps=gbps)
            assert plan.options.ring_size == ring and plan.layouts == ()
    assert resolve_ring_size(sequence_parallel_size=16, ring_size="auto", heads=(32, 8), devices_per_node=8) == 2
    assert resolve_ring_size(sequence_parallel_size=16, ring_size="auto", heads=(28, 4), devices_per_node=8) == 4
    assert resolve_ring_size(sequence_parallel_size=16, ring_size="auto", heads=(32, 8), devices_per_node=8,
                             allow_ring=False) == 1
    assert resolve_ring_size(sequence_parallel_size=8, ring_size="auto", heads=(32, 8), devices_per_node=8) == 1
    assert resolve_ring_size(sequence_parallel_size=16, ring_size=1, heads=(32, 8), devices_per_node=8) == 1
    # chunks given: an "auto" ring stays off where the heads allow that
    assert spanning(ring_size="auto", chunks=4).options.ring_size == 1


def test_non_positive_inter_host_gbps_is_refused(capsys):
    """inter_host_gbps must be a positive rate: the message names the value and what to give."""
    for gbps in (0, -5.0):
        with pytest.raises(ValueError, match=r"inter_host_gbps \(.*\) must be a positive number of GB/s .* about 50 "
                                             r"for a 400 Gb/s InfiniBand link per GPU"):
            spanning(ring_size=1, inter_host_gbps=gbps)
    assert main(["--seq-len", "65536", "--gpus", "16", "--gpus-per-node", "8", "--inter-host-gbps", "0"]) == 2
    assert "inter_host_gbps (0.0) must be a positive number" in capsys.readouterr().err


def test_cli_prints_the_layout_and_why(tmp_path, capsys):
    """`lightning-fpdt plan` names the layout and the reason: 28 query heads on the 8 GPUs of one host split 4 or 3 a
    rank without a ring; 16 GPUs over 2 hosts take ring 2 x Ulysses 8, with the estimate against Ulysses 16."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN2_5_7B))
    assert main(["--model", str(config), "--layers", "4", "--seq-len", "262144", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert ("layout: data parallel 1, Ulysses 8, ring 1, 4 or 3 query heads a rank (28 query heads over 8 GPUs: 4 or 3 "
            "a rank; one host, so no ring)") in out
    assert main(["--layers", "4", "--seq-len", "262144", "--gpus", "16", "--gpus-per-node", "8", "--sp", "16",
                 "--gpu-memory-gib", "139", "--chunks", "1", "--offload", "off", "--offload-dq", "off"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("layout:"))
    assert re.fullmatch(r"layout: data parallel 1, Ulysses 8, ring 2, 4 query heads a rank \(ring 2 x Ulysses 8 over 2 "
                        r"hosts: the Ulysses all-to-alls stay inside a host, only the ring's K/V crosses the network; "
                        r"estimated [\d.]+ s/step against [\d.]+ s for Ulysses 16\)", line), line
    assert "ring_size=2" in out  # the plan's arguments fix the ring the strategy should run


def test_table_lengths_are_powers_of_two_and_half_again():
    """bench.planner_hosts tries powers of two and 1.5 times them."""
    assert lengths(2**20, 2**23) == [2**20, 3 * 2**19, 2**21, 3 * 2**20, 2**22, 3 * 2**21, 2**23]
