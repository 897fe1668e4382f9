"""Checkpointed blocks and where their inputs wait (``ActivationOffload``): no checkpointing, checkpointing with the
inputs on the GPU (``offload=False``), or in host memory (the default), and how they come back (``reload_input``,
``prefetch``; memory/block_offload.py); and how many blocks are checkpointed (``checkpoint_blocks``): the others
keep their activations on the GPU and are not run again."""

from __future__ import annotations

import math
from typing import Any, Optional

from lightning_fpdt.planner.components import Component, MemoryPlan
from lightning_fpdt.planner.cost import block_forward_seconds, compute_seconds, copy_seconds, exposed_copy_seconds
from lightning_fpdt.planner.features.base import Flag, MemoryFeature, all_or_count, auto_or_int, switch
from lightning_fpdt.planner.features.tiled_mlp import mlp_backward_work
from lightning_fpdt.planner.plan_options import PlanOptions
from lightning_fpdt.planner.step_sizes import StepSizes

PLAIN_BLOCKS_ROOM = 6 * 2**30
"""GPU memory a plan with blocks not checkpointed leaves free beside them: their activations live through the step
among the transient buffers of every block, and the caching allocator needs room to keep reusing its blocks (filled
to the last GiB, a step now and then frees and retries allocations: Llama-3-8B on 4 H100s at 32,768 and 65,536 tokens,
one step in four 10-20% slower)."""
RELOAD_EXPOSED = 0.25
"""Share of the extra input copy of ``reload_input`` a block's backward waits for (the rest overlaps its end)."""


