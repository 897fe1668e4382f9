"""The planner's step-time model (lightning_fpdt/planner/cost.py and the features' ``extra_seconds``): the parts of a
step at the rates it is given, copies charged for what the compute beside them does not hide, and each option's
recompute counted for exactly what it runs again."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_fpdt.planner import cost, plan_memory
from lightning_fpdt.planner.features import FEATURES
from lightning_fpdt.planner.phases import plan_sizes
from lightning_fpdt.planner.rates import BUILTIN_RATES, StepRates, attention_key
from lightning_fpdt.planner.search import estimated_step_seconds, step_estimate

FEATURE = {type(feature).__name__: feature for feature in FEATURES}
RUN = dict(geometry="llama3-3b", seq_len=65536, num_gpus=1, activation_offload=True, tiled_mlp=True, tiled_loss=True,
           chunks=1, offload=False, recompute_attention=False)
# fp64 sums of a few dozen terms: the parts of one estimate agree to ~1e-15 relative; 1e-9 leaves margin
REL = 1e-9


def sizes(**options):
    return plan_sizes(plan_memory(**{**RUN, **options}))


def test_base_is_its_parts_at_the_rates_given():
    """What every configuration computes is the sum of its parts; GEMMs twice as fast halve the dense part, a
    memory-bound op twice as fast halves the elementwise part, and neither changes the attention's."""
    s = sizes()
    parts = dict(cost.base_parts(s))
    assert cost.base_seconds(s) == pytest.approx(sum(parts.values()), rel=REL)
    doubled = dataclasses.replace(BUILTIN_RATES, matmul_flops=2 * BUILTIN_RATES.matmul_flops,
                                  elementwise_bytes=2 * BUILTIN_RATES.elementwise_bytes)
    faster = dataclasses.replace(s, rates=doubled)
    fast = dict(cost.base_parts(faster))
    dense, attention, elementwise = (next(k for k in parts if k.startswith(word)) for word in ("dense", "attention",
                                                                                                "norms"))
    assert fast[dense] == pytest.approx(parts[dense] / 2, rel=REL)
    assert fast[elementwise] == pytest.approx(parts[elementwise] / 2, rel=REL)
    assert fast[attention] == pytest.approx(parts[attention], rel=1e-3)  # only its merges are memory-bound
    # the dense GEMMs' FLOPs are the MFU's 6 per parameter and token of the blocks' linear layers
    g = s.g
    linear = (g.hidden_size * (2 * g.num_heads + 2 * g.num_kv_heads) * g.head_dim
              + 3 * g.hidden_size * g.intermediate_size)
    assert parts[dense] == pytest.approx(6 * linear * s.N * s.L / BUILTIN_RATES.matmul_flops, rel=REL)


def test_offloaded_stash_costs_only_the_copies_the_compute_does_not_hide():
    """offload=True adds the stash's copies times the share the measured overlap leaves: nothing with a perfect
    overlap, all of them with none, and beyond full overlap only what outlasts the attention beside them."""
    s = sizes(offload=True)
    stash = FEATURE["AttentionStash"]

    def with_overlap(overlap, copy_bytes=BUILTIN_RATES.copy_bytes):
        return dataclasses.replace(s, rates=dataclasses.replace(BUILTIN_RATES, copy_overlap=overlap,
                                                                copy_bytes=copy_bytes))

    moved = stash.extra_seconds(with_overlap(0.0)) * BUILTIN_RATES.copy_bytes  # bytes, from the copy time
    assert stash.extra_seconds(with_overlap(1.0)) == 0.0
    assert stash.extra_seconds(with_overlap(0.25)) == pytest.approx(0.75 * moved / BUILTIN_RATES.copy_bytes, rel=REL)
    slow = with_overlap(1.0, copy_bytes=1e6)  # copies far longer than the attention: the excess shows
    assert stash.extra_seconds(slow) == pytest.approx(moved / 1e6 - cost.attention_seconds(slow), rel=REL)
    # every chunk to the host and back once with one chunk
    assert moved == pytest.approx(2 * plan_memory(**{**RUN, "offload": True}).component("attention stash").host_bytes,
                                  rel=REL)


