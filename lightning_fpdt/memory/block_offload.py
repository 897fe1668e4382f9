"""Checkpoint every transformer block and keep its input in host memory (docs/design.md §6).

Under plain activation checkpointing each block keeps its input on the GPU until the backward: ``L × S/P × hidden``
for the whole model, which at millions of tokens no longer fits. Here the input of each block goes to (pinned) host
memory asynchronously after the block's forward, and comes back one block ahead in the backward, while the block
after it is still computing its gradients. In a block whose MLP is known (``residual_mlps``) that copy starts when the
block's MLP backward has ended, so the MLP backward (recomputed activations and the MLP's gradient buffers, the step's
highest point at long sequences) never holds the next block's input beside them; the attention backward, the longest
part of the block at such lengths, hides the copy. Other blocks start it as their backward starts.

With ``reload_input`` the block's own input does not stay on the GPU through its backward either: the recompute
reads it, the tensors saved from it point at its host copy (saved-tensor hooks), and it comes back for the backward
that unpacks them (the block's first norm), at the end of the block. One hidden-sized tensor less in every phase of a
block's backward, for one more host-to-device copy per block that the backward waits for. In a block whose MLP is
known the input's device copy goes as soon as the MLP starts in the recompute (nothing reads it after the attention's
residual add), so the recompute's last steps do not hold it either.

Attention objects passed as ``attentions`` are told to record during a block's first (no-grad) forward, so the
recompute takes their output back instead of running attention again (docs/design.md §4); with
``recompute_attention`` they are not, and the recompute runs the attention again. MLPs passed as
``unused_mlp_values`` feed only the residual add that ends their block: nothing reads their value in the recompute,
and a tiled MLP there skips computing it (:func:`mlp_value_unused`), since its backward recomputes the tiles anyway.

Partial residency (``keep_inputs``): only some inputs are stashed, the first block's and the others at evenly spaced
positions (:func:`kept_positions`); the inputs between two kept ones (a segment) are regenerated in the backward.
When the backward reaches a block whose input is not in the stash, the blocks from the nearest stashed input up to it
run forward again, without gradients, and their outputs go into the stash as the inputs of the blocks after them;
each block's checkpointed backward then runs as it always does, and frees its input. The stash so holds the kept
inputs and at most one segment's regenerated ones. The regenerating forward runs the blocks' forwards with the same
inputs (the kept input and the tensors each block got besides its hidden states: positions, RoPE tables), so it
computes the same values. The attention is not run again where its first pass was recorded: the recorded output is
taken without being consumed, and the layer's own recompute replays it later as without residency
(``regenerating`` on the attention objects); under ``recompute_attention`` it is computed. An input that is not the
previous block's output as it left that block (anything ran between the blocks) cannot be regenerated that way: it
is kept, whatever the schedule.

Blocks not checkpointed (``checkpoint_blocks``): only the first ``n`` blocks are checkpointed; the others run as
without checkpointing: autograd keeps their activations on the GPU until their backward, their attention keeps its
stash for its own backward (nothing recorded, nothing run again) and their MLPs run whole, not over tiles (a tiled
MLP runs its forward again in its backward, which is what such a block saves). The last blocks are the ones left
plain: their backward comes first, frees their activations before any recompute runs, and waits for no input coming
back from the host. Partial residency and ``recompute_attention`` apply to the checkpointed blocks; both serve runs
whose memory every block must save, so a schedule with plain blocks is refused with either.

Frozen parameters and adapters: a checkpointed block's output requires grad whenever the block has a trainable
parameter, also when its input needs no gradient (frozen embeddings, a frozen block before it); its recompute then
computes the parameters' gradients and no input gradient. A block with no trainable parameter on an input without
gradient runs as it is (no graph, nothing stashed). The recompute draws the random numbers the first forward drew (an
adapter's dropout), and no checkpointed call fills a KV cache (:data:`STATE_ARGUMENTS`).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import replace
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_fpdt.memory.block_schedule import BlockOffloadOptions, check_plain_blocks, kept_positions
from lightning_fpdt.memory.forwards import replace_forward
from lightning_fpdt.memory.recompute_input import RecomputeInput, RngState
from lightning_fpdt.offload.host_stash import ChunkStash, StashFactory

_UNUSED_VALUES: ContextVar[frozenset[int]] = ContextVar("fpdt_unused_mlp_values", default=frozenset())
"""Ids of the MLPs whose value nothing reads in the block recompute running on this thread (empty otherwise)."""
_PLAIN_BLOCK: ContextVar[bool] = ContextVar("fpdt_plain_block", default=False)
"""Whether the forward running on this thread is a block's that is not checkpointed (``checkpoint_blocks``)."""


