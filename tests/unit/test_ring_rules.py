"""Each rule of the ring is stated once (``sequence/ring_rules.py``): the planner offers only what the runtime
accepts, and every place that checks a rule refuses with the rule's own message."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_fpdt.planner import plan_memory
from lightning_fpdt.planner.components import GIB
from lightning_fpdt.planner.features import FEATURES
from lightning_fpdt.planner.search import SEARCHED, Run, candidates
from lightning_fpdt.sequence import FPDTOptions, SequenceLayout
from lightning_fpdt.sequence.ring_rules import RING_RULES, check_ring, ring_refusal
from lightning_fpdt.sequence.sizes import resolve_sequence_sizes
from lightning_fpdt.strategy import FPDTStrategy

RING = 2
REFUSED = {"chunks": 4, "offload_dq": True, "head_chunks": 2}
"""A value each option's rule refuses with a ring."""


def _ring_plan():
    return plan_memory(geometry="llama3-8b", seq_len=1 << 17, num_gpus=4, sequence_parallel_size=4, ring_size=RING,
                       gpu_memory_gib=79, host_memory_gib=1000, activation_offload=True, tiled_mlp=True,
                       tiled_loss=True, chunks="auto", offload="auto", offload_dq="auto", head_chunks="auto")


def test_search_offers_with_a_ring_only_what_the_runtime_accepts():
    """With a ring, every configuration the planner's search may choose passes the runtime's checks (options, layout,
    sizes), and each option a rule covers takes the one value the rule allows."""
    plan = _ring_plan()
    run = Run(plan.geometry, plan.model, plan.seq_len, 1, 4, 4, 79 * GIB, 1000 * GIB)
    searched = [field for feature in FEATURES for field in feature.fields if field in SEARCHED]
    found = candidates(run, plan.options, searched)
    assert plan.options.ring_size == RING and len(found) > 1
    for options in found + [plan.options]:
        for option in REFUSED:
            assert getattr(options, option) == RING_RULES[option].with_ring, (option, options)
        check_ring(RING, chunks=options.chunks, offload_dq=options.offload_dq, head_chunks=options.head_chunks)
        FPDTOptions(chunks=options.chunks, offload_dq=options.offload_dq, head_chunks=options.head_chunks,
                    ring_size=RING)
        SequenceLayout(4, 0, options.chunks, ring_size=RING)
        resolve_sequence_sizes(world_size=4, devices_per_node=4, data_parallel_size="auto", sequence_parallel_size=4,
                               ring_size=RING, heads=(32, 8), head_chunks=options.head_chunks)


def test_auto_resolves_to_what_the_ring_takes():
    """``"auto"`` chunks and dQ offload resolve, with a ring, to the value each rule allows."""
    resolved = FPDTOptions(ring_size=RING).resolve(None, batch_size=1, seq_len=1 << 20, sp_size=4, ring_size=RING)
    assert resolved.chunks == RING_RULES["chunks"].with_ring
    assert resolved.offload_dq == RING_RULES["offload_dq"].with_ring


@pytest.mark.parametrize("option", sorted(REFUSED))
def test_every_check_refuses_with_the_rules_message(option):
    """A value a rule refuses raises the rule's one message wherever it is checked: the strategy's options, the
    planner's options, the layout (chunks) and the mesh sizes (head groups)."""
    value = REFUSED[option]
    message = ring_refusal(RING, **{option: value})
    assert message is not None and message == RING_RULES[option].message.format(value=value, ring_size=RING)
    plan = _ring_plan()
    checks = [lambda: dataclasses.replace(plan.options, **{option: value})]
    if option in ("chunks", "offload_dq"):
        checks.append(lambda: FPDTStrategy(ring_size=RING, **{option: value}))
    if option == "chunks":
        checks.append(lambda: SequenceLayout(4, 0, value, ring_size=RING))
    if option == "head_chunks":
        checks.append(lambda: resolve_sequence_sizes(world_size=4, devices_per_node=4, data_parallel_size="auto",
                                                     sequence_parallel_size=4, ring_size=RING, heads=(32, 8),
                                                     head_chunks=value))
    for check in checks:
        with pytest.raises(ValueError) as refused:
            check()
        assert str(refused.value) == message


def test_no_rule_applies_without_a_ring():
    """Without a ring (``ring_size=1``) no rule refuses anything."""
    assert ring_refusal(1, chunks=8, offload_dq=True, head_chunks=4, documents=object()) is None
