"""Targets and the token loss of a sequence-sharded batch (docs/design.md §3, §5).

- :func:`shift_labels` is the one label shift of the package: token ``t``'s target is ``labels[t + 1]``. The strategy
  applies it on the global sequence before sharding, so no target is lost at a shard boundary; a model trained alone
  applies the same function to its whole sequence.
- :func:`ignore_document_ends`: in a packed sequence the last token of a document predicts nothing.
- :func:`token_loss_sum` is the one token cross-entropy (fp32 at least); :func:`token_cross_entropy` its mean.
- :func:`sequence_parallel_loss` turns each rank's local token mean into the sequence group's token mean.
- :func:`sequence_sum` and :func:`sequence_mean`: per-sequence sums and means of per-token values (log-probabilities
  for DPO, a value head's output) over the group, as one process computes them.
- :func:`is_sequence_level`: whether a loss was built from the group's values (then it is not reduced again).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_fpdt.sequence.all_to_all import group_size

IGNORE_INDEX = -100
"""The target value of a token that does not count (PyTorch's and Hugging Face's convention)."""


def shift_labels(labels: Tensor, dim: int = 1, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Per-token targets: ``out[t] = labels[t + 1]`` along ``dim``, the last one ``ignore_index``."""
    dim = dim % labels.dim()
    tail_shape = list(labels.shape)
    tail_shape[dim] = 1
    rest = labels.narrow(dim, 1, labels.shape[dim] - 1)
    return torch.cat([rest, labels.new_full(tail_shape, ignore_index)], dim=dim)