STATE_ARGUMENTS: dict[str, Any] = {"use_cache": False, "cache": None, "past_key_values": None,
                                   "past_key_value": None, "layer_past": None}
"""The keyword arguments through which a block fills a KV cache (transformers' names), and what a checkpointed call
passes instead: the first forward would append the block's keys and values to the cache, and the recompute would
append them again and attend over both, the first ones without gradient (the keys' and values' projections would get
none). A training forward has no use for the cache; transformers' own checkpointing drops it the same way."""


def mlp_value_unused(mlp: nn.Module) -> bool:
    """Whether ``mlp`` runs inside its block's recompute, where nothing reads its output value."""
    return id(mlp) in _UNUSED_VALUES.get()


def in_plain_block() -> bool:
    """Whether a block that is not checkpointed is running its forward here (its MLP runs whole: module
    docstring)."""
    return _PLAIN_BLOCK.get()


class BlockCheckpoints:
    """The stash of block inputs of one model, the order blocks ran in (for the one-ahead prefetch) and, under partial
    residency, what each block was called with (for the regenerating forward)."""

    def __init__(self, stashes: StashFactory, options: BlockOffloadOptions, attentions: Sequence[Any] = (),
                 num_blocks: int = 1) -> None:
        self.stashes = stashes
        self.attentions = list(attentions)
        """Told to keep what the recompute needs (unless it recomputes them); objects with ``recording`` and
        ``regenerating`` flags."""
        self.num_blocks = num_blocks
        self.configure(options)
        self.forward_order: list[int] = []  # stash keys of this step's blocks, in forward order
        self._stash: Optional[ChunkStash] = None
        self._calls: dict[int, tuple[CheckpointedForward, Any, tuple, RngState]] = {}
        """key -> (block, spec, other leaves, random states): what a regenerating forward calls the block with."""
        self._previous: Optional[tuple[weakref.ref, int]] = None  # the last block's hidden output and its version
        self.regenerated = 0
        """Block inputs regenerated in backwards so far."""

    def configure(self, options: BlockOffloadOptions) -> None:
        """Set how the next steps run (between steps: the strategy's choice for a sequence length), from ``options``
        resolved (no ``"auto"`` left). A count of at least the blocks keeps or checkpoints all (a plan made for a
        deeper config)."""
        assert options.resolved, f"BlockCheckpoints takes resolved options, got {options}"
        keep_inputs, checkpoint_blocks = options.kept_inputs, options.checkpointed_blocks
        check_plain_blocks(checkpoint_blocks, self.num_blocks, keep_inputs=keep_inputs,
                           recompute_attention=options.recompute_attention)
        self.prefetch = options.prefetch
        """Blocks ahead whose inputs come back during a block's backward."""
        self.reload_input = options.reload_input and self.stashes.offload
        """Leave a block's input on the host through its backward (when the stash offloads; module docstring)."""
        self.recompute_attention = options.recompute_attention
        """Run the attention again in the recompute instead of keeping its first pass."""
        self.keep_inputs = keep_inputs
        """Block inputs kept in the stash, evenly spaced; ``None``: all (module docstring)."""
        self._kept = kept_positions(self.num_blocks, keep_inputs)
        self.checkpointed = self.num_blocks if checkpoint_blocks is None else min(checkpoint_blocks, self.num_blocks)
        """Blocks checkpointed, the first ones; the others run plain (module docstring)."""

    def stash(self, device: torch.device) -> ChunkStash:
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

    def set_recording(self, on: bool) -> None:
        if self.recompute_attention:
            return  # nothing recorded: the recompute runs the attention again
        for attention in self.attentions:
            attention.recording = on

    # ---- partial residency ------------------------------------------------------------------------------------------
    def begin_forward(self, block: "CheckpointedForward", spec: Any, leaves: tuple, rng: "RngState") -> bool:
        """A block's first forward starts: note it and what it was called with (and the random states it starts
        from); whether its input goes to the stash (kept by the schedule, or not regenerable: module docstring)."""
        key = block.key
        if key in self.forward_order:  # an earlier forward whose graph was discarded without its backward
            self.forward_order.clear()
            self._calls.clear()
        follows = self._follows_previous(leaves[0])
        self.forward_order.append(key)
        if self.keep_inputs is None:
            return True
        self._calls[key] = (block, spec, leaves[1:], rng)
        return not follows or key in self._kept

    def end_forward(self, output: Any) -> None:
        """A block's first forward has returned ``output``: remember its hidden states, which the next block's input
        must be (unchanged) for that input to be regenerable."""
        hidden = _hidden_output(output)
        self._previous = None if hidden is None else (weakref.ref(hidden), hidden._version)

    def _follows_previous(self, hidden: Tensor) -> bool:
        """Whether ``hidden`` holds the last block's output, unchanged: that tensor or an alias of it (the same memory
        and layout; FSDP2's hooks hand a block an alias of its input), not written since (an alias shares the version
        counter). The output is alive (the weak reference), so no other tensor can sit in its memory."""
        if not self.forward_order or self._previous is None:
            return False  # the first block of a forward
        ref, version = self._previous
        output = ref()
        return (output is not None and hidden._version == version and hidden.device == output.device
                and hidden.dtype == output.dtype and hidden.shape == output.shape
                and hidden.stride() == output.stride() and hidden.storage_offset() == output.storage_offset()
                and hidden.untyped_storage().data_ptr() == output.untyped_storage().data_ptr())

    def regenerate(self, key: int) -> None:
        """Before block ``key``'s backward: if its input is not in the stash, run the blocks from the nearest stashed
        input up to it forward again (no gradients) and stash their outputs as the inputs they were."""
        stash = self._stash
        if key in stash:
            return
        end = self.forward_order.index(key)
        start = end - 1
        while self.forward_order[start] not in stash:
            start -= 1
            assert start >= 0, "the first block's input is always kept"
        keys = self.forward_order[start:end + 1]
        hidden = stash.get(keys[0])
        self.set_regenerating(True)
        try:
            with torch.no_grad():
                for source, target in zip(keys, keys[1:]):
                    block, spec, others, rng = self._calls[source]
                    with _gathered(block.module), rng.restored():
                        hidden = _hidden_output(block.run(spec, (hidden, *others)))
                    if source == keys[0]:
                        stash.release(source)  # the kept input stays on the host for its own backward
                    stash.put(target, hidden)
                    self.regenerated += 1
        finally:
            self.set_regenerating(False)

    def set_regenerating(self, on: bool) -> None:
        for attention in self.attentions:
            attention.regenerating = on

    def end_backward(self, key: int) -> None:
        """Block ``key``'s backward is done: what it was called with is needed no more; the first block's ends the
        step."""
        self._calls.pop(key, None)
        if key == self.forward_order[0]:
            self.forward_order.clear()
            self._calls.clear()
            self._previous = None


