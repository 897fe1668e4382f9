"""The loss of a training step under the fpdt strategy: each rank's token mean becomes the sequence's, a step with
a non-finite loss stops every rank together, a step without any target is named (docs/design.md §5.3, §5.9)."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_fpdt.sequence.loss import IGNORE_INDEX, is_sequence_level, token_counts, token_sums
from lightning_fpdt.sequence.loss import sequence_mean as group_sequence_mean
from lightning_fpdt.sequence.loss import sequence_sum as group_sequence_sum


def unwrap_loss(output: object) -> Optional[Tensor]:
    """The loss tensor of a training_step output (a tensor, or a mapping with ``"loss"``)."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict):
        return output.get("loss")
    return None


def with_loss(output: Any, loss: Tensor) -> Any:
    """``output`` with its loss replaced by ``loss``."""
    return loss if isinstance(output, Tensor) else {**output, "loss": loss}


def fpdt_strategy_of(owner: Any) -> Optional[Any]:
    """The fpdt strategy behind ``owner``: a LightningModule attached to a Trainer (its ``trainer.strategy``), a
    ``Fabric`` (its ``strategy``) or a strategy itself, when it reduces over a sequence group (``reduce_loss``);
    ``None`` otherwise (one process holds the whole sequence)."""
    try:
        strategy = owner.trainer.strategy
    except (AttributeError, RuntimeError):  # not a LightningModule, or one not attached to a Trainer
        strategy = getattr(owner, "strategy", owner)
    return strategy if callable(getattr(strategy, "reduce_loss", None)) else None


def is_reduced(loss: Tensor, context: Any) -> bool:
    """Whether a step's ``loss`` is the sequence's already, so the strategy leaves it: a loss with a graph when it is
    built from the group's values (:func:`~lightning_fpdt.sequence.loss.is_sequence_level`: a model's own loss, a DPO
    loss of ``sequence_sum`` values), whatever else the step reduced; one without (evaluation) when the batch's loss
    was reduced (``context.loss_reduced``)."""
    if loss.grad_fn is not None:
        return is_sequence_level(loss)
    return bool(context.loss_reduced)


def counted_tokens(context: Any, values: Tensor, mask: Optional[Tensor]) -> Optional[Tensor]:
    """``mask`` without the padding the strategy added to the batch (``context.token_mask``): what a per-sequence sum
    or mean counts."""
    padding = getattr(context, "token_mask", None)
    if padding is None or padding.shape != values.shape[:2]:
        return mask
    return padding if mask is None else mask.bool() & padding


def sequence_sum(owner: Any, values: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    """Per-sequence sums of per-token values over the whole sequence, on every rank: ``values (B, S/P, …)`` of this
    rank's tokens (log-probabilities of the targets, a value head's output), ``mask (B, S/P)`` which tokens count
    (``None``: every token of the batch; the strategy's padding never counts) -> ``(B, …)``, what one process computes
    over ``(B, S, …)``. ``owner``: the LightningModule (or a ``Fabric``). Differentiable, and a loss built from it is
    the sequence's (the strategy does not reduce it again). Under another strategy the local sum (one process holds
    the sequence). Collective: call it on every rank::

        logp = -F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")  # (B, S/P); -100: 0
        chosen = lightning_fpdt.sequence_sum(self, logp, batch["labels"] != -100)             # (B,)
    """
    strategy = fpdt_strategy_of(owner)
    if strategy is None:
        return token_sums(values, mask)
    return strategy.sequence_sum(values, mask)


def sequence_mean(owner: Any, values: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    """Per-sequence means of per-token values over the whole sequence, on every rank (:func:`sequence_sum` divided
    by the tokens that count; 0 where none does)."""
    strategy = fpdt_strategy_of(owner)
    if strategy is None:
        return token_sums(values, mask) / token_counts(values, mask).clamp(min=1)
    return strategy.sequence_mean(values, mask)


def sequence_loss(module: nn.Module, loss: Tensor) -> Tensor:
    """The token-mean loss of the whole sequence from this rank's token mean (over ``batch["labels"] != -100``):
    what to log from a ``training_step``, and what it may return. Under a strategy other than ``"fpdt"``, or outside
    a Trainer, the loss is returned as it is (one process holds the whole sequence). Call it on every rank (a
    collective under the fpdt strategy)::

        loss = lightning_fpdt.sequence_loss(self, F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()))
        self.log("train_loss", loss)
    """
    strategy = fpdt_strategy_of(module)
    return loss if strategy is None else strategy.reduce_loss(loss)


def group_sums(context: Any, values: Tensor, mask: Optional[Tensor], *, mean: bool) -> Tensor:
    """What both fpdt strategies' ``sequence_sum``/``sequence_mean`` compute over the batch's ``context``: the sums
    (or means) over the sequence group of the tokens ``mask`` counts, the strategy's padding left out."""
    reduce = group_sequence_mean if mean else group_sequence_sum
    return reduce(values, counted_tokens(context, values, mask), group=context.group)


def check_training_loss(loss: Optional[Tensor], no_target: Tensor, trainer: Any, *, rank: int) -> bool:
    """Stop every rank together on a non-finite loss (one rank stopping alone would hang the others): a
    ``FloatingPointError`` naming the step on every rank. Returns whether a data-parallel group's batch had no
    target at all (``no_target``, a device flag of this rank's batch). Collective; one host synchronisation."""
    if loss is None:
        return False
    flags = torch.stack([~torch.isfinite(loss.detach().reshape(())), no_target.to(loss.device)]).float()
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    nonfinite, targetless = (bool(flag) for flag in flags.tolist())
    if nonfinite:
        value = loss.item()
        where = f"{value} on rank {rank}" if not math.isfinite(value) else f"on another rank than {rank}"
        raise FloatingPointError(
            f"non-finite loss ({where}) at global step {trainer.global_step} "
            f"(epoch {trainer.current_epoch}): training stopped; lower the learning rate, check the data, or "
            f"pass FPDTStrategy(nonfinite_loss='ignore') to train on"
        )
    return targetless


def no_target_message(step: int) -> str:
    return (f"fpdt: at global step {step} a batch has no token with a target (every label is {IGNORE_INDEX}, or the "
            f"sequences are 1 token long): its loss is 0.0 (one process would report NaN) and its gradient zero; "
            f"check the data (shown once)")


class TrainingLossCheck:
    """``FPDTStrategy(nonfinite_loss="raise")``'s check of each training step's loss (:func:`check_training_loss`),
    with the batch without any target named once per run (``warn``: rank zero's warning)."""

    def __init__(self, warn: Callable[[str], Any]) -> None:
        self._warn = warn
        self._targetless_warned = False

    @classmethod
    def of(cls, nonfinite_loss: str, *, warn: Callable[[str], Any]) -> Optional["TrainingLossCheck"]:
        """The check ``FPDTStrategy(nonfinite_loss=...)`` asks for: one for ``"raise"``, none for ``"ignore"``."""
        if nonfinite_loss not in ("raise", "ignore"):
            raise ValueError(f"nonfinite_loss must be 'raise' or 'ignore', got {nonfinite_loss!r}")
        return cls(warn) if nonfinite_loss == "raise" else None

    def __call__(self, output: Any, no_target: Tensor, trainer: Any, *, rank: int) -> None:
        targetless = check_training_loss(unwrap_loss(output), no_target, trainer, rank=rank)
        if targetless and not self._targetless_warned:
            self._targetless_warned = True
            self._warn(no_target_message(trainer.global_step))
