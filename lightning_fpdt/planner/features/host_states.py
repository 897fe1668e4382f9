"""Where the sharded states live: the GPU, or the host (``FPDTStrategy(cpu_offload_params=True)``, FSDP2's
``CPUOffloadPolicy``).

On the host the fp32 master weights are page-locked, each exactly its size (the strategy registers FSDP2's shards
itself, ``lightning_fpdt.offload.host_memory``), so the GPU copies them in asynchronously; the gradients arrive in
pageable memory (the optimizer steps them on the host as they land) and the optimizer's moments are pageable too.
"""

from __future__ import annotations

from typing import Any

from lightning_fpdt.planner.components import Component
from lightning_fpdt.planner.features.base import Flag, MemoryFeature
from lightning_fpdt.planner.geometry import OPTIMIZER_STATES
from lightning_fpdt.planner.step_sizes import StepSizes


class HostStates(MemoryFeature):
    fields = ("cpu_offload_params",)
    label = "states on the host: weights in, gradients out, the optimizer step on the CPU"
    flags = (Flag(option="cpu_offload_params", parse=None, default=False, help="FSDP2 CPUOffloadPolicy"),)

    def components(self, s: StepSizes) -> list[Component]:
        d, W, on_host = s.dtypes, s.W, s.o.cpu_offload_params
        master = d["master"] * s.total_parameters // W
        # only the trainable parameters have gradients and optimizer states (frozen ones: none, nor FSDP2 shards)
        block_grads = d["grad"] * s.L * s.trainable_block_parameters // W
        accumulating = s.o.accumulate_grad_batches > 1
        own_grads = d["grad"] * s.trainable_block_parameters // W  # the shard of the block in backward
        root_grads = d["grad"] * s.trainable_rest_parameters // W
        moments = OPTIMIZER_STATES[s.o.optimizer] * d["master"] * s.trainable_parameters // W
        parts = [
            Component("parameters", 0 if on_host else master, master if on_host else 0, formula="sharded master"),
            # the blocks' sharded gradients. Lightning's zero_grad (set to None) runs after the forward and the loss,
            # so the last step's are all alive through them; in the backward a block's shard comes into being at its
            # reduce-scatter, after its backward: at the peak, the first block's backward, the others' exist, its own
            # not (by phase, below). The root unit's exist from its reduce-scatter at the end of the backward.
            Component("gradients", 0 if on_host or accumulating else block_grads - own_grads,
                      formula="blocks' shards, but for the block in backward",
                      pageable_bytes=block_grads + root_grads if on_host else 0),
            Component("optimizer states", 0 if on_host else moments,
                      formula=f"{OPTIMIZER_STATES[s.o.optimizer]} x sharded master of the trainable parameters",
                      pageable_bytes=moments if on_host else 0),
        ]
        if s.o.other_parameters:
            # the models beside the planned one (a frozen reference, a value head): their weights, and for what of
            # them trains its gradients and optimizer states, all sharded alike
            other = (d["master"] * s.o.other_parameters + (d["grad"] + OPTIMIZER_STATES[s.o.optimizer] * d["master"])
                     * s.o.other_trainable_parameters) // W
            parts.append(Component("other models' states", 0 if on_host else other,
                                   formula="sharded weights beside the planned model (+ gradients and optimizer "
                                           "states of what of them trains)",
                                   pageable_bytes=other if on_host else 0))
        if accumulating:
            return parts  # the gradients of an accumulation window: features/accumulation.py
        parts += [Component(f"root gradients ({phase})", 0 if on_host else root_grads, phase=phase,
                            formula="the last step's sharded root-unit gradients, alive until zero_grad")
                  for phase in ("attention forward", "loss")]
        parts += [Component(f"block gradients, the last ({phase})", 0 if on_host else own_grads, phase=phase,
                            formula="the shard of the block whose backward comes first or has ended")
                  for phase in ("attention forward", "loss", "end of backward")]
        return parts

    def extra_seconds(self, s: StepSizes) -> float:
        if not s.o.cpu_offload_params:
            return 0.0
        shard = s.dtypes["master"] * s.total_parameters // s.W
        trained = s.dtypes["master"] * s.trainable_parameters // s.W
        # the weights copied in twice (forward, backward), the gradients out, the optimizer's passes on the host
        r = s.rates
        return 2 * shard / r.copy_bytes + trained / r.pageable_copy_bytes + 4 * trained / r.host_step_bytes

    def arguments(self, s: StepSizes) -> dict[str, dict[str, Any]]:
        return {"FPDTStrategy": {"cpu_offload_params": True}} if s.o.cpu_offload_params else {}
