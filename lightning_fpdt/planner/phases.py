"""The phases of a step as the formula sheet writes them (:mod:`lightning_fpdt.planner.components`), one function
each, and the plan that adds them to the memory features' own terms (:mod:`lightning_fpdt.planner.features`)."""

from __future__ import annotations

from typing import Optional

from lightning_fpdt.flops import ModelGeometry
from lightning_fpdt.planner.components import Component, MemoryPlan, attention_backward_bytes
from lightning_fpdt.planner.features import FEATURES
from lightning_fpdt.planner.plan_options import PlanOptions
from lightning_fpdt.planner.rates import BUILTIN_RATES, INTER_HOST_BYTES, StepRates
from lightning_fpdt.planner.step_sizes import StepSizes
from lightning_fpdt.sequence.layout import SequenceLayout
from lightning_fpdt.sequence.planning import working_set_bytes

PHASES = (None, "attention forward", "MLP backward", "attention backward", "loss", "end of backward")
"""Persistent (``None``) first, then the transient phases in step order: the order of a plan's table."""
PROCESS_BASELINE_BYTES = 3 * 2**30
"""Host memory of one training process before any buffer of the step: Python, torch, CUDA's context and its own
pinned staging, Lightning, transformers (``bench.memory_trace`` on an H200: the resident memory of a process at its
first step, less what the plan counts). The strategy measures its own instead."""


def attention_forward(s: StepSizes) -> list[Component]:
    """The layer's input norm, q, k, v, out and the FPDT working set of one chunk; with head groups one group's q, k,
    v, out and working set, and the hidden-sized output sum the groups add into."""
    working_set = working_set_bytes(s.attention, num_chunks=s.o.chunks, **s.size, **s.ring)
    if s.G == 1:
        return [Component("attention forward", s.norm + s.qkv + s.out + working_set, phase="attention forward",
                          formula="norm + q, k, v, out + planning.working_set_bytes")]
    return [Component("attention forward", s.norm + s.A + (s.qkv + s.out) // s.G + working_set,
                      phase="attention forward",
                      formula="norm + output sum + one group's q, k, v, out and working set")]


def attention_backward(s: StepSizes) -> list[Component]:
    """The gradients around the attention and the FPDT backward's chunks (``attention_backward_bytes``)."""
    o = s.o
    chunks = attention_backward_bytes(s.attention, num_chunks=o.chunks, offload=o.offload, offload_dq=o.offload_dq,
                                      **s.size, **s.ring)
    if s.G == 1:
        # the residual stream's gradient and the attention output's; under checkpointing also a hidden-sized output
        # of the block's recompute that lives until the block's backward ends (measured: bench/memory_trace.py)
        grads = s.A + s.out + (s.A if o.activation_checkpointing else 0)
        return [Component("attention backward", grads + s.qkv + chunks, phase="attention backward",
                          formula="grads + dq, dk, dv + FPDT backward chunks")]
    # a group's backward (integrations/head_groups.py) holds no other hidden-sized tensor but the gradient into the
    # block (held until the block's backward returns): the output projection is differentiated by hand and the
    # q/k/v projections' input gradients are added into dx in place; at its peak (RoPE's backward of dq) the group's
    # dout, dq and rotated dq, dk and dv are alive: (2·out + qkv)/G, and where each head's q and k are normalised the
    # group's norm inputs
    return [Component("attention backward", 3 * s.A + (2 * s.out + s.qkv + s.head_norm) // s.G + chunks,
                      phase="attention backward",
                      formula="grad into the block + output grad + running input grad + one group's dout, dq and its "
                      "rotation, dk, dv (and per-head norm inputs) + its FPDT backward chunks")]