def ignore_document_ends(targets: Tensor, document_starts: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """``targets (B, S)`` with the target of every token that ends a document ignored: run alone, a document's last
    token has no next token. ``document_starts (B, S)`` is True where a document starts (the token after an end)."""
    ends = document_starts[:, 1:]  # token t ends its document when t + 1 starts one
    return torch.cat([targets[:, :-1].masked_fill(ends, ignore_index), targets[:, -1:]], dim=1)


def token_loss_sum(logits: Tensor, targets: Tensor, ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """``(sum of cross-entropy over the tokens that count, their number)``; in fp32 at least (softmax over a large
    vocabulary in bf16 is badly rounded), fp64 for fp64 logits."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)).flatten(0, -2)  # (N, V)
    targets = targets.flatten().to(logits.device)  # (N,)
    total = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
    return total, (targets != ignore_index).sum()


def token_cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """``(mean over the tokens that count, their number)``; the mean is 0, not NaN, when no token counts."""
    total, count = token_loss_sum(logits, targets, ignore_index)
    return total / count.clamp(min=1), count


def sequence_parallel_loss(
    local_mean: Tensor, num_valid_local: Union[Tensor, int], *, group: Optional[dist.ProcessGroup]
) -> Tensor:
    """The group's token-mean loss from each rank's mean over its own valid tokens.

    The value returned is the mean over all valid tokens of the sequence-parallel group (the same on every rank,
    what a single process would report). Its gradient is ``P · n_local / N_group`` times the local mean's: data
    parallelism (FSDP2, DDP) averages gradients over all ``dp · P`` ranks, and the average of these over the ``P``
    ranks of a group is exactly the gradient of the group's token mean. (Scaling here rather than setting FSDP2's
    divide factor keeps to plain averaging, which every backend has; gloo lacks the pre-multiplied sum.)
    A rank without valid tokens contributes zero, never NaN (its local mean is 0/0).
    """
    acc = torch.promote_types(local_mean.dtype, torch.float32)  # token counts in bf16 would round above 256
    n_local = torch.as_tensor(num_valid_local, device=local_mean.device, dtype=acc)
    zero = torch.zeros((), dtype=acc, device=n_local.device)
    local_sum = torch.where(n_local > 0, local_mean.to(acc) * n_local, zero)
    stats = torch.stack([local_sum.detach(), n_local.to(local_sum.dtype)])  # one collective for the sum and the count
    sp_size = 1
    if dist.is_available() and dist.is_initialized():
        sp_size = dist.get_world_size(group)
        if sp_size > 1:
            dist.all_reduce(stats, group=group)
    n_group = stats[1].clamp(min=1)
    contribution = local_sum * (sp_size / n_group.to(local_sum.dtype))
    # value: the group mean; gradient: P times this rank's share of it
    return SequenceLevel.apply(contribution + (stats[0] / n_group - contribution.detach()).to(contribution.dtype))


class SequenceLevel(torch.autograd.Function):
    """The identity, marking its output as a value of the whole sequence (the group's, equal on every rank): a loss
    whose graph passes through it is not reduced again (:func:`is_sequence_level`).

    | tensor | shape | sharded | saved |
    |---|---|---|---|
    | value (in, out) | any | no: equal on every rank of the group | nothing |
    """

    @staticmethod
    def forward(ctx, value: Tensor) -> Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


SEQUENCE_LEVEL_SEARCH = 256
"""Autograd nodes :func:`is_sequence_level` visits at most, nearest the loss first. A loss built from the group's
values reaches them within a few nodes (its last ops combine them); a local loss's graph is the whole model's, which
is never walked."""


def is_sequence_level(loss: Tensor) -> bool:
    """Whether ``loss``'s graph passes through a :class:`SequenceLevel` value within :data:`SEQUENCE_LEVEL_SEARCH`
    nodes of it: a model's own loss (:func:`sequence_parallel_loss`), a DPO loss of :func:`sequence_sum` values. The
    same on every rank of a group (the same code built the same graph)."""
    queue, seen = [loss.grad_fn], set()
    while queue and len(seen) < SEQUENCE_LEVEL_SEARCH:
        node = queue.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "SequenceLevelBackward":
            return True
        queue.extend(next_node for next_node, _ in node.next_functions)
    return False


class _GroupSum(torch.autograd.Function):
    """Sum over the sequence-parallel group; the gradient reaching each rank's share is ``P`` times the sum's (data
    parallelism averages gradients over all ``dp·P`` ranks, so the average over a group is the sum's gradient, as
    :func:`sequence_parallel_loss`).

    | tensor | shape | sharded | saved |
    |---|---|---|---|
    | local (in) | (B, …) | no: this rank's partial sums | nothing |
    | out | (B, …) | no: equal on every rank | nothing |
    """

    @staticmethod
    def forward(ctx, local: Tensor, group: Optional[dist.ProcessGroup], scale: float) -> Tensor:
        ctx.scale = scale
        out = local.clone()
        if scale > 1:
            dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad * ctx.scale, None, None


def token_sums(values: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    """``values (B, S, …)`` summed over the tokens ``mask (B, S)`` counts (``None``: all) -> ``(B, …)``, in the values'
    dtype, fp32 at least: one process's per-sequence sums, and each rank's part of the group's."""
    terms = values.to(torch.promote_types(values.dtype, torch.float32))
    if mask is not None:
        if mask.shape != values.shape[:2]:
            raise ValueError(f"mask {tuple(mask.shape)} must be (batch, tokens) {tuple(values.shape[:2])}: one flag "
                             f"per token")
        terms = torch.where(mask.reshape(*mask.shape, *([1] * (values.dim() - 2))).bool(), terms,
                            terms.new_zeros(()))
    return terms.sum(dim=1)


def token_counts(values: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    """The tokens ``mask`` counts in each sequence, shaped to divide :func:`token_sums` (fp32)."""
    counts = torch.ones(values.shape[:2], device=values.device) if mask is None else mask.to(torch.float32)
    return counts.sum(dim=1).reshape(-1, *([1] * (values.dim() - 2)))


def sequence_sum(values: Tensor, mask: Optional[Tensor] = None, *, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Per-sequence sums of per-token values over the sequence-parallel ``group`` (``None``: the default group):
    ``values (B, S/P, …)`` of this rank's tokens, ``mask (B, S/P)`` which of them count (``None``: all) ->
    ``(B, …)``, on every rank what one process computes over the whole sequence (:func:`token_sums`). Differentiable:
    each rank's gradient is its share, scaled as :func:`sequence_parallel_loss`'s. A loss built from the result is the
    sequence's (:func:`is_sequence_level`)."""
    return SequenceLevel.apply(_GroupSum.apply(token_sums(values, mask), group, group_size(group)))


def sequence_mean(values: Tensor, mask: Optional[Tensor] = None, *, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Per-sequence means of per-token values over the sequence-parallel ``group`` (:func:`sequence_sum` divided by
    the number of tokens that count in each sequence; 0 for a sequence where none counts)."""
    total = token_counts(values, mask)
    if group_size(group) > 1:
        dist.all_reduce(total, group=group)
    return sequence_sum(values, mask, group=group) / total.clamp(min=1).to(torch.promote_types(values.dtype,
                                                                                                torch.float32))