def test_each_option_adds_what_it_computes_again():
    """recompute_attention adds every layer's attention forward; the checkpointed blocks' recompute their forward
    (GEMMs and elementwise) but not their attention; TiledMLP without checkpointing its MLP's forward; keep_inputs=k
    the L - k regenerated blocks' forwards."""
    kept, recomputed = sizes(), sizes(recompute_attention=True)
    stash, blocks = FEATURE["AttentionStash"], FEATURE["BlockInputs"]
    assert stash.extra_seconds(kept) == 0.0
    assert stash.extra_seconds(recomputed) == pytest.approx(cost.attention_forward_seconds(recomputed), rel=REL)
    inputs_copies = cost.exposed_copy_seconds(kept, 2 * kept.L * kept.A, cost.compute_seconds(kept))
    assert blocks.extra_seconds(kept) == pytest.approx(kept.L * cost.block_forward_seconds(kept) + inputs_copies,
                                                       rel=REL)
    plain = plan_sizes(plan_memory(**{**RUN, "activation_offload": False}))
    assert blocks.extra_seconds(plain) == 0.0
    assert FEATURE["TiledMLPFeature"].extra_seconds(plain) == pytest.approx(plain.L * cost.mlp_forward_seconds(plain),
                                                                            rel=REL)
    assert FEATURE["TiledMLPFeature"].extra_seconds(kept) == 0.0  # the checkpointed block's recompute counts it
    host = dict(host_memory_gib=2000)
    partial = plan_sizes(plan_memory(**{**RUN, **host, "keep_inputs": 14}))
    regenerate = FEATURE["Residency"].extra_seconds(partial)
    assert regenerate >= 14 * cost.block_forward_seconds(partial)
    both = plan_sizes(plan_memory(**{**RUN, **host, "keep_inputs": 14, "recompute_attention": True}))
    assert FEATURE["Residency"].extra_seconds(both) == pytest.approx(
        14 * cost.block_forward_seconds(both) + cost.attention_forward_seconds(both) * 14 / 28
        + cost.exposed_copy_seconds(both, 14 * 2 * both.A, cost.compute_seconds(both) * 14 / 28), rel=REL)


def test_chunks_cost_what_their_blocks_measured():
    """The chunks' cost is the FPDT schedule at the measured blocks' seconds: four chunks of 16,384 tokens run 4
    causal and 6 full blocks a layer; measured at twice their FLOPs' time against the fewest chunks' block, they add
    the difference."""
    s = sizes(seq_len=65536, chunks=4)
    shape = dict(batch=1, heads=24, kv_heads=8, head_dim=128)
    measured = []
    for kind in ("forward", "backward"):
        for causal, tokens, seconds in ((True, 65536, 0.1), (True, 16384, 0.1 / 16 * 2), (False, 16384, 0.2 / 16 * 2)):
            measured.append((attention_key(kind, causal=causal, tokens=tokens, **shape), seconds))
    rates = StepRates(calibrated=True, attention=tuple(measured))
    s = dataclasses.replace(s, rates=rates)
    one = cost.attention_seconds(s, chunks=1, groups=1)
    four = cost.attention_seconds(s, groups=1)
    assert one == pytest.approx(s.L * 2 * 0.1, rel=1e-3)  # merges: none with one chunk
    assert four >= s.L * 2 * (4 * 0.0125 + 6 * 0.025)
    assert FEATURE["Chunks"].extra_seconds(s) == pytest.approx(four - one, rel=REL)


def test_auto_at_65k_on_a_79_gib_gpu_offloads_and_keeps_the_attention():
    """The Llama-3.2-3B geometry at 65,536 tokens on one GPU capped to 79 GiB: offloading the stash costs its copies
    the compute does not hide, recomputing the attention a third of the attention; "auto" offloads and keeps it."""
    plan = plan_memory(**{**RUN, "offload": "auto", "recompute_attention": "auto", "chunks": "auto"},
                       gpu_memory_gib=74.0, host_memory_gib=118)
    assert plan.fits and plan.options.offload and not plan.options.recompute_attention
    assert estimated_step_seconds(plan) == pytest.approx(sum(seconds for _, seconds in step_estimate(plan)), rel=REL)
