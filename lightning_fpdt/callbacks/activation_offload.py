"""ActivationOffload: checkpoint every transformer block and keep its input in host memory (docs/design.md §6).

The work is :func:`lightning_fpdt.memory.apply_block_offload`; this callback declares it. The FPDT attention is not
run again in the recomputed forward: its first forward's output is kept (on the host when the attention offloads) and
handed back to the recompute, and its backward uses the chunks stashed by that first forward (docs/design.md §4).
That keeps every layer's stash until its backward; ``recompute_attention=True`` trades it for a second attention
forward: the first forward stashes nothing, and only the layer in backward holds a stash, which is what lets a
full-depth model reach lengths where the stashes of all layers exceed the host's memory.

``keep_inputs`` keeps only some blocks' inputs and regenerates the others in the backward by running the forward again
from the nearest kept one (partial residency, docs/design.md §6): the host holds ``k`` inputs and one segment's
regenerated ones instead of all ``L``, for a second forward of the blocks between the kept ones.

``checkpoint_blocks`` checkpoints only the first blocks and runs the others as without checkpointing (their
activations kept on the GPU, nothing run again): where the GPU has room, the step saves those blocks' recompute.

``recompute_attention``, ``reload_input``, ``prefetch``, ``keep_inputs`` and ``checkpoint_blocks`` default to
``"auto"``: under ``strategy="fpdt"`` on a GPU the strategy chooses them, with its own ``"auto"`` options, as the
fastest configuration that fits the GPU and the host (``lightning_fpdt.planner.search``); elsewhere ``"auto"`` is what
the callback does by itself: the attention kept, the input prefetched one block ahead, not reloaded, every input
kept, every block checkpointed.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_fpdt.callbacks.transforms import transform_without_fpdt
from lightning_fpdt.integrations import residual_mlps, shared_attentions
from lightning_fpdt.memory import BlockCheckpoints, BlockOffloadOptions, apply_block_offload, find_blocks
from lightning_fpdt.offload.host_stash import StashFactory
from lightning_fpdt.planner.plan_options import MemoryFeatures


class ActivationOffload(Callback):
    """Checkpoint each transformer block; its input waits in pinned host memory (docs/design.md §6).

    Args:
        layer_classes: class names of the blocks to checkpoint; ``None``: the strategy's blocks (the largest
            ``nn.ModuleList``).
        pin_memory: pin the host buffers (CUDA only; pageable copies are synchronous and ~3× slower).
        prefetch: how many blocks ahead their inputs come back during the backward; ``"auto"``: chosen by the
            strategy (module docstring), else 1.
        offload: ``False`` keeps the block inputs on the GPU (plain checkpointing without recomputing attention).
        recompute_attention: run the FPDT attention again in the recompute instead of keeping every layer's chunks
            and output until its backward: host (or GPU) memory of one layer's stash instead of all layers', for
            about +30% attention compute (a second forward beside the backward's 2.5 forwards' worth);
            ``"auto"``: chosen by the strategy, else off.
        reload_input: leave each block's input on the host through the block's backward (what the recompute saves
            from it points at the host copy) and bring it back only for the block's first norm: one hidden-sized
            tensor ``B·S/P·hidden`` less on the GPU in every phase of the backward, for one more host-to-device copy
            per block that the backward waits for. With ``prefetch=0`` too, a block's backward holds no block input
            but briefly at its end: what reaches the longest sequences on one GPU. Needs ``offload=True``;
            ``"auto"``: chosen by the strategy, else off.
        keep_inputs: ``"all"``: every block's input waits for its backward; an int ``k`` (``1 <= k <=`` the number
            of blocks): only ``k`` of them, evenly spaced from the first, and the others are regenerated in the
            backward by running the blocks after the nearest kept input forward again (no gradients; the attention
            is not run again unless ``recompute_attention``). The host (or, with ``offload=False``, the GPU) then
            holds ``k`` inputs and at most ``⌈L/k⌉ - 1`` regenerated ones instead of ``L``, for a forward of the
            ``L - k`` blocks before them. The gradients are the same. ``"auto"``: chosen by the strategy (fewer only
            where the memory needs it), else ``"all"``.
        checkpoint_blocks: ``"all"``: every block is checkpointed; an int ``n`` (``0 <= n <=`` the number of
            blocks): only the first ``n``, and the others run plain: autograd keeps their activations on the GPU
            until their backward (about ``S/P·(4·hidden + 4·intermediate)`` bf16 values per block), their MLPs run
            whole (not over ``TiledMLP``'s tiles) and nothing of theirs is computed again, so the step saves their
            recompute. Plain blocks need every input kept and the attention not recomputed (``keep_inputs="all"``,
            ``recompute_attention=False``). ``"auto"``: chosen by the strategy (the fewest checkpointed blocks that
            fit), else ``"all"``.

    With ``strategy="fpdt"`` the strategy applies it before FSDP2; with another strategy it wraps the blocks of the
    LightningModule's model at ``setup`` (checkpointing and offload work; the attention is recomputed there).
    """

    fpdt_transform_slot = "activation_checkpointing"
    """The slot of ``apply_fpdt`` it fills: last of the memory transforms (its wrappers hold the tiled MLP), before
    FSDP2 (docs/design.md §5)."""

    def __init__(
        self,
        layer_classes: Optional[list[str]] = None,
        pin_memory: bool = True,
        prefetch: Union[Literal["auto"], int] = "auto",
        offload: bool = True,
        recompute_attention: Union[Literal["auto"], bool] = "auto",
        reload_input: Union[Literal["auto"], bool] = "auto",
        keep_inputs: Union[Literal["auto", "all"], int] = "auto",
        checkpoint_blocks: Union[Literal["auto", "all"], int] = "auto",
    ) -> None:
        self.options = BlockOffloadOptions(prefetch=prefetch, recompute_attention=recompute_attention,
                                           reload_input=reload_input, keep_inputs=keep_inputs,
                                           checkpoint_blocks=checkpoint_blocks)
        """How the blocks run, as given: ``"auto"`` where the strategy's plan chooses (``memory/block_schedule.py``)."""
        if reload_input is True and not offload:
            raise ValueError("reload_input brings block inputs back from the host: it needs offload=True (with "
                             "offload=False they stay on the GPU anyway)")
        self.layer_classes = layer_classes
        self.stashes = StashFactory(offload=offload, pin_memory=pin_memory, what="the checkpointed block inputs")
        self._chosen: dict[str, Any] = {}
        """The strategy's choice for the length that runs, of every option (:meth:`apply_memory_choice`)."""
        self._owners: dict[int, BlockCheckpoints] = {}
        """The block owner of each model transformed (by the model's id): a trained policy beside a trained value
        model has two."""

    def __getattr__(self, name: str) -> Any:
        """Each option as given (``callback.prefetch``, ...; ``"auto"`` included), read from :attr:`options`."""
        options = self.__dict__.get("options")
        if options is not None and name in BlockOffloadOptions.names():
            return getattr(options, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def _owner(self) -> Optional[BlockCheckpoints]:
        """The block owner of the first model transformed (the only one of a run with one model)."""
        return next(iter(self._owners.values()), None)

    @property
    def host_bytes(self) -> int:
        """Host memory allocated for block inputs."""
        return self.stashes.host_bytes

    @property
    def fpdt_memory_features(self) -> MemoryFeatures:
        """What the memory planner counts for this callback ("auto" where the strategy is to choose); its options go
        by their names, which are the planner's."""
        offload = self.stashes.offload
        declared = self.options.as_dict()
        if not offload:
            declared["reload_input"] = False  # nothing to reload: the inputs stay on the GPU
        return MemoryFeatures(activation_checkpointing=True, activation_offload=offload, **declared)

    def in_force(self) -> BlockOffloadOptions:
        """The options in force: the ones given, the strategy's choice for ``"auto"`` (:meth:`apply_memory_choice`),
        or, before any choice, what the blocks do by themselves."""
        return self.options.resolve(self._chosen)

    def resolved(self, name: str) -> Any:
        """The value of one option in force (:meth:`in_force`), by name."""
        return getattr(self.in_force(), name)

    def apply_memory_choice(self, **choice: Any) -> None:
        """The strategy's choice for this run's sequence length, by option name: taken for the options left at
        ``"auto"`` (an explicit value stays; the strategy plans with it). ``keep_inputs`` and ``checkpoint_blocks``
        left out are all."""
        unknown = sorted(set(choice) - set(BlockOffloadOptions.names()))
        if unknown:
            raise TypeError(f"apply_memory_choice got options {unknown} that ActivationOffload does not have")
        self._chosen = {"keep_inputs": "all", "checkpoint_blocks": "all", **choice}
        for owner in self._owners.values():
            owner.configure(self.in_force())

    def fpdt_transform(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        blocks = find_blocks(model, self.layer_classes) if self.layer_classes else blocks
        if not blocks:
            raise ValueError(
                f"ActivationOffload found no transformer blocks in {type(model).__name__}: give layer_classes=[...]"
            )
        self.options.check_blocks(len(blocks))
        # the attentions record their first pass (and do not run again) unless the recompute runs them
        self._owners[id(model)] = apply_block_offload(
            blocks, stashes=self.stashes, options=self.in_force(), attentions=shared_attentions(model),
            unused_mlp_values=residual_mlps(blocks),
        )

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        transform_without_fpdt(self, trainer, pl_module, self.layer_classes, require_parameters=False)

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *args: Any) -> None:
        # a host tensor: Lightning keeps the logged value where it is given; a Python float would be copied to the
        # GPU, from pageable memory, which waits for the step's last kernel on every batch
        pl_module.log("memory/activation_offload_host_gib", torch.tensor(self.host_bytes / 2**30), on_step=True,
                      logger=True)
