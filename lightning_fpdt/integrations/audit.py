"""No attention runs on one rank's tokens in silence: each attention-like module and each transformer block must run
the sequence-parallel attention in its first forward.

The strategy reaches a model's attention through what it knows (a Hugging Face model's attention interface, the
reference Llama's hook, ``F.scaled_dot_product_attention`` inside the blocks it intercepts). An attention it does not
reach (a model it did not find, a user's own module, ``nn.MultiheadAttention`` in a head, a block whose attention is
written out as matmul and softmax) computes over this rank's shard of the sequence only: a result that is wrong by
construction, and that trains without an error. :class:`AttentionAudit` watches, for their first forward, every block
of every model the strategy installed and every module whose class says it is an attention (a name ending in
``Attention`` or ``Attn``, or ``nn.MultiheadAttention``) anywhere in the LightningModule; one whose forward ran no
sequence-parallel attention stops the run with a ``ValueError`` naming it and the fix when the sequence is split over
several ranks, and is warned about once on one rank (the attention is exact there, but runs outside the chunk
pipeline). A module that attends within each rank's tokens on purpose is marked with :func:`allow_local_attention`.
Each module is checked once (its hooks go after its first forward), so a step costs nothing after the first.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_fpdt.integrations.attributes import LOCAL_ATTENTION
from lightning_fpdt.sequence.attention import FPDTAttention

ATTENTION_CLASS = re.compile(r"(attention|attn)$", re.IGNORECASE)
"""Class names that say a module is an attention (``LlamaAttention``, ``CausalSelfAttention``, ``SelfAttn``)."""


def allow_local_attention(module: nn.Module) -> nn.Module:
    """Mark ``module`` as attending within each rank's tokens on purpose (under the fpdt strategy every rank holds a
    shard of the sequence): the strategy's check that every attention runs sequence-parallel skips it and what it
    holds. Returns ``module``."""
    setattr(module, LOCAL_ATTENTION, True)
    return module


def looks_like_attention(module: nn.Module) -> bool:
    """``nn.MultiheadAttention``, or a class whose name ends in ``Attention`` or ``Attn``."""
    return isinstance(module, nn.MultiheadAttention) or bool(ATTENTION_CLASS.search(type(module).__name__))


class AttentionAudit:
    """Watches the first forward of ``blocks`` and of the attention-like modules of ``root`` (module docstring).

    Args:
        root: the LightningModule (or the model under Fabric): where attention-like modules are looked for.
        blocks: the transformer blocks of every model the strategy installed.
        attention: the shared sequence-parallel attention the installed layers call (its ``kernel_calls`` counts the
            calls).
        sequence_parallel_size: ranks one sequence is split over; 1 warns instead of raising.
    """

    def __init__(self, root: nn.Module, *, blocks: Sequence[nn.Module], attention: FPDTAttention,
                 sequence_parallel_size: int) -> None:
        self.attention = attention
        self.sequence_parallel_size = sequence_parallel_size
        self.names = {id(m): name or type(root).__name__ for name, m in root.named_modules()}
        self.kinds = {id(m): type(m).__name__ for m in root.modules()}  # before FSDP2 renames the classes
        self.checked: list[str] = []
        """Qualified names of the modules checked so far, in the order their first forward ended."""
        self._handles: dict[int, list[Any]] = {}
        self._calls_before: dict[int, list[int]] = {}
        for module in watched_modules(root, blocks):
            self._watch(module)

    @property
    def watching(self) -> int:
        """Modules whose first forward has not run yet."""
        return len(self._handles)

    def _watch(self, module: nn.Module) -> None:
        key = id(module)
        self._handles[key] = [module.register_forward_pre_hook(self._before),
                              module.register_forward_hook(self._after, always_call=True)]

    def _before(self, module: nn.Module, args: Any) -> None:
        self._calls_before.setdefault(id(module), []).append(self.attention.kernel_calls)

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        key = id(module)
        before = self._calls_before.get(key)
        if not before:
            return
        ran = self.attention.kernel_calls > before.pop()
        if before:
            return  # a nested call of the same module: the outermost decides
        if output is None:
            # its forward raised: torch runs this hook anyway, while it iterates the module's hooks (removing them
            # now would replace the forward's error with its own), and a forward that did not finish proves nothing
            return
        for handle in self._handles.pop(key, ()):
            handle.remove()
        self._calls_before.pop(key, None)
        name = self.names.get(key, type(module).__name__)
        self.checked.append(name)
        if not ran:
            self._report(module, name)

    def _report(self, module: nn.Module, name: str) -> None:
        kind = self.kinds.get(id(module), type(module).__name__)
        if self.sequence_parallel_size == 1:
            warnings.warn(
                f"fpdt: {name} ({kind}) ran its forward without the sequence-parallel attention: exact on one rank, "
                f"but outside FPDT's chunk pipeline (no chunks, no offload of its attention). {FIX}", stacklevel=2)
            return
        raise ValueError(
            f"fpdt: {name} ({kind}) ran its forward without the sequence-parallel attention: the sequence is split "
            f"over {self.sequence_parallel_size} ranks, so an attention computed inside it attends to this rank's "
            f"tokens only and trains on a wrong result. {FIX}"
        )


FIX = ("Hold the model so the strategy finds it (a Hugging Face PreTrainedModel or the reference Llama, anywhere in "
       "the LightningModule; any attn_implementation), or, in your own blocks, call "
       "F.scaled_dot_product_attention(q, k, v, is_causal=True) and name the block class in "
       "FPDTStrategy(layer_classes=[...]); a module that attends within each rank's tokens on purpose: "
       "lightning_fpdt.allow_local_attention(module).")


def watched_modules(root: nn.Module, blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """``blocks`` and the attention-like modules of ``root`` (:func:`looks_like_attention`) not held by another
    attention-like module, leaving out what :func:`allow_local_attention` marked and what it holds."""
    allowed: set[int] = set()
    for module in root.modules():
        if getattr(module, LOCAL_ATTENTION, False):
            allowed.update(id(m) for m in module.modules())
    watched = {id(b): b for b in blocks if id(b) not in allowed}
    inside: set[int] = set()
    for module in root.modules():
        if id(module) in inside or id(module) in allowed or not looks_like_attention(module):
            continue
        watched.setdefault(id(module), module)
        inside.update(id(m) for m in module.modules() if m is not module)
    return list(watched.values())