def _hidden_output(output: Any) -> Optional[Tensor]:
    """The hidden states a block returns: its first tensor output (the next block's input)."""
    return next((leaf for leaf in tree_flatten(output)[0] if isinstance(leaf, Tensor)), None)


@contextlib.contextmanager
def _gathered(module: Optional[nn.Module]) -> Any:
    """FSDP2 leaves a block's parameters sharded between its forward and its backward: gathered for a forward run
    again in the backward, sharded again after it."""
    if not isinstance(module, FSDPModule):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


class _OffloadedCheckpoint(torch.autograd.Function):
    """One block, checkpointed, its first input kept in the host stash.

    | tensor | shape | kept for backward |
    |---|---|---|
    | anchor (in) | (0,) | no: an empty tensor that requires grad, so the output does whenever the block has trainable
    parameters, also when no input does (frozen embeddings, a frozen block before it) |
    | hidden (in) | (B, S/P, hidden) | in the host stash (pinned), prefetched one block ahead in backward; with
    ``reload_input`` the tensors saved from it in the recompute point at the host copy until unpacked |
    | other tensor inputs | small (position ids, RoPE tables) | as they are |
    | block activations | — | no: recomputed in backward (attention is not: see the module docstring) |
    | random number generator states | CPU, and the input's CUDA device | yes: the recompute draws what the first
    forward drew (dropout, e.g. an adapter's) |
    """

    @staticmethod
    def forward(ctx, block: "CheckpointedForward", spec: Any, anchor: Tensor, *leaves: Any) -> Any:
        owner, key = block.owner, block.key
        hidden = leaves[0]
        stash = owner.stash(hidden.device)
        if key in stash:
            stash.free(key)  # a graph discarded without backward
        rng = RngState(hidden.device)
        if owner.begin_forward(block, spec, leaves, rng):
            stash.put(key, hidden.detach())
        ctx.block, ctx.spec, ctx.others, ctx.rng = block, spec, leaves[1:], rng
        owner.set_recording(True)
        try:
            with torch.no_grad():
                output = block.run(spec, (hidden, *leaves[1:]))
        finally:
            owner.set_recording(False)
        owner.end_forward(output)
        return output

    @staticmethod
    def backward(ctx, *grad_outputs: Tensor) -> tuple[Optional[Tensor], ...]:
        block = ctx.block
        owner = block.owner
        owner.regenerate(block.key)  # a block whose input was not kept: regenerated into the stash first
        if block.mlp is None:
            owner.prefetch_before(block.key)
        hidden = RecomputeInput(owner._stash, block.key, on_host=owner.reload_input,
                                frees_early=block.mlp is not None, needs_grad=ctx.needs_input_grad[3])
        others = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, Tensor) else x for x in ctx.others]
        unused = _UNUSED_VALUES.set(block.unused_mlp_values)
        # the MLP's input gradient is complete when the MLP's backward ends: start the prefetch there
        mlp_hook = None if block.mlp is None else block.mlp.register_forward_pre_hook(
            functools.partial(_at_mlp, owner, block.key, hidden))
        try:
            with torch.enable_grad(), hidden.saved_tensor_hooks, ctx.rng.restored():
                outputs = block.run(ctx.spec, (hidden.pop(), *others))
        finally:
            _UNUSED_VALUES.reset(unused)
            if mlp_hook is not None:
                mlp_hook.remove()
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
        grad_hidden = hidden.finish()
        owner.end_backward(block.key)
        return (None, None, None, grad_hidden, *other_grads)


