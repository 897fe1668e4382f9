"""The sequence-parallel core: plain PyTorch, no Lightning, no model knowledge (docs/design.md §2)."""

from lightning_fpdt.sequence.all_to_all import all_to_all_head_to_seq, all_to_all_seq_to_head
from lightning_fpdt.sequence.attention import (
    FPDTAttention,
    LayerAttention,
    fpdt_attention,
    plan_attention,
    ring_attention,
)
from lightning_fpdt.sequence.blocks import check_heads, merge_partial
from lightning_fpdt.sequence.documents import DocumentBoundaries
from lightning_fpdt.sequence.heads import HeadSplit
from lightning_fpdt.sequence.kernels import make_kernel, supported_backends
from lightning_fpdt.sequence.layout import RingBlock, SequenceLayout
from lightning_fpdt.sequence.loss import IGNORE_INDEX, sequence_parallel_loss, shift_labels, token_cross_entropy
from lightning_fpdt.sequence.options import FPDTOptions
from lightning_fpdt.sequence.ring import RingComm, new_sequence_groups
from lightning_fpdt.sequence.sizes import check_head_groups
from lightning_fpdt.sequence.ulysses import ulysses_attention

__all__ = [
    "IGNORE_INDEX",
    "DocumentBoundaries",
    "FPDTAttention",
    "FPDTOptions",
    "HeadSplit",
    "LayerAttention",
    "RingBlock",
    "RingComm",
    "SequenceLayout",
    "all_to_all_head_to_seq",
    "all_to_all_seq_to_head",
    "check_head_groups",
    "check_heads",
    "fpdt_attention",
    "make_kernel",
    "merge_partial",
    "new_sequence_groups",
    "plan_attention",
    "ring_attention",
    "sequence_parallel_loss",
    "shift_labels",
    "supported_backends",
    "token_cross_entropy",
    "ulysses_attention",
]
