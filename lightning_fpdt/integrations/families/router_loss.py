"""A mixture of experts' load-balancing loss over the sequence-parallel group, exactly as one process computes it.

Hugging Face's loss (Switch Transformer's, over all layers' router logits) is ``E · Σ_e f_e · p_e``, with ``f_e`` the
fraction of top-k assignments to expert ``e`` and ``p_e`` its mean router probability, both over every token of the
batch. A product of means is not the mean of each rank's products: each rank sums its counts and probabilities, one
all-reduce makes them the group's, and the loss is formed from those. As :func:`sequence_parallel_loss` does for the
token loss, the value is the group's (the same on every rank) and the gradient ``P`` times this rank's share, so data
parallelism's average over the ranks is the gradient of the group's loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


def load_balancing_loss(router_logits: Sequence[Tensor], num_experts: int, top_k: int, *,
                        reduce: bool = False, group: Optional[dist.ProcessGroup] = None,
                        token_mask: Optional[Tensor] = None) -> Tensor:
    """The load-balancing loss from this rank's router logits, one ``(B·S/P, E)`` tensor per MoE layer: over
    ``group`` (``None``: the world) with ``reduce``, else of the local tokens alone (Hugging Face's value);
    ``token_mask`` ``(B, S/P)`` leaves out padding the strategy added (``None``: every token counts)."""
    if not router_logits:
        raise ValueError("load_balancing_loss got no router logits: call the model with output_router_logits=True")
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)  # top-k assignments per expert
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)  # summed router probabilities (with grad)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if token_mask is None else token_mask.reshape(-1).to(device=device, dtype=torch.float32)  # (B·S/P,)
    for logits in router_logits:
        weights = F.softmax(logits, dim=-1)  # (B·S/P, E)
        _, selected = torch.topk(weights, top_k, dim=-1)  # (B·S/P, k)
        ones = torch.ones(selected.numel(), device=device) if mask is None else mask.repeat_interleave(top_k)
        counts = counts + torch.zeros_like(counts).scatter_add_(0, selected.reshape(-1), ones)
        weights = weights.float()
        probs = probs + (weights.sum(0) if mask is None else (weights * mask[:, None]).sum(0))
        rows = rows + (weights.shape[0] if mask is None else mask.sum())
    stats = torch.cat([counts, probs.detach(), rows[None]])  # one collective for all three
    sp_size = 1
    if reduce and dist.is_available() and dist.is_initialized():
        sp_size = dist.get_world_size(group)
        if sp_size > 1:
            dist.all_reduce(stats, group=group)
    counts_group, probs_group, rows_group = stats[:num_experts], stats[num_experts:-1], stats[-1].clamp(min=1)
    fraction = counts_group / rows_group  # f_e of the group, no gradient (top-k counts)
    value = num_experts * torch.sum(fraction * probs_group / rows_group)
    contribution = sp_size * num_experts * torch.sum(fraction * probs / rows_group)
    # value: the group's loss; gradient: P times this rank's share of it
    return contribution + (value - contribution.detach())