def gathered_states(s: StepSizes) -> list[Component]:
    """The parts of the states that exist in some phases only: the root unit gathered, the current and prefetched
    block gathered, one block's unsharded gradients and their reduce-scatter copy, the unsharded lm_head gradient, in
    the loss the head or the last all-gather's output, and at the end of the backward the root unit's own
    backward."""
    d, V, h = s.dtypes, s.g.vocab_size, s.g.hidden_size
    block, rest = s.block_parameters, s.rest_parameters
    # an untied head that computes the tiled loss is its own FSDP2 unit (strategy/parallelize.py): gathered in the
    # loss only, and out of the root unit
    head_unit = s.o.tiled_loss and not s.g.tie_word_embeddings
    head = V * h * head_unit
    gathered_root = d["param"] * (rest - head)
    # FSDP2 keeps the root unit gathered from the forward's start to its post-backward, which frees it before its
    # reduce-scatter (end of backward, below)
    parts = [Component(f"gathered root unit ({phase})", gathered_root, phase=phase,
                       formula="the root unit unsharded, forward to its post-backward")
             for phase in ("attention forward", "MLP backward", "attention backward", "loss")]
    parts += [Component(f"gathered blocks ({phase})", 2 * d["param"] * block, phase=phase,
                        formula="current + prefetched")
              for phase in ("attention forward", "MLP backward", "attention backward")]
    trained_block, trained_rest = s.trainable_block_parameters, s.trainable_rest_parameters
    parts += [Component(f"block gradients ({phase})", trained_block * (d["param"] + d["reduce"]), phase=phase,
                        formula="one block unsharded + its reduce-scatter copy")
              for phase in ("MLP backward", "attention backward")]
    head_trains = trained_rest > 0  # LoRA: no weight of the root unit trains, its gradients are never made
    if head_unit:
        # the head's unsharded gradient is copied into its reduce-scatter input right after the loss's backward; that
        # input stays alive until the next unit's reduce-scatter, through the last block's backward (traced with
        # host-resident states: the same peak, 40.72 GiB, as with the head in the root unit, whose gathered weight
        # and gradient, V·h·(2 + 2) in bf16, it replaces)
        parts += [Component(f"lm_head reduce-scatter input ({phase})", V * h * d["reduce"] * head_trains, phase=phase,
                            formula="V·hidden in the reduce dtype, from the loss's backward through the last block's")
                  for phase in ("MLP backward", "attention backward")]
        parts.append(Component("gathered head (loss)", d["param"] * head, phase="loss",
                               formula="the head unit unsharded, from its forward to its backward"))
    else:
        parts += [Component(f"lm_head gradient ({phase})", V * h * s.b * head_trains, phase=phase,
                            formula="V·hidden, unsharded from the loss's backward to the root's reduce-scatter")
                  for phase in ("MLP backward", "attention backward", "end of backward")]
    # in the forward FSDP2 frees each all-gather's output only at the next unit's all-gather, the last one's at the
    # root's post-forward: through the loss, which the root's forward computes. The last unit is the last block, or
    # the head unit, whose all-gather output then lives beside its gathered weight. One GPU gathers nothing. (Traced
    # on two H100s and two H200s, Llama-3-8B, 16,384 tokens: 0.40 GiB beyond the other loss terms; with the head a
    # unit, measured on four H200s at 32,768 tokens: the peak in the loss 0.58 GiB higher, V·h − one block.)
    if s.W > 1:
        parts.append(Component("last all-gather output (loss)", d["param"] * (head or block), phase="loss",
                               formula="the last unit gathered in the forward, freed after the loss"))
    # the root unit's own backward: first the embedding's, its gradient beside the gathered root; then its
    # post-backward frees the gathered parameters and, once copied into the reduce-scatter input, the unsharded
    # gradients (the trace at that reduce-scatter: its input and output and the lm_head gradient, counted above)
    # which of the root's and the head's parameters train is not known from a count: the root's reduce-scatter is
    # taken as large as the count allows (the head's term above assumes it trains whenever any of them does)
    trained_root = min(trained_rest, rest - head)
    embedding_backward = gathered_root + V * h * s.b * (not s.g.tie_word_embeddings and head_trains)
    reduce_scatter = trained_root * d["reduce"] + trained_root * d["reduce"] // s.W
    parts.append(Component("root unit's backward",
                           max(embedding_backward, reduce_scatter), phase="end of backward",
                           formula="max(gathered root + V·hidden, root unit in reduce dtype · (1 + 1/W))"))
    return parts


def position_embeddings(s: StepSizes) -> list[Component]:
    """The rotary tables a Hugging Face model computes once per forward, outside its blocks: cos and sin in the
    activation dtype and their fp32 frequencies, inputs of every checkpointed block, alive through the step (traced on
    an H100: 0.125 GiB for the Llama-3.2-3B geometry at 131,072 tokens). A model that rotates inside its blocks (the
    reference Llama) holds less."""
    return [Component("position embeddings (model level)", s.N * s.g.head_dim * (2 * s.b + 4),
                      formula="cos, sin (activation dtype) + fp32 frequencies, N x D")]