def _at_mlp(owner: BlockCheckpoints, key: int, hidden: RecomputeInput, mlp: nn.Module, args: tuple) -> None:
    """Forward pre-hook on a block's MLP in its recompute. The block's input is read no more (in these blocks the
    MLP follows the attention's residual add): under ``reload_input`` its device copy goes now. The inputs of the
    blocks before ``key`` come back once the gradient of the MLP's input is complete, i.e. when the MLP's backward
    has ended."""
    hidden.free_device_copy()
    x = args[0] if args else None
    if isinstance(x, Tensor) and x.requires_grad:
        x.register_hook(lambda grad: owner.prefetch_before(key))
    else:  # nothing to wait on: start now
        owner.prefetch_before(key)


class CheckpointedForward:
    """What replaces a block's ``forward``: the original forward, checkpointed with its input offloaded."""

    def __init__(self, forward: Callable[..., Any], owner: BlockCheckpoints, key: int,
                 mlp: Optional[nn.Module] = None, module: Optional[nn.Module] = None) -> None:
        self.forward, self.owner, self.key = forward, owner, key
        self.module = module
        """The block whose forward this is (FSDP2 gathers its parameters for a regenerating forward)."""
        self.mlp = mlp
        """The block's MLP when its output only feeds the residual add that ends the block (``residual_mlps``):
        nothing reads its value in the recompute, and the earlier blocks' inputs come back after its backward."""
        self.unused_mlp_values = frozenset() if mlp is None else frozenset({id(mlp)})

    def run(self, spec: Any, leaves: tuple) -> Any:
        args, kwargs = tree_unflatten(list(leaves), spec)
        return self.forward(*args, **kwargs)

    def trains(self, leaves: Sequence[Any]) -> bool:
        """Whether a call with ``leaves`` builds a graph: an input or a parameter of the block requires grad."""
        params = self.module.parameters() if self.module is not None else ()
        return any(isinstance(x, Tensor) and x.requires_grad for x in leaves) or any(p.requires_grad for p in params)

    def plain(self, *args: Any, **kwargs: Any) -> Any:
        """The forward of a block that is not checkpointed: autograd keeps what it needs, its MLPs run whole."""
        token = _PLAIN_BLOCK.set(True)
        try:
            return self.forward(*args, **kwargs)
        finally:
            _PLAIN_BLOCK.reset(token)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, _ = tree_flatten((args, kwargs))
        if not leaves or not isinstance(leaves[0], Tensor) or not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)  # evaluation, or a call without hidden states first
        if not self.trains(leaves):
            return self.forward(*args, **kwargs)  # a frozen block on frozen inputs: no graph, nothing to recompute
        if self.key >= self.owner.checkpointed:
            return self.plain(*args, **kwargs)
        # the forward runs twice (and a third time to regenerate an input): it must not fill a KV cache each time
        kwargs = {**kwargs, **{name: value for name, value in STATE_ARGUMENTS.items() if name in kwargs}}
        leaves, spec = tree_flatten((args, kwargs))
        # the parameters take part through the recompute in backward: the anchor makes the output require grad
        # whatever the inputs do (frozen embeddings, a frozen block before this one)
        anchor = leaves[0].new_empty(0).requires_grad_()
        return _OffloadedCheckpoint.apply(self, spec, anchor, *leaves)


