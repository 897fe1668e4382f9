"""The tiled loss inside the output head's own forward.

A causal LM projects its final hidden states with ``lm_head`` and takes the loss inside its top-level forward, which
is FSDP2's root unit (with the embedding). Called through the head's forward, the tiled loss lets the strategy make
the head a unit of its own: FSDP2 then reduce-scatters the head's gradient as soon as the loss's backward is done,
instead of with the embedding's at the end of the backward (``lightning_fpdt.strategy.parallelize``). A head tied to
the embedding shares its parameter and stays in the root unit.
"""

from __future__ import annotations

import functools
from typing import Literal, Optional, Union

from torch import Tensor, nn

from lightning_fpdt.integrations.attributes import HEAD_LOSS
from lightning_fpdt.memory.forwards import replace_forward
from lightning_fpdt.memory.tiled_loss import tiled_cross_entropy


def give_head_the_loss(head: nn.Module, num_tiles: Union[Literal["auto"], int]) -> bool:
    """``head(hidden, targets)`` returns ``tiled_cross_entropy(hidden, head.weight, targets)`` (``(mean,
    num_valid)``), ``head(hidden)`` the projection as before; in place, idempotent. Only a bias-free ``nn.Linear``
    (``False`` for anything else: its caller keeps the loss in the model's forward)."""
    if getattr(head, HEAD_LOSS, False):
        return True
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return False
    projection = head.forward

    @functools.wraps(projection)
    def forward(hidden: Tensor, targets: Optional[Tensor] = None) -> object:
        if targets is None:
            return projection(hidden)
        # head.weight read per call: inside this forward FSDP2 has swapped in the gathered parameter
        return tiled_cross_entropy(hidden, head.weight, targets, num_tiles=num_tiles)

    replace_forward(head, forward)
    setattr(head, HEAD_LOSS, True)
    return True


def loss_head(model: nn.Module) -> Optional[nn.Module]:
    """The module of ``model`` whose forward computes the loss (:func:`give_head_the_loss`), if any."""
    return next((m for m in model.modules() if getattr(m, HEAD_LOSS, False)), None)
