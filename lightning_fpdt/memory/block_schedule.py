"""Which blocks ``ActivationOffload`` checkpoints and whose inputs it keeps: the checks of ``keep_inputs`` and
``checkpoint_blocks`` and the schedule of partial residency (memory/block_offload.py, docs/design.md §6)."""

from __future__ import annotations

import math
from typing import Any, Optional

from lightning_fpdt.flops import is_count


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
