"""What the attention keeps from its forward for its backward, and where: every layer's chunks (and, under
checkpointing, its output) on the GPU or offloaded to the host (``FPDTStrategy(offload=...)``), the backward's fp32
partial dQ sums on the host too (``offload_dq``), or, with ``ActivationOffload(recompute_attention=True)``, only the
chunks of the layer in backward, its attention run again in the recompute."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from lightning_fpdt.planner.components import Component, attention_host_bytes
from lightning_fpdt.planner.cost import attention_forward_seconds, attention_seconds, exposed_copy_seconds
from lightning_fpdt.planner.features.base import Flag, MemoryFeature, switch
from lightning_fpdt.planner.step_sizes import StepSizes
from lightning_fpdt.sequence.planning import stash_bytes

DQ_BYTES = 4
"""Bytes per element of the partial dQ sums (fp32)."""


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
        parts = ((["each attention forward run again in its backward"] if o.recompute_attention else [])
                 + (["chunks through host memory"] if o.offload else [])
                 + (["partial dQ through host memory"] if o.offload_dq else []))
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
        # under recompute_attention each checkpointed block's attention forward runs again in its backward
        seconds = attention_forward_seconds(s) * s.checkpointed / s.L if o.recompute_attention else 0.0
        if o.offload:
            seconds += exposed_copy_seconds(s, stash_moved_bytes(s, self.components(s)[0].host_bytes),
                                            attention_seconds(s))
        if o.offload_dq:
            seconds += exposed_copy_seconds(s, dq_moved_bytes(s), attention_seconds(s) * 2 / 3)
        return seconds

    def arguments(self, s: StepSizes) -> dict[str, dict[str, Any]]:
        o = s.o
        chosen: dict[str, dict[str, Any]] = {"FPDTStrategy": {"offload": o.offload, "offload_dq": o.offload_dq}}
        if o.activation_checkpointing:
            chosen["ActivationOffload"] = {"recompute_attention": o.recompute_attention}
        return chosen


def stash_moved_bytes(s: StepSizes, host_bytes: int) -> float:
    """Bytes the offloaded stash moves between host and device in a step: every chunk to the host once, back once in
    the backward, and with ``u`` chunks read about ``(u - 1)/2`` more times (each kv chunk by every later q chunk in
    the forward, each q-side chunk by every earlier kv chunk in the backward)."""
    return host_bytes * (2 + (s.o.chunks - 1) / 2)


def dq_moved_bytes(s: StepSizes) -> float:
    """Bytes the partial dQ sums move with ``offload_dq``: each q chunk's fp32 sum out and back for every kv chunk
    before it and its own, ``u(u + 1)/2`` pairs a layer and head group."""
    u, ring = s.o.chunks, s.o.ring_size
    # one q chunk of the rank, every head group's: B·S/(u·R) tokens of H/U heads (the busiest rank's)
    chunk = s.batch_size * s.seq_len // (u * ring) * (s.attention_heads // (s.P // ring)) * s.g.head_dim
    return s.L * (u * (u + 1) / 2) * 2 * DQ_BYTES * chunk
