"""What the attention keeps from its forward for its backward, and where: every layer's chunks (and, under
checkpointing, its output) on the GPU or offloaded to the host (``FPDTStrategy(offload=...)``), the backward's fp32
partial dQ sums on the host too (``offload_dq``), or, with ``ActivationOffload(recompute_attention=True)``, only the
chunks of the layer in backward, its attention run again in the recompute."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from lightning_fpdt.planner.components import Component, attention_host_bytes
from lightning_fpdt.planner.cost import attention_forward_seconds, attention_seconds
from lightning_fpdt.planner.features.base import Flag, MemoryFeature, switch
from lightning_fpdt.planner.sizes import StepSizes
from lightning_fpdt.sequence.planning import stash_bytes

OFFLOAD_SLOWDOWN = 0.02
"""Share of the attention's time the chunks' copies to and from the host add where the kernels cover them (long
sequences: the attention's work grows as ``S²``, its chunks as ``S``)."""
OFFLOAD_EXPOSED_BYTES = 17e9
"""Bytes per second at which the stash's copies to the host and back lengthen the step where the kernels do not
cover them: Llama-3-8B on 4 H100s at 32,768 and 65,536 tokens, each layer's stash to the host and back, measured as
the step with ``offload=True`` less the step without (12.5 and 25 ms a layer)."""
OFFLOAD_DQ_SLOWDOWN = 0.03
"""The same for the partial dQ sums' copies, which the backward's inner loop waits on more often."""


class AttentionStash(MemoryFeature):
    fields = ("offload", "offload_dq", "recompute_attention")
    neutral = {"recompute_attention": False}
    flags = (
        Flag(option="offload", parse=switch, default="auto", help="attention chunk offload: auto, on, off"),
        Flag(option="offload_dq", parse=switch, default="auto", help="partial dQ offload: auto, on, off"),
        Flag(option="recompute_attention", parse=switch, default="auto", bare=True,
             help="ActivationOffload(recompute_attention=...): auto, on (the same as no value), off; on: one layer's "
                  "attention stash instead of all"),
    )

    def describe_cost(self, s: StepSizes) -> str:
        o = s.o
        parts = (["each attention forward run again in its backward"] if o.recompute_attention else []) + \
            (["chunks through host memory"] if o.offload else []) + (["partial dQ through host memory"] if o.offload_dq else [])
        return "attention stash: " + ", ".join(parts)

    def normalise(self, changes: dict[str, Any]) -> Optional[dict[str, Any]]:
        if changes["recompute_attention"] and not changes["activation_checkpointing"]:
            return None  # there is no recompute to run the attention in
        if not changes["offload"]:
            changes["offload_dq"] = False  # the sums go to the host with the chunks or not at all
        return changes

    def components(self, s: StepSizes) -> list[Component]:
        o, L, G = s.o, s.L, s.G
        # attention calls holding a stash between forward and backward: every layer's, or under attention recompute
        # only the layer in backward; with head groups, each of its G groups
        layers_stashed = 1 if o.recompute_attention else L
        stashed = layers_stashed * G
        if G > 1:  # head groups keep each group's output for their backward (the layer in backward's, under recompute)
            kept = layers_stashed
        else:
            # first-pass outputs kept, by the checkpointed blocks (a plain block's output is in its activations)
            kept = s.checkpointed if o.activation_checkpointing and not o.recompute_attention else 0
        stash = stashed * stash_bytes(s.attention, **s.size, **s.ring)
        host = attention_host_bytes(dataclasses.replace(s.attention, num_layers=stashed), offload=o.offload,
                                    offload_dq=o.offload_dq, kept_out_layers=kept * G, **s.size, **s.ring)
        return [Component("attention stash", 0 if o.offload else stash + kept * s.out, host,
                          formula=("1 layer (attention recomputed)" if o.recompute_attention else "L")
                          + " x planning.stash_bytes (+ kept outputs)" + (", offloaded" if o.offload else ""))]

    def extra_seconds(self, s: StepSizes) -> float:
        o = s.o
        seconds = attention_forward_seconds(s) if o.recompute_attention else 0.0
        if o.offload:  # the kernels' time the copies add, or the copies themselves where they are the longer
            moved = 2 * self.components(s)[0].host_bytes  # to the host in the forward, back in the backward
            seconds += max(OFFLOAD_SLOWDOWN * attention_seconds(s), moved / OFFLOAD_EXPOSED_BYTES)
        return seconds + attention_seconds(s) * OFFLOAD_DQ_SLOWDOWN * o.offload_dq

    def arguments(self, s: StepSizes) -> dict[str, dict[str, Any]]:
        o = s.o
        chosen: dict[str, dict[str, Any]] = {"FPDTStrategy": {"offload": o.offload, "offload_dq": o.offload_dq}}
        if o.activation_checkpointing:
            chosen["ActivationOffload"] = {"recompute_attention": o.recompute_attention}
        return chosen
