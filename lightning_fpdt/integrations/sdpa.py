"""Plain PyTorch modules calling ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``: inside their
transformer blocks a ``TorchFunctionMode`` routes that call to the FPDT attention."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_fpdt.integrations.attributes import ATTENTION_HANDLE
from lightning_fpdt.memory.forwards import replace_forward
from lightning_fpdt.sequence.attention import FPDTAttention, LayerAttention
from lightning_fpdt.sequence.loss import IGNORE_INDEX

_SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class SDPAInterception(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` to the FPDT attention.

    The intercepted call receives ``(B, H, S/P, D)`` tensors of the local shard and returns the same layout.
    """

    def __init__(self, attention: Union[FPDTAttention, LayerAttention]) -> None:
        super().__init__()
        self.attention = attention

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = dict(zip(_SDPA_ARGUMENTS, args), **kwargs)
        if call.get("attn_mask") is not None:
            raise ValueError(
                "scaled_dot_product_attention with attn_mask cannot be sequence-parallelized exactly: use "
                f"is_causal=True without a mask (right-pad, and set padded labels to {IGNORE_INDEX})"
            )
        if call.get("dropout_p", 0.0):
            raise ValueError("scaled_dot_product_attention with dropout_p > 0 is not supported under fpdt: use 0")
        if not call.get("is_causal", False):
            raise ValueError(
                "scaled_dot_product_attention(is_causal=False) is bidirectional; the fpdt attention is causal only: "
                "call it with is_causal=True"
            )
        q, k, v = (call[n].transpose(1, 2) for n in ("query", "key", "value"))  # (B, H, S/P, D) -> (B, S/P, H, D)
        return self.attention(q, k, v, causal=True, scale=call.get("scale")).transpose(1, 2)


class InterceptedForward:
    """What replaces a block's ``forward``: the original forward under its :class:`SDPAInterception` (also when a
    checkpoint recomputes it)."""

    def __init__(self, forward: Callable[..., Any], interception: SDPAInterception) -> None:
        self.forward, self.interception = forward, interception

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.interception:
            return self.forward(*args, **kwargs)


def install_sdpa_interception(blocks: list[nn.Module], attention: FPDTAttention) -> None:
    """Run each block's forward under :class:`SDPAInterception`, with a layer handle of its own."""
    for block in blocks:
        if isinstance(block.forward, InterceptedForward):
            continue
        interception = SDPAInterception(attention.for_layer())
        replace_forward(block, InterceptedForward(block.forward, interception))
        setattr(block, ATTENTION_HANDLE, interception.attention)  # found by ActivationOffload (no attention recompute)