class BlockInputs(MemoryFeature):
    fields = ("activation_checkpointing", "activation_offload", "reload_input", "prefetch", "checkpoint_blocks")
    neutral = {"reload_input": False, "prefetch": 1, "checkpoint_blocks": "all"}
    flags = (
        Flag(option="reload_input", parse=switch, default="auto", bare=True,
             help="ActivationOffload(reload_input=...): auto, on (the same as no value), off; on: a block's input "
                  "stays on the host through its backward"),
        Flag(option="prefetch", parse=auto_or_int, default="auto",
             help="ActivationOffload(prefetch=...): block inputs brought back ahead (0: none), or auto"),
        Flag(option="checkpoint_blocks", parse=all_or_count("blocks"), default="auto",
             help="ActivationOffload(checkpoint_blocks=...): all, a number n of blocks checkpointed (the first ones; "
                  "the others keep their activations on the GPU and are not run again), or auto"),
    )

    def describe_cost(self, s: StepSizes) -> str:
        o = s.o
        return (f"block checkpointing: {s.checkpointed} block forwards recomputed"
                + (", inputs back without prefetch" if o.activation_offload and not o.prefetch else "")
                + (", inputs reloaded for their backward" if o.activation_offload and o.reload_input else ""))

    def choices(self, field: str, s: StepSizes) -> tuple[Any, ...]:
        if field == "checkpoint_blocks":
            return (0, "all")  # every block plain, from which relieve checkpoints as many as the GPU needs; all
        return (1, 0) if field == "prefetch" else (False, True)

    def normalise(self, changes: dict[str, Any]) -> Optional[dict[str, Any]]:
        if changes["activation_offload"] and not changes["activation_checkpointing"]:
            return None  # ActivationOffload checkpoints the blocks: counted once, as (True, True)
        if not changes["activation_offload"]:  # counted under the offload only
            changes.update(reload_input=False, prefetch=1)
        if not changes["activation_checkpointing"]:
            changes["checkpoint_blocks"] = "all"  # no block is checkpointed: the count means nothing
        elif changes["checkpoint_blocks"] != "all" and (
                changes["keep_inputs"] != "all" or changes["recompute_attention"] or changes["disk_inputs"]):
            return None  # plain blocks go with every input kept and the attention not recomputed
        return changes

    def components(self, s: StepSizes) -> list[Component]:
        o, L, A = s.o, s.L, s.A
        parts = []
        # every checkpointed block's input, or under partial residency the kept ones and one segment's regenerated ones
        held = s.resident_inputs * A
        count = ("k + ⌈L/k⌉ - 1" if o.keep_inputs != "all"
                 else "L" if s.checkpointed == L else "n (checkpoint_blocks)")
        if o.activation_offload:
            # the disk tier's share of them is its own component (features/disk_tier.py)
            parts.append(Component("checkpointed block inputs", 0, held - o.disk_inputs * A,
                                   formula=f"{count} on host (less those on disk); on the GPU by phase (block inputs)"))
            # the forward's: the block's and the one before on its way to the host; in a block's backward its own
            # (none under reload_input) and, from the end of its MLP backward, the next ``prefetch`` ones
            own, ahead, forward = (0 if o.reload_input else A), min(o.prefetch, L - 1) * A, min(2, L) * A
            for phase, gpu, formula in (
                ("attention forward", forward, "the block's + the one before, on its way to the host"),
                ("MLP backward", own, "the block's own (on the host under reload_input)"),
                ("attention backward", own + ahead, "own + the next ones, prefetched after the MLP backward"),
                ("loss", forward, "the last block's output and input"),
                ("end of backward", forward, "the first block's input gradient and input"),
            ):
                parts.append(Component(f"block inputs ({phase})", gpu, phase=phase, formula=formula))
        elif o.activation_checkpointing:
            parts.append(Component("checkpointed block inputs", held, formula=f"{count} x B·S/P·hidden"))
        else:
            parts.append(Component("activations (no checkpointing)", L * (A + s.layer),
                                   formula="L x (block input + layer activations)"))
        if s.plain_blocks:
            # blocks not checkpointed keep everything for their backward, from their forward (the last blocks: freed
            # in the first backwards, counted through the step); their MLPs run whole, so one of their backwards
            # holds all tokens' MLP buffers where a tiled MLP holds one tile's
            parts.append(Component("activations (blocks not checkpointed)", s.plain_blocks * (A + s.plain_layer),
                                   formula="(L - n) x (block input + layer activations, the MLP whole)"))
            whole = mlp_backward_work(s, tiled=False) - mlp_backward_work(s, tiled=o.tiled_mlp)
            parts.append(Component("MLP backward (a block not checkpointed)", max(0, whole), phase="MLP backward",
                                   formula="all tokens' MLP buffers beyond the tiled MLP's"))
            parts.append(Component("allocator room (blocks not checkpointed)", PLAIN_BLOCKS_ROOM,
                                   formula="room the caching allocator keeps beside long-lived activations"))
        # the recomputed layer, in its MLP backward and at its attention (without checkpointing: in "activations")
        checkpointed = o.activation_checkpointing
        # the recomputed output, if not kept; the per-head norms' inputs until their backward, after the attention's
        at_attention = s.norm + s.rope + (0 if s.out_kept else s.out) + (s.head_norm if s.G == 1 else 0)
        parts.append(Component("layer activations (recompute)", s.layer if checkpointed else 0, phase="MLP backward",
                               formula="norms, attention out, rope, MLP"))
        parts.append(Component("layer activations (at attention)", at_attention if checkpointed else 0,
                               phase="attention backward",
                               formula="first norm, rope (, attention output when recomputed, per-head norms' "
                               "inputs)"))
        return parts

    def extra_seconds(self, s: StepSizes) -> float:
        o = s.o
        if not o.activation_checkpointing:
            return 0.0
        # the recompute runs each checkpointed block's forward again: its GEMMs and elementwise ops (a tiled MLP's
        # value is skipped there, its backward recomputes the tiles: the same work; the attention: the attention
        # stash's term)
        seconds = s.checkpointed * block_forward_seconds(s)
        if o.activation_offload:
            # every input to the host in its block's forward and back in the backward, beside the blocks' compute;
            # without prefetch each comes back while its block waits; reload_input brings it back a second time
            inputs = s.checkpointed * s.A
            seconds += exposed_copy_seconds(s, (2 if o.prefetch else 1) * inputs, compute_seconds(s))
            seconds += (0 if o.prefetch else copy_seconds(s, inputs))
            seconds += RELOAD_EXPOSED * copy_seconds(s, inputs) if o.reload_input else 0.0
        return seconds

    def relieve(self, plan: MemoryPlan, s: StepSizes) -> Optional[dict[str, Any]]:
        """A plan with plain blocks over the GPU: checkpoint as many more as the overshoot needs (each one frees its
        activations, less its input where that stays on the GPU)."""
        o = s.o
        if not o.activation_checkpointing or o.checkpoint_blocks == "all" or plan.fits_gpu:
            return None
        freed = s.plain_layer + (s.A if o.activation_offload else 0)
        more = max(1, math.ceil((plan.peak_gpu_bytes - plan.gpu_memory_bytes) / max(1, freed)))
        count = o.checkpoint_blocks + more
        return {"checkpoint_blocks": "all" if count >= s.L else count}

    def arguments(self, s: StepSizes) -> dict[str, dict[str, Any]]:
        o = s.o
        if not o.activation_checkpointing:
            return {}
        if not o.activation_offload:  # (keep_inputs: the residency feature's)
            return {"ActivationOffload": {"offload": False, "checkpoint_blocks": o.checkpoint_blocks}}
        return {"ActivationOffload": {"reload_input": o.reload_input, "prefetch": o.prefetch,
                                      "checkpoint_blocks": o.checkpoint_blocks}}


def backward_reads(o: PlanOptions) -> int:
    """Times the backward reads each offloaded block input from where it waits (``o``: the plan's options): twice
    under ``reload_input`` (the recompute's copy, then the first norm's backward's), else once."""
    return 2 if o.activation_offload and o.reload_input else 1
