"""Token-level metrics whose states are sums, so they aggregate exactly across sequence-parallel ranks.

Under sequence parallelism every rank holds different tokens of the same sequences (and data-parallel groups hold
different sequences), so the correct global value is always ``sum over all ranks / count over all ranks``: each
metric keeps a local sum and count, and torchmetrics sums them over the whole world when it syncs
(``dist_reduce_fx="sum"``). A mean of per-rank ratios would be wrong: a retrieval answer lives on one rank only,
and the other ranks of its group have no scored token at all.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_fpdt.sequence.loss import IGNORE_INDEX


class TokenAccuracy(Metric):
    """Fraction of scored tokens (``target != ignore_index``) whose prediction is right.

    ``update(preds, target)``: ``preds`` are token ids shaped like ``target`` or logits with one more (vocabulary)
    dimension; ``target`` per-token targets (already shifted). On the retrieval task, where only the answers are
    scored, this is the retrieval accuracy. ``compute()`` is 0 when no token was scored.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = True
    correct: Tensor
    total: Tensor

    def __init__(self, ignore_index: int = IGNORE_INDEX, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ignore_index = ignore_index
        self.add_state("correct", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor) -> None:
        if preds.dim() == target.dim() + 1:
            preds = preds.argmax(dim=-1)
        if preds.shape != target.shape:
            raise ValueError(f"TokenAccuracy: preds {tuple(preds.shape)} do not match target {tuple(target.shape)}")
        scored = target != self.ignore_index
        self.correct += (preds[scored] == target[scored]).sum()
        self.total += scored.sum()

    def compute(self) -> Tensor:
        return self.correct.double() / self.total.clamp(min=1)


class TokenPerplexity(Metric):
    """``exp(total token loss / scored tokens)`` from per-batch sums.

    ``update(loss_sum, count)``: the summed cross-entropy of a rank's scored tokens and how many there are. A model
    that returns the sequence group's *mean* loss ``m`` (the fpdt strategy's convention) updates with
    ``(m · n_local, n_local)``: over the group these sum to ``m · N_group``, the group's total.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = False
    loss_sum: Tensor
    count: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # fp64: summing millions of per-token losses in fp32 loses digits
        self.add_state("loss_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, loss_sum: Tensor, count: Tensor) -> None:
        self.loss_sum += loss_sum.detach().to(torch.float64).sum()
        self.count += torch.as_tensor(count, device=self.count.device).to(torch.float64).sum()

    def compute(self) -> Tensor:
        return torch.exp(self.loss_sum / self.count.clamp(min=1))

