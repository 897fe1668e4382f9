"""Targets and the token loss of a sequence-sharded batch (docs/design.md §3, §5).

- :func:`shift_labels` is the one label shift of the package: token ``t``'s target is ``labels[t + 1]``. The strategy
  applies it on the global sequence before sharding, so no target is lost at a shard boundary; a model trained alone
  applies the same function to its whole sequence.
- :func:`ignore_document_ends`: in a packed sequence the last token of a document predicts nothing.
- :func:`token_loss_sum` is the one token cross-entropy (fp32 at least); :func:`token_cross_entropy` its mean.
- :func:`sequence_parallel_loss` turns each rank's local token mean into the sequence group's token mean.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

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
    return contribution + (stats[0] / n_group - contribution.detach()).to(contribution.dtype)
