"""The reference Llama (``lightning_fpdt.models.llama``) under the fpdt strategy.

Its attention modules call ``self.attention_fn``, which is pointed at the FPDT attention (or, with head groups, the
whole attention module runs per group); its ``loss`` becomes the sequence group's token mean of its local loss.
"""

from __future__ import annotations

from typing import Literal, Union

from torch import Tensor, nn

from lightning_fpdt.integrations.attributes import (
    ATTENTION_FN,
    DOCUMENTS_FROM_POSITIONS,
    LABELS_ARE_SHIFTED,
    LOCAL_LOSS,
    LOSS,
    REDUCE_LOSS,
)
from lightning_fpdt.integrations.context import SequenceParallelContext, inject_position_ids, loss_reduction
from lightning_fpdt.integrations.head_groups import install_head_groups
from lightning_fpdt.integrations.head_loss import give_head_the_loss
from lightning_fpdt.memory.tiled_loss import tiled_cross_entropy
from lightning_fpdt.models.llama import LlamaAttention, LlamaForCausalLM
from lightning_fpdt.sequence.loss import IGNORE_INDEX


def is_reference_llama(model: nn.Module) -> bool:
    return isinstance(model, LlamaForCausalLM)


def install_reference_llama(model: nn.Module, context: SequenceParallelContext) -> None:
    """Point every attention of a reference Llama at the FPDT attention; make its loss the group mean."""
    for module in model.modules():
        if isinstance(module, LlamaAttention):
            if context.attention.head_chunks > 1:
                install_head_groups(module, context.attention)  # projections and attention per head group
            else:
                setattr(module, ATTENTION_FN, context.attention.for_layer())
    setattr(model, LABELS_ARE_SHIFTED, True)  # the strategy shifts labels on the global sequence before sharding
    setattr(model, DOCUMENTS_FROM_POSITIONS, False)  # the strategy finds packed documents on the global batch
    setattr(model, REDUCE_LOSS, loss_reduction(context))
    # the local loss is looked up at call time, so a later transform (TiledLoss) can replace it
    setattr(model, LOCAL_LOSS, model.loss)

    def loss(hidden: Tensor, targets: Tensor) -> Tensor:
        local_mean = getattr(model, LOCAL_LOSS)(hidden, targets)
        return getattr(model, REDUCE_LOSS)(local_mean, (targets != IGNORE_INDEX).sum())

    setattr(model, LOSS, loss)
    inject_position_ids(model, context)


def tile_reference_llama_loss(model: nn.Module, num_tiles: Union[Literal["auto"], int]) -> None:
    """Compute the reference Llama's local loss with ``tiled_cross_entropy`` (its ``fpdt_local_loss`` under the
    strategy, else its ``loss``)."""

    head = None if model.config.tie_word_embeddings else model.lm_head
    if head is not None and give_head_the_loss(head, num_tiles):
        def local_loss(hidden: Tensor, targets: Tensor) -> Tensor:
            return head(hidden, targets)[0]  # in the head's forward: FSDP2 gathers it there, as its own unit or not
    else:
        def local_loss(hidden: Tensor, targets: Tensor) -> Tensor:
            # output_weight: the embedding table when tied; under FSDP2 this runs inside the model's forward, where
            # the model's own (non-block) parameters are gathered
            return tiled_cross_entropy(hidden, model.output_weight, targets, num_tiles=num_tiles)[0]

    # under the strategy its installed loss reduces fpdt_local_loss (looked up at call time); alone, `loss` is it
    setattr(model, LOCAL_LOSS if hasattr(model, LOCAL_LOSS) else LOSS, local_loss)
