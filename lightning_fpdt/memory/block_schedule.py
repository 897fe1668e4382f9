"""How ``ActivationOffload``'s checkpointed blocks run: its options (:class:`BlockOffloadOptions`), the checks of
``keep_inputs`` and ``checkpoint_blocks``, and the schedule of partial residency (memory/block_offload.py,
docs/design.md §6)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Optional, Union

from lightning_fpdt.flops import is_count
from lightning_fpdt.sequence.options import check_switch


def _auto(alone: Any) -> Any:
    """A field that may be ``"auto"`` (the plan's choice), and what it is where nothing plans (``alone``)."""
    return field(default="auto", metadata={"alone": alone})


@dataclass(frozen=True, kw_only=True)
class BlockOffloadOptions:
    """How the checkpointed blocks run, as ``ActivationOffload``'s user gives it. A field left ``"auto"`` is the
    strategy's plan's choice for the sequence length that runs (:meth:`resolve`, from ``apply_memory_choice``), or,
    where nothing plans, what the blocks do by themselves (each field's ``alone`` value). Each field keeps the name of
    the planner's feature field that counts it (``MemoryFeatures``), so an option is one field here, its mechanism in
    :class:`~lightning_fpdt.memory.block_offload.BlockCheckpoints` and its planner feature."""

    recompute_attention: Union[Literal["auto"], bool] = _auto(False)
    """Run the FPDT attention again in the recompute instead of keeping every layer's chunks and output until its
    backward (alone: off)."""
    reload_input: Union[Literal["auto"], bool] = _auto(False)
    """Leave each block's input on the host through the block's backward and bring it back only for the block's first
    norm; only where the inputs are offloaded (alone: off)."""
    prefetch: Union[Literal["auto"], int] = _auto(1)
    """How many blocks ahead their inputs come back during the backward (alone: 1)."""
    keep_inputs: Union[Literal["auto", "all"], int] = _auto("all")
    """``"all"``, or how many block inputs, evenly spaced from the first, wait for the backward; the others are
    regenerated there (partial residency; alone: all)."""
    checkpoint_blocks: Union[Literal["auto", "all"], int] = _auto("all")
    """``"all"``, or how many blocks, the first ones, are checkpointed; the others run plain (alone: all)."""

    def __post_init__(self) -> None:
        if self.prefetch != "auto" and not is_count(self.prefetch, least=0):
            raise ValueError(f"prefetch must be >= 0 blocks, got {self.prefetch!r} (or 'auto': the strategy chooses)")
        check_switch("recompute_attention", self.recompute_attention)
        check_switch("reload_input", self.reload_input)
        check_keep_inputs(self.keep_inputs)
        check_checkpoint_blocks(self.checkpoint_blocks)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The options' names, in the order of the fields."""
        return tuple(option.name for option in fields(cls))

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.names()}

    def resolve(self, chosen: Mapping[str, Any]) -> "BlockOffloadOptions":
        """The options in force: a value given stays; ``"auto"`` becomes the plan's choice in ``chosen``, or before
        any choice the field's ``alone`` value."""
        return replace(self, **{option.name: chosen.get(option.name, option.metadata["alone"])
                                for option in fields(self) if getattr(self, option.name) == "auto"})

    @property
    def resolved(self) -> bool:
        return "auto" not in self.as_dict().values()

    @property
    def kept_inputs(self) -> Optional[int]:
        """``keep_inputs`` as the blocks take it: ``None`` for all."""
        return None if self.keep_inputs == "all" else self.keep_inputs

    @property
    def checkpointed_blocks(self) -> Optional[int]:
        """``checkpoint_blocks`` as the blocks take it: ``None`` for all."""
        return None if self.checkpoint_blocks == "all" else self.checkpoint_blocks

    def check_blocks(self, num_blocks: int) -> None:
        """The counts against a model of ``num_blocks`` blocks (``ValueError`` naming the choices)."""
        check_keep_inputs(self.keep_inputs, num_blocks=num_blocks)
        check_checkpoint_blocks(self.checkpoint_blocks, num_blocks=num_blocks)


def _check_count(name: str, value: Any, num_blocks: Optional[int], words: tuple[str, ...], least: int,
                 counted: str) -> None:
    """``value`` is one of ``words`` or an int from ``least`` to the ``num_blocks`` blocks (when known); ValueError
    naming the choices otherwise."""
    if isinstance(value, str) and value in words:
        return
    if not is_count(value, least=least) or (num_blocks is not None and value > num_blocks):
        blocks = "the number of blocks" if num_blocks is None else f"the model's {num_blocks} blocks"
        choices = "".join(f"{word!r}, " for word in words[:-1]) + (f"{words[-1]!r} or " if words else "")
        raise ValueError(f"{name} must be {choices}a number of {counted} from {least} to {blocks}, got {value!r}")


def check_checkpoint_blocks(value: Any, num_blocks: Optional[int] = None,
                            words: tuple[str, ...] = ("auto", "all")) -> None:
    """``checkpoint_blocks`` is one of ``words`` or a count from 0 to the ``num_blocks`` blocks (when known), the
    first ones checkpointed and the others plain; ValueError naming the choices."""
    _check_count("checkpoint_blocks", value, num_blocks, words, 0, "blocks checkpointed")


def check_plain_blocks(checkpoint_blocks: Optional[int], num_blocks: Optional[int], *, keep_inputs: Optional[int],
                       recompute_attention: bool) -> None:
    """Blocks left plain (fewer than all checkpointed) go with every input kept and the attention not recomputed:
    ValueError naming the fix otherwise."""
    if checkpoint_blocks is None or (num_blocks is not None and checkpoint_blocks >= num_blocks):
        return
    if keep_inputs is not None or recompute_attention:
        what = f"keep_inputs={keep_inputs}" if keep_inputs is not None else "recompute_attention=True"
        raise ValueError(f"checkpoint_blocks={checkpoint_blocks} leaves blocks plain (their activations kept on the "
                         f"GPU) while {what} saves memory on every block: use checkpoint_blocks='all' with it, or "
                         f"drop it")


def check_keep_inputs(value: Any, num_blocks: Optional[int] = None, words: tuple[str, ...] = ("auto", "all")) -> None:
    """``keep_inputs`` is one of ``words`` (an option's ``"auto"``, ``"all"``) or a count from 1 to the
    ``num_blocks`` blocks (when known); ValueError naming the choices."""
    _check_count("keep_inputs", value, num_blocks, words, 1, "block inputs")


def kept_positions(num_blocks: int, keep_inputs: Optional[int]) -> frozenset[int]:
    """The forward positions of the blocks whose inputs are kept: ``keep_inputs`` of the ``num_blocks`` evenly spaced
    from the first (``⌊i·L/k⌋``), or all of them for ``None`` (or ``k >= L``)."""
    if keep_inputs is None or keep_inputs >= num_blocks:
        return frozenset(range(num_blocks))
    return frozenset(i * num_blocks // keep_inputs for i in range(keep_inputs))


def largest_segment(num_blocks: int, keep_inputs: Optional[int]) -> int:
    """The most inputs regenerated at once, between two kept ones of :func:`kept_positions`: ``⌈L/k⌉ - 1`` (the
    ``k`` gaps between kept positions add up to ``L``, none is longer than ``⌈L/k⌉``, one is as long); 0 when all
    are kept."""
    if keep_inputs is None or keep_inputs >= num_blocks:
        return 0
    return math.ceil(num_blocks / keep_inputs) - 1
