"""ActivationOffload: checkpoint every transformer block and keep its input in host memory (DESIGN.md §6).

Under plain activation checkpointing each block keeps its input on the GPU until the backward: ``L × S/P × hidden``
for the whole model, which at millions of tokens no longer fits. Here the input of each block goes to (pinned) host
memory asynchronously after the block's forward, and comes back one block ahead in the backward, while the block
after it is still computing its gradients.

The FPDT attention is not run again in the recomputed forward: its first forward's output is kept (on the host when
the attention offloads) and handed back to the recompute, and its backward uses the chunks stashed by that first
forward (DESIGN.md §4). That keeps every layer's stash until its backward; ``recompute_attention=True`` trades it for
a second attention forward: the first forward stashes nothing, and only the layer in backward holds a stash, which is
what lets a full-depth model reach lengths where the stashes of all layers exceed the host's memory.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_fpdt.callbacks.tiled_mlp import VALUE_UNUSED_IN_RECOMPUTE
from lightning_fpdt.sequence.fpdt import FPDTAttention
from lightning_fpdt.sequence.host_stash import StashFactory
from lightning_fpdt.sequence.integrations import installed_attentions

_WRAPPED = "_fpdt_activation_offload"
RESIDUAL_MLP_BLOCKS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
"""Blocks whose ``mlp`` output only feeds the residual add that ends the block (the reference Llama's and these
Hugging Face families'): in the recompute nothing reads that value, so a TiledMLP there skips computing it and its
backward recomputes the tiles as always: the MLP forward runs twice per step, not three times."""


class _BlockCheckpoints:
    """The stash of block inputs of one model, and the order blocks ran in (for the one-ahead prefetch)."""

    def __init__(self, stashes: StashFactory, prefetch: int) -> None:
        self.stashes = stashes
        self.prefetch = prefetch
        self.forward_order: list[int] = []  # stash keys of this step's blocks, in forward order
        self.attentions: list[FPDTAttention] = []  # told to keep what the recompute needs (no attention recompute)
        self.recomputing = False
        """True while a block's forward is recomputed in backward (read by TiledMLP, see RESIDUAL_MLP_BLOCKS)."""
        self._stash = None

    def stash(self, device: torch.device):
        if self._stash is None:
            self._stash = self.stashes.chunks(device)
        return self._stash

    def prefetch_before(self, key: int) -> None:
        """Start bringing back the inputs of the ``prefetch`` blocks that run backward after block ``key``."""
        if key not in self.forward_order:
            return
        index = self.forward_order.index(key)
        for earlier in self.forward_order[max(0, index - self.prefetch) : index]:
            if earlier in self._stash:
                self._stash.prefetch(earlier)


class _OffloadedCheckpoint(torch.autograd.Function):
    """One block, checkpointed, its first input kept in the host stash.

    | tensor | shape | kept for backward |
    |---|---|---|
    | hidden (in) | (B, S/P, hidden) | in the host stash (pinned), prefetched one block ahead in backward |
    | other tensor inputs | small (position ids, RoPE tables) | as they are |
    | block activations | — | no: recomputed in backward (attention is not: see the module docstring) |
    """

    @staticmethod
    def forward(ctx, run: Callable, spec: Any, owner: _BlockCheckpoints, key: int, *leaves: Any) -> Any:
        hidden = leaves[0]
        stash = owner.stash(hidden.device)
        if key in stash:
            stash.free(key)  # a graph discarded without backward
        stash.put(key, hidden.detach())
        owner.forward_order.append(key)
        ctx.run, ctx.spec, ctx.owner, ctx.key = run, spec, owner, key
        ctx.others = leaves[1:]
        for attention in owner.attentions:
            attention.recording = True
        try:
            with torch.no_grad():
                return run(spec, (hidden, *leaves[1:]))
        finally:
            for attention in owner.attentions:
                attention.recording = False

    @staticmethod
    def backward(ctx, *grad_outputs: Tensor) -> tuple[Optional[Tensor], ...]:
        owner, stash = ctx.owner, ctx.owner._stash
        owner.prefetch_before(ctx.key)
        hidden = stash.get(ctx.key).detach().requires_grad_()
        stash.release(ctx.key)
        stash.free(ctx.key)
        others = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, Tensor) else x for x in ctx.others]
        owner.recomputing = True
        try:
            with torch.enable_grad():
                outputs = ctx.run(ctx.spec, (hidden, *others))
        finally:
            owner.recomputing = False
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        # The roots of the block's backward as gradient edges (autograd node + output index), not tensors: the backward
        # reads their nodes, never their values, so the recomputed outputs (for a transformer block one hidden-sized
        # tensor, B·S/P·hidden) are freed here instead of living through the whole backward of the block.
        roots = [(get_gradient_edge(o), g) for o, g in zip(outputs, grad_outputs)
                 if isinstance(o, Tensor) and o.requires_grad and g is not None]
        del outputs
        # backward (not autograd.grad): the block's parameters accumulate their gradients here
        torch.autograd.backward([edge for edge, _ in roots], [g for _, g in roots])
        other_grads = [x.grad if isinstance(x, Tensor) and x.requires_grad else None for x in others]
        if ctx.key == owner.forward_order[0]:
            owner.forward_order.clear()  # the first block's backward ends the step
        return (None, None, None, None, hidden.grad, *other_grads)


