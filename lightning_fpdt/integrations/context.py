"""What the installed wrappers share with the strategy, and the pieces every model kind's install uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch.distributed as dist
from torch import Tensor, nn

from lightning_fpdt.integrations.attributes import ATTENTION_FN, ATTENTION_HANDLE
from lightning_fpdt.integrations.head_groups import HeadGroupedAttention
from lightning_fpdt.sequence.attention import FPDTAttention, LayerAttention
from lightning_fpdt.sequence.loss import sequence_parallel_loss


@dataclass
class SequenceParallelContext:
    """What the installed wrappers share with the strategy for the current batch (owned by the strategy)."""

    group: Optional[dist.ProcessGroup]
    """The sequence-parallel group the loss is reduced over (all ``P`` ranks, with or without a ring)."""
    attention: FPDTAttention
    position_ids: Optional[Tensor] = None
    """Global position ids of the local tokens of the current batch; injected when a model call omits them."""
    token_mask: Optional[Tensor] = None
    """``(B, S/P)``: which local tokens of the current batch are the batch's own (``False`` for the padding the
    strategy added); ``None`` when nothing is padded. Read by what counts tokens (a router's load-balancing loss)."""
    loss_reduced: bool = False
    """Set when the current batch's loss was reduced to the group mean (:meth:`reduce`), so the strategy does not
    re-weight it again; written only here."""

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks one sequence is split over (1 without a process group)."""
        if self.group is None or not dist.is_available() or not dist.is_initialized():
            return 1
        return dist.get_world_size(self.group)

    def begin_batch(self, plan: Any, *, offload: bool, offload_dq: bool) -> None:
        """A new batch, from its plan (a :class:`~lightning_fpdt.strategy.batch.BatchPlan`): the attention's layout,
        documents and offload, the batch's positions and token mask, its loss not reduced yet (the one hand-off of a
        batch from the strategy)."""
        self.attention.begin_batch(plan.layout, documents=plan.documents, offload=offload, offload_dq=offload_dq)
        self.position_ids, self.token_mask, self.loss_reduced = plan.position_ids, plan.token_mask, False

    def reduce(self, local_mean: Tensor, num_valid: Union[Tensor, int]) -> Tensor:
        """This rank's token-mean loss over its ``num_valid`` tokens as the group's token mean (collective)."""
        self.loss_reduced = True
        return sequence_parallel_loss(local_mean, num_valid, group=self.group)


def loss_reduction(context: SequenceParallelContext) -> Callable[[Tensor, Union[Tensor, int]], Tensor]:
    """``reduce(local_mean, num_valid)``: what an installed model calls to turn its local token-mean loss into the
    sequence group's (set on the model as ``fpdt_reduce_loss``; a tiled loss calls it too)."""
    return context.reduce


def inject_position_ids(model: nn.Module, context: SequenceParallelContext) -> None:
    """A call without ``position_ids`` gets the global ones of the current batch (local ``arange`` would be wrong)."""

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("position_ids") is None and context.position_ids is not None:
            kwargs["position_ids"] = context.position_ids
        return args, kwargs

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)


def installed_attentions(model: nn.Module) -> list[Union[LayerAttention, HeadGroupedAttention]]:
    """The attention handles installed in ``model``, one per attention layer: a module's ``attention_fn`` (the
    reference Llama) or ``_fpdt_attention`` (Hugging Face, head groups, intercepted SDPA blocks)."""
    handles = (getattr(module, name, None) for module in model.modules() for name in (ATTENTION_FN, ATTENTION_HANDLE))
    return [h for h in handles if isinstance(h, (LayerAttention, HeadGroupedAttention))]


def shared_attentions(model: nn.Module) -> list[FPDTAttention]:
    """The shared :class:`FPDTAttention` objects the installed handles of ``model`` call, in a stable order."""
    return sorted({handle.shared for handle in installed_attentions(model)}, key=id)
