"""The quantities of the planner's formula sheet (:mod:`lightning_fpdt.planner.components`), computed once per plan.

Every phase function and every memory feature reads its sizes from one :class:`StepSizes`, so a symbol of the sheet
(``N``, ``A``, ``norm``, ``layer``, ...) has one definition in code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

from lightning_fpdt.flops import ModelGeometry
from lightning_fpdt.memory.block_schedule import largest_segment
from lightning_fpdt.planner.geometry import PRECISIONS, attention_geometry, parameter_counts, total_parameters
from lightning_fpdt.planner.plan_options import PlanOptions
from lightning_fpdt.planner.rates import BUILTIN_RATES, INTER_HOST_BYTES, StepRates
from lightning_fpdt.sequence.planning import AttentionGeometry, grouped_geometry, rank_heads

ROPE_TABLES = 2
"""fp32 ``(B, N, D)`` tables a layer holds for backward: cos and sin."""


@dataclass(frozen=True)
class StepSizes:
    """One step's sizes per GPU: the geometry ``g``, the resolved options ``o`` and what follows from them."""

    g: ModelGeometry
    o: PlanOptions
    seq_len: int
    """``S``, padded to a multiple of ``P·u``."""
    batch_size: int
    num_gpus: int
    disk_rate: float = 0.0
    """Bytes per second one GPU's process reads or writes on the disk tier (its host's disk rate shared by the host's
    GPUs); 0: no disk tier."""
    hosts: int = 1
    """Hosts the GPUs are spread over: collectives over all of them (the gradients' reduce-scatter) leave the host
    when there are several."""
    inter_host_rate: float = INTER_HOST_BYTES
    """Bytes per second one GPU sends to GPUs of other hosts (``plan_memory(inter_host_gbps=...)``)."""
    rates: StepRates = BUILTIN_RATES
    """The rates the step is timed at (:mod:`lightning_fpdt.planner.cost`)."""

    @property
    def gpus_per_node(self) -> int:
        """GPUs of one host: a sequence-parallel group larger than that spans hosts."""
        return self.num_gpus // self.hosts

    @property
    def dtypes(self) -> dict[str, int]:
        """Bytes of the master weights, compute weights, gradients, reduce-scatter copies, activations."""
        return PRECISIONS[self.o.precision]

    @property
    def b(self) -> int:
        """Bytes of one activation element."""
        return self.dtypes["act"]

    @property
    def L(self) -> int:  # noqa: N802 (the sheet's symbol)
        return self.g.num_layers

    @property
    def P(self) -> int:  # noqa: N802
        return self.o.sequence_parallel_size

    @property
    def W(self) -> int:  # noqa: N802
        return self.num_gpus

    @property
    def G(self) -> int:  # noqa: N802
        return self.o.head_chunks

    @property
    def N(self) -> int:  # noqa: N802
        """Local tokens ``B·S/P``."""
        return self.batch_size * self.seq_len // self.P

    @property
    def A(self) -> int:  # noqa: N802
        """One hidden-state tensor ``N·h·b``."""
        return self.N * self.g.hidden_size * self.b

    @property
    def attn_width(self) -> int:
        return self.g.num_heads * self.g.head_dim

    @cached_property
    def attention_heads(self) -> int:
        """Query heads as the attention's time counts them: ``P/R`` times the busiest Ulysses rank's (``H`` when the
        heads split evenly; ``P·⌈H/P⌉`` otherwise, each head group's split counted)."""
        ulysses = self.P // self.o.ring_size
        return rank_heads(self.attention, ulysses)[0] * ulysses * self.G

    @property
    def out(self) -> int:
        """One attention output ``N·H·D·b``."""
        return self.N * self.attn_width * self.b

    @property
    def qkv(self) -> int:
        """Full-width q, k and v: ``N·(H + 2·Hkv)·D·b``."""
        return self.N * (self.g.num_heads + 2 * self.g.num_kv_heads) * self.g.head_dim * self.b

    @cached_property
    def block_parameters(self) -> int:
        """``Θ_block``."""
        return parameter_counts(self.g)[0]

    @cached_property
    def rest_parameters(self) -> int:
        """``Θ_rest``: embedding, lm_head unless tied, final norm (FSDP2's root unit)."""
        return parameter_counts(self.g)[1]

    @cached_property
    def total_parameters(self) -> int:
        """``Θ``."""
        return total_parameters(self.g)

    @cached_property
    def trainable_parameters(self) -> int:
        """``Θ_train``: the parameters with gradients and optimizer states (``PlanOptions.trainable_parameters``, at
        most ``Θ``)."""
        trainable = self.o.trainable_parameters
        return self.total_parameters if trainable is None else min(trainable, self.total_parameters)

    @cached_property
    def trainable_block_parameters(self) -> int:
        """``Θ_train`` of one block: the trainable parameters spread over the blocks first, ``Θ_block`` at most (the
        adapters of LoRA sit in the blocks; a frozen embedding leaves every block whole)."""
        return min(self.block_parameters, self.trainable_parameters // self.L)

    @cached_property
    def trainable_rest_parameters(self) -> int:
        """``Θ_train`` of the root unit: what the blocks do not hold, ``Θ_rest`` at most."""
        return min(self.rest_parameters, self.trainable_parameters - self.L * self.trainable_block_parameters)

    @cached_property
    def attention(self) -> AttentionGeometry:
        """The attention calls as ``sequence.planning`` counts them: ``L·G`` calls of one head group each."""
        return grouped_geometry(attention_geometry(self.g, self.b), self.G)

    @property
    def size(self) -> dict[str, int]:
        """The ``batch_size, seq_len, sp_size`` keywords of ``sequence.planning``."""
        return dict(batch_size=self.batch_size, seq_len=self.seq_len, sp_size=self.P)

    @property
    def ring(self) -> dict[str, int]:
        return dict(ring_size=self.o.ring_size)

    @property
    def resident_inputs(self) -> int:
        """Block inputs held at once for their backwards: ``L``, or with ``keep_inputs = k`` the kept ones and the
        largest segment regenerated at once, ``k + ⌈L/k⌉ - 1`` (``memory.block_schedule.largest_segment``)."""
        k = self.o.keep_inputs
        if k == "all":  # every checkpointed block's (those left plain hold theirs in their activations)
            return self.checkpointed if self.o.activation_checkpointing else self.L
        return k + largest_segment(self.L, k)

    @property
    def checkpointed(self) -> int:
        """Blocks checkpointed: ``L``, or the first ``checkpoint_blocks`` of them; 0 without checkpointing."""
        o = self.o
        if not o.activation_checkpointing:
            return 0
        return self.L if o.checkpoint_blocks == "all" else min(o.checkpoint_blocks, self.L)

    @property
    def plain_blocks(self) -> int:
        """Blocks checkpointing leaves plain (``checkpoint_blocks``): their activations wait on the GPU, their MLPs
        whole; 0 without checkpointing (every block's activations are then the no-checkpointing term)."""
        return self.L - self.checkpointed if self.o.activation_checkpointing else 0

    # ---- what one layer keeps for its backward -------------------------------------------------------------------
    @property
    def norm(self) -> int:
        """The tiled RMSNorm's output and one fp32 rstd per token: ``A + N·4``."""
        return self.A + self.N * 4

    @property
    def head_norm(self) -> int:
        """What per-head RMSNorms of q and k keep for backward (``ModelGeometry.head_norms``): their inputs and one
        fp32 rstd per token and head, ``N·(H + Hkv)·(D·b + 4)``; 0 without them."""
        if not self.g.head_norms:
            return 0
        return self.N * (self.g.num_heads + self.g.num_kv_heads) * (self.g.head_dim * self.b + 4)

    @property
    def rope(self) -> int:
        """RoPE's fp32 cos and sin tables."""
        return ROPE_TABLES * self.N * self.g.head_dim * 4

    @property
    def mlp_saved(self) -> int:
        """What an untiled gated MLP saves: ``4·N·I·b`` (a tiled one saves only its input)."""
        return 0 if self.o.tiled_mlp else 4 * self.N * self.g.intermediate_size * self.b

    @property
    def out_kept(self) -> bool:
        """Whether a stash on the GPU holds the attention output (head groups; checkpointed first-pass outputs not
        offloaded): then the layer's replay takes it from there and the layer does not count it again. An offloaded
        stash holds it on the host, and the layer's replay brings it back to the GPU."""
        o = self.o
        return self.G > 1 or (o.activation_checkpointing and not o.recompute_attention and not o.offload)

    @property
    def layer(self) -> int:
        """One layer's activations for its backward: two norms, the residual between them, RoPE's tables and the
        per-head norms' inputs (not with head groups, whose backward runs each group's projections again), the
        attention output unless kept, the untiled MLP's saved tensors. A checkpoint's recompute frees the block's own
        output before its backward (memory/block_offload.py)."""
        return (2 * self.norm + self.A + (self.rope + self.head_norm if self.G == 1 else 0)
                + (0 if self.out_kept else self.out) + self.mlp_saved)

    @property
    def plain_layer(self) -> int:
        """:attr:`layer` of a block that is not checkpointed: nothing recorded by the attention, the MLP whole."""
        return self.with_options(activation_checkpointing=False, activation_offload=False, recompute_attention=False,
                                 keep_inputs="all", disk_inputs=0, checkpoint_blocks="all", tiled_mlp=False).layer

    def with_options(self, **changes: object) -> "StepSizes":
        """The same step with some options changed."""
        return dataclasses.replace(self, o=dataclasses.replace(self.o, **changes))