def _wrap_block(block: nn.Module, owner: _BlockCheckpoints, key: int) -> None:
    forward = block.forward

    def run(spec: Any, leaves: tuple) -> Any:
        args, kwargs = tree_unflatten(list(leaves), spec)
        return forward(*args, **kwargs)

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        if not leaves or not isinstance(leaves[0], Tensor) or not torch.is_grad_enabled():
            return forward(*args, **kwargs)  # evaluation, or a call without hidden states first
        # parameters take part through the recompute in backward; this marks the output as needing grad
        return _OffloadedCheckpoint.apply(run, spec, owner, key, *leaves)

    block.forward = checkpointed
    setattr(block, _WRAPPED, True)


class ActivationOffload(Callback):
    """Checkpoint each transformer block; its input waits in pinned host memory (DESIGN.md §6).

    Args:
        layer_classes: class names of the blocks to checkpoint; ``None``: the strategy's blocks (the largest
            ``nn.ModuleList``).
        pin_memory: pin the host buffers (CUDA only; pageable copies are synchronous and ~3× slower).
        prefetch: how many blocks ahead their inputs come back during the backward.
        offload: ``False`` keeps the block inputs on the GPU (plain checkpointing without recomputing attention).
        recompute_attention: run the FPDT attention again in the recompute instead of keeping every layer's chunks
            and output until its backward: host (or GPU) memory of one layer's stash instead of all layers', for
            about +30% attention compute (a second forward beside the backward's 2.5 forwards' worth).

    With ``strategy="fpdt"`` the strategy applies it before FSDP2; with another strategy it wraps the blocks of the
    LightningModule's model at ``setup`` (checkpointing and offload work; the attention is recomputed there).
    """

    fpdt_transform_order = 4

    def __init__(
        self,
        layer_classes: Optional[list[str]] = None,
        pin_memory: bool = True,
        prefetch: int = 1,
        offload: bool = True,
        recompute_attention: bool = False,
    ) -> None:
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0 blocks, got {prefetch}")
        self.layer_classes = layer_classes
        self.prefetch = prefetch
        self.recompute_attention = recompute_attention
        self.stashes = StashFactory(offload=offload, pin_memory=pin_memory)
        self._owner: Optional[_BlockCheckpoints] = None

    @property
    def host_bytes(self) -> int:
        """Host memory allocated for block inputs."""
        return self.stashes.host_bytes

    def fpdt_transform(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        from lightning_fpdt.strategy.parallelize import find_blocks

        blocks = find_blocks(model, self.layer_classes) if self.layer_classes else blocks
        if not blocks:
            raise ValueError(
                f"ActivationOffload found no transformer blocks in {type(model).__name__}: give layer_classes=[...]"
            )
        if all(getattr(b, _WRAPPED, False) for b in blocks):
            return
        self._owner = _BlockCheckpoints(self.stashes, self.prefetch)
        for key, block in enumerate(blocks):
            _wrap_block(block, self._owner, key)
            if type(block).__name__ in RESIDUAL_MLP_BLOCKS and isinstance(getattr(block, "mlp", None), nn.Module):
                setattr(block.mlp, VALUE_UNUSED_IN_RECOMPUTE, self._owner)
        # attentions told to record their first pass (and not run again); none when the recompute runs them
        self._owner.attentions = [] if self.recompute_attention else sorted(_fpdt_attentions(model), key=id)

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        from lightning_fpdt.strategy.fpdt import FPDTStrategy
        from lightning_fpdt.strategy.parallelize import find_blocks, find_model

        if not isinstance(trainer.strategy, FPDTStrategy):
            model = find_model(pl_module)
            self.fpdt_transform(model, find_blocks(model, self.layer_classes))

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *args: Any) -> None:
        pl_module.log("memory/activation_offload_host_gib", self.host_bytes / 2**30, on_step=True, logger=True)


def _fpdt_attentions(model: nn.Module) -> set[FPDTAttention]:
    """The shared FPDT attention objects the model's layers call."""
    return {handle.shared for handle in installed_attentions(model)}
