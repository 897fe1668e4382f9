"""Gradient accumulation (``Trainer(accumulate_grad_batches=A)``, ``A > 1``): where the gradients of a window wait
between its batches (``FPDTStrategy(sync_every_batch=...)``).

- ``sync_every_batch=False``: the batches before a window's last skip FSDP2's reduce-scatter (its gradient sync
  off); every unit adds into its unsharded gradients, in the reduce dtype, on the GPU, and these take the shards'
  place (set to None at the window's first batch) until the last batch reduce-scatters them: ``Θ · reduce`` bytes on
  every GPU, not divided by the GPUs (Llama-3-8B: 32 GB in fp32; the trainable parameters' only). One reduce-scatter
  per optimizer step.
- ``sync_every_batch=True``: every batch reduce-scatters, and FSDP2 adds the result into the shards, which then live
  through every phase of the window's later batches, the shard of the block in backward beside the output of its
  reduce-scatter: the memory of a step without accumulation, plus that block's shard. ``A - 1`` more reduce-scatters
  per window (with the states on the host each also a copy to the host and an add there).

The shards' own terms without accumulation are :mod:`.host_states`'.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_fpdt.planner.components import Component
from lightning_fpdt.planner.cost import link_rate
from lightning_fpdt.planner.features.base import Flag, MemoryFeature, switch
from lightning_fpdt.planner.step_sizes import StepSizes


class GradientAccumulation(MemoryFeature):
    fields = ("sync_every_batch",)
    label = "gradients reduce-scattered after every batch of the accumulation window"
    neutral = {"sync_every_batch": False}
    flags = (Flag(option="sync_every_batch", parse=switch, default="auto",
                  help="FPDTStrategy(sync_every_batch=...), with --accumulate-grad-batches above 1: auto, on (every "
                       "batch reduce-scatters into the shards), off (only a window's last: every parameter's "
                       "unsharded gradient waits on every GPU)"),)

    def normalise(self, changes: dict[str, Any]) -> Optional[dict[str, Any]]:
        if changes["accumulate_grad_batches"] == 1:
            changes["sync_every_batch"] = False  # every batch is a window's last: it reduce-scatters anyway
        return changes

    def components(self, s: StepSizes) -> list[Component]:
        o, d, W = s.o, s.dtypes, s.W
        if o.accumulate_grad_batches == 1:
            return []
        if not o.sync_every_batch:
            return [Component("accumulated gradients (unsharded)", d["reduce"] * s.trainable_parameters,
                              formula="every parameter's gradient, unsharded, in the reduce dtype")]
        if o.cpu_offload_params:
            return []  # the shards accumulate in host memory: the states' pageable gradients
        shards = d["grad"] * s.trainable_parameters // W
        own = d["grad"] * s.trainable_block_parameters // W
        return [Component("accumulated gradient shards", shards, formula="every parameter's shard, all phases")] + [
            Component(f"reduce-scatter output ({phase})", own, phase=phase,
                      formula="the block in backward's new shard, before it is added into its shard")
            for phase in ("MLP backward", "attention backward")]

    def extra_seconds(self, s: StepSizes) -> float:
        o = s.o
        if o.accumulate_grad_batches == 1 or not o.sync_every_batch:
            return 0.0
        # per batch: the share of a window's batches that reduce-scatter only because of this option
        extra_share = (o.accumulate_grad_batches - 1) / o.accumulate_grad_batches
        sent = s.dtypes["reduce"] * s.trainable_parameters * (s.W - 1) / s.W
        seconds = sent / link_rate(s, crosses_hosts=s.hosts > 1)
        if o.cpu_offload_params:
            shard = s.dtypes["grad"] * s.trainable_parameters / s.W
            seconds += shard / s.rates.pageable_copy_bytes + shard / s.rates.host_step_bytes  # out, added there
        return extra_share * seconds

    def arguments(self, s: StepSizes) -> dict[str, dict[str, Any]]:
        if s.o.accumulate_grad_batches == 1:
            return {}
        return {"FPDTStrategy": {"sync_every_batch": s.o.sync_every_batch}}