def offloaded_blocks(blocks: Sequence[nn.Module]) -> Optional[BlockCheckpoints]:
    """The owner of ``blocks`` when :func:`apply_block_offload` has already wrapped all of them, else ``None``."""
    forwards = [block.forward for block in blocks]
    if forwards and all(isinstance(f, CheckpointedForward) for f in forwards):
        return forwards[0].owner
    return None


def apply_block_offload(
    blocks: Sequence[nn.Module], *, stashes: StashFactory, options: BlockOffloadOptions = BlockOffloadOptions(),
    attentions: Sequence[Any] = (), unused_mlp_values: Optional[Mapping[nn.Module, nn.Module]] = None,
    **choices: Any,
) -> BlockCheckpoints:
    """Checkpoint each of ``blocks`` with its input in ``stashes`` (host memory when offloading); in place,
    idempotent. ``options`` (or its fields given by name in ``choices``; ``None`` for a count: all) say how: the
    attention recomputed or its first pass kept (``attentions`` record it), inputs reloaded, prefetched, kept or
    regenerated, blocks checkpointed or plain (module docstring); ``"auto"`` is what the blocks do by themselves.
    ``unused_mlp_values`` maps a block to its MLP whose output only feeds the block's residual add. Returns the
    blocks' owner."""
    if not blocks:
        raise ValueError("apply_block_offload got no blocks")
    wrapped = offloaded_blocks(blocks)
    if wrapped is not None:
        return wrapped  # fit then validate must not wrap twice
    options = replace(options, **{name: "all" if value is None else value for name, value in choices.items()})
    owner = BlockCheckpoints(stashes, options.resolve({}), attentions, len(blocks))
    unused = unused_mlp_values or {}
    for key, block in enumerate(blocks):
        replace_forward(block, CheckpointedForward(block.forward, owner, key, unused.get(block), block))
    return owner
