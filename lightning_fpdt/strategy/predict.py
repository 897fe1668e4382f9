"""What ``trainer.predict`` returns under the strategy: the outputs of the whole sequence, as one process returns
them (docs/design.md §5.8). Each rank's ``predict_step`` sees its shard of the sequence; every tensor of its output
with this rank's tokens in dimension 1 is gathered from the sequence group, put back in sequence order and cut to the
batch's length (the padding dropped)."""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor

from lightning_fpdt.strategy.batch import BatchPlan

PREDICT_OUTPUTS = ("sequence", "rank")
"""``"sequence"``: every rank returns the outputs of the whole sequence; ``"rank"``: its own shard."""


def check_predict_outputs(predict_outputs: Any) -> Literal["sequence", "rank"]:
    if predict_outputs not in PREDICT_OUTPUTS:
        raise ValueError(f"predict_outputs must be 'sequence' (every rank returns the whole sequence's outputs) or "
                         f"'rank' (each rank its own shard), got {predict_outputs!r}")
    return predict_outputs


def is_sharded(tensor: Tensor, plan: BatchPlan) -> bool:
    """Whether ``tensor`` holds this rank's tokens in dimension 1: ``(B, S/P, …)`` of the batch ``plan`` sharded."""
    batch_size, local_len = plan.position_ids.shape
    return tensor.dim() >= 2 and tensor.shape[0] == batch_size and tensor.shape[1] == local_len


def gather_sequence(output: Any, plan: BatchPlan, group: Optional[dist.ProcessGroup]) -> Any:
    """``output`` with each tensor of shape ``(B, S/P, …)`` (at any depth of lists, tuples, dicts, dataclasses, a
    Hugging Face ``ModelOutput``) replaced by the whole sequence's ``(B, S, …)``, the padding dropped; other values
    as they are. Collective over the sequence group: every rank's output has the same structure and shapes (the same
    step on shards of one length), so the ranks gather the same tensors in the same order."""

    def gather(tensor: Tensor) -> Tensor:
        if not is_sharded(tensor, plan):
            return tensor
        whole = plan.layout.gather(tensor.detach(), group, dim=1)  # (B, S/P, …) -all_gather-> (B, S_padded, …)
        return whole.narrow(1, 0, plan.seq_len)

    return apply_to_collection(output, Tensor, gather)