def process_baseline(host_baseline_bytes: int) -> list[Component]:
    """The process itself: libraries, the CUDA context, everything resident before the step's buffers."""
    return [Component("process baseline", 0, pageable_bytes=host_baseline_bytes,
                      formula="Python, torch, CUDA context: resident before the step")]


def components(geometry: ModelGeometry, options: PlanOptions, *, seq_len: int, batch_size: int, num_gpus: int,
               host_baseline_bytes: int = PROCESS_BASELINE_BYTES) -> list[Component]:
    """Every component of one step: the phases' and the memory features', persistent first, then by phase."""
    s = StepSizes(geometry, options, seq_len, batch_size, num_gpus)
    parts = process_baseline(host_baseline_bytes)
    for feature in FEATURES:
        parts += feature.components(s)
    parts += position_embeddings(s) + attention_forward(s) + attention_backward(s) + gathered_states(s)
    return sorted(parts, key=lambda c: PHASES.index(c.phase))


def build_plan(
    geometry: ModelGeometry, model: str, *, seq_len: int, batch_size: int, num_gpus: int, gpus_per_node: int,
    options: PlanOptions, gpu_memory_bytes: int, host_memory_bytes: Optional[int],
    host_baseline_bytes: int = PROCESS_BASELINE_BYTES, disk_memory_bytes: Optional[int] = None,
    disk_bytes_per_second: float = 0.0, inter_host_bytes_per_second: float = INTER_HOST_BYTES,
    rates: StepRates = BUILTIN_RATES,
) -> MemoryPlan:
    """The plan of these resolved options: the components of the padded sequence and the limits."""
    padded = padded_length(options, seq_len)
    parts = components(geometry, options, seq_len=padded, batch_size=batch_size, num_gpus=num_gpus,
                       host_baseline_bytes=host_baseline_bytes)
    return MemoryPlan(
        model=model, geometry=geometry, seq_len=seq_len, padded_seq_len=padded, batch_size=batch_size,
        num_gpus=num_gpus, gpus_per_node=gpus_per_node, options=options, components=tuple(parts),
        gpu_memory_bytes=gpu_memory_bytes, host_memory_bytes=host_memory_bytes, disk_memory_bytes=disk_memory_bytes,
        disk_bytes_per_second=disk_bytes_per_second, inter_host_bytes_per_second=inter_host_bytes_per_second,
        rates=rates,
    )


def run_sizes(geometry: ModelGeometry, options: PlanOptions, *, seq_len: int, batch_size: int, num_gpus: int,
              gpus_per_node: int, disk_bytes_per_second: float,
              inter_host_bytes_per_second: float = INTER_HOST_BYTES, rates: StepRates = BUILTIN_RATES) -> StepSizes:
    """The sizes of a run with these options: of its padded sequence, its host's disk rate shared by the host's GPUs,
    its hosts and the rate between them, and the rates its step is timed at."""
    return StepSizes(geometry, options, padded_length(options, seq_len), batch_size, num_gpus,
                     disk_rate=disk_bytes_per_second / gpus_per_node, hosts=num_gpus // gpus_per_node,
                     inter_host_rate=inter_host_bytes_per_second, rates=rates)


def plan_sizes(plan: MemoryPlan) -> StepSizes:
    """The sizes of a plan (:func:`run_sizes` of its run and options)."""
    return run_sizes(plan.geometry, plan.options, seq_len=plan.seq_len, batch_size=plan.batch_size,
                     num_gpus=plan.num_gpus, gpus_per_node=plan.gpus_per_node,
                     disk_bytes_per_second=plan.disk_bytes_per_second,
                     inter_host_bytes_per_second=plan.inter_host_bytes_per_second, rates=plan.rates)


def padded_length(options: PlanOptions, seq_len: int) -> int:
    """``S`` padded as the strategy pads it, to a multiple of ``P·u`` (with a ring, of its block count)."""
    layout = SequenceLayout(options.sequence_parallel_size, 0, options.chunks, ring_size=options.ring_size)
    return layout.padded_length(seq_len)
