"""SequenceLengthCurriculum: grow the training sequence length on a schedule of optimizer steps."""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from typing import Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from lightning_fpdt.data.base import LongContextDataModule

Schedule = Union[Mapping[int, int], Sequence[tuple[int, int]]]


class SequenceLengthCurriculum(pl.Callback):
    """Train on shorter sequences first and grow them to the data module's full length, as large runs do.

    The schedule maps optimizer steps to lengths: from step ``s`` on (until the next entry) training batches are
    ``length`` tokens long. Before the first entry the first length applies; lengths must not shrink. Either give
    ``schedule`` explicitly, or ``start``/``target``/``ramp_steps`` for a geometric ramp: the length doubles from
    ``start`` in equally spaced stages and reaches ``target`` at ``ramp_steps``.

    The data module does the cutting (it must be a :class:`~lightning_fpdt.data.LongContextDataModule`: it crops
    each training batch just before the strategy shards it, so the fpdt strategy pads it and picks its chunk count
    for the new length). Validation runs at the data module's full length. The length in force is logged as
    ``train/seq_len`` when it changes.

    Args:
        schedule: ``{step: length}`` or ``[(step, length), ...]``.
        start: first length of a geometric ramp (instead of ``schedule``).
        target: last length of the ramp; ``None``: the data module's ``seq_len``.
        ramp_steps: optimizer step at which the ramp reaches ``target``.
        multiple_of: lengths of the ramp are rounded down to a multiple of this (e.g. sequence_parallel_size ×
            chunks, so no padding is needed); explicit schedules are used as given.
    """

    def __init__(
        self,
        schedule: Optional[Union[dict[int, int], list[tuple[int, int]]]] = None,
        *,
        start: Optional[int] = None,
        target: Optional[int] = None,
        ramp_steps: Optional[int] = None,
        multiple_of: int = 1,
    ) -> None:
        super().__init__()
        ramp = (start, ramp_steps)
        if schedule is not None and any(v is not None for v in (*ramp, target)):
            raise ValueError("SequenceLengthCurriculum: give either schedule or start/target/ramp_steps, not both")
        if schedule is None and (start is None or ramp_steps is None):
            raise ValueError(
                "SequenceLengthCurriculum needs schedule={step: length, ...} or start=..., ramp_steps=... "
                "(and optionally target=...)"
            )
        if multiple_of < 1:
            raise ValueError(f"SequenceLengthCurriculum(multiple_of={multiple_of}) must be at least 1")
        self.multiple_of = multiple_of
        self._ramp = (start, target, ramp_steps) if schedule is None else None
        self._steps: list[int] = []
        self._lengths: list[int] = []
        self._last_logged: Optional[int] = None
        if schedule is not None:
            self._set_schedule(schedule)
        else:
            assert start is not None and ramp_steps is not None
            if start < 1 or ramp_steps < 1 or (target is not None and target < start):
                raise ValueError(
                    f"SequenceLengthCurriculum: need 1 <= start ({start}) <= target ({target}) and ramp_steps "
                    f"({ramp_steps}) >= 1"
                )
            if target is not None:
                self._set_schedule(geometric_schedule(start, target, ramp_steps, multiple_of))

    @property
    def schedule(self) -> list[tuple[int, int]]:
        """``[(step, length), ...]`` in step order (empty until a ramp without ``target`` meets its data module)."""
        return list(zip(self._steps, self._lengths))

    def _set_schedule(self, schedule: Schedule) -> None:
        items = sorted((schedule.items() if isinstance(schedule, Mapping) else schedule), key=lambda item: item[0])
        items = [(int(step), int(length)) for step, length in items]
        if not items:
            raise ValueError("SequenceLengthCurriculum: the schedule is empty")
        for step, length in items:
            if step < 0 or length < 1:
                raise ValueError(f"SequenceLengthCurriculum: step ({step}) must be >= 0 and length ({length}) >= 1")
        for (s0, l0), (s1, l1) in zip(items, items[1:]):
            if s0 == s1:
                raise ValueError(f"SequenceLengthCurriculum: step {s0} appears twice in the schedule")
            if l1 < l0:
                raise ValueError(
                    f"SequenceLengthCurriculum: lengths must not shrink, but step {s1} has {l1} < {l0} at step {s0}"
                )
        self._steps = [step for step, _ in items]
        self._lengths = [length for _, length in items]

    def seq_len_at(self, step: int) -> int:
        """The training length of optimizer step ``step``."""
        if not self._steps:
            raise RuntimeError("SequenceLengthCurriculum: the schedule is not known before the data module is set up")
        return self._lengths[max(0, bisect.bisect_right(self._steps, step) - 1)]

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        datamodule = trainer.datamodule
        if not isinstance(datamodule, LongContextDataModule):
            raise ValueError(
                "SequenceLengthCurriculum needs a data module that crops its training batches: a subclass of "
                f"lightning_fpdt.data.LongContextDataModule (got {type(datamodule).__name__})"
            )
        if self._ramp is not None and not self._steps:
            start, _, ramp_steps = self._ramp
            assert start is not None and ramp_steps is not None
            if start > datamodule.seq_len:
                raise ValueError(
                    f"SequenceLengthCurriculum(start={start}) exceeds the data's seq_len {datamodule.seq_len}"
                )
            self._set_schedule(geometric_schedule(start, datamodule.seq_len, ramp_steps, self.multiple_of))
        too_long = [length for length in self._lengths if length > datamodule.seq_len]
        too_short = [length for length in self._lengths if length < datamodule.min_seq_len]
        if too_long or too_short:
            raise ValueError(
                f"SequenceLengthCurriculum: lengths {too_long + too_short} are outside what "
                f"{type(datamodule).__name__} produces: {datamodule.min_seq_len} to seq_len {datamodule.seq_len}"
            )
        rank_zero_info(f"SequenceLengthCurriculum: (step, length) {self.schedule}")
        datamodule.set_length_schedule(self.seq_len_at)

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit" and isinstance(trainer.datamodule, LongContextDataModule):
            trainer.datamodule.set_length_schedule(None)

    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: object, batch_idx: int
    ) -> None:
        seq_len = self.seq_len_at(trainer.global_step)
        if seq_len != self._last_logged:
            self._last_logged = seq_len
            for logger in trainer.loggers:
                logger.log_metrics({"train/seq_len": seq_len}, step=trainer.global_step)

    def state_dict(self) -> dict:
        return {"schedule": self.schedule}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("schedule"):
            self._set_schedule(state_dict["schedule"])


def geometric_schedule(start: int, target: int, ramp_steps: int, multiple_of: int = 1) -> list[tuple[int, int]]:
    """Lengths doubling from ``start`` to ``target`` in equally spaced stages, ``target`` reached at ``ramp_steps``;
    lengths rounded down to ``multiple_of`` (never below it)."""
    if not 1 <= start <= target:
        raise ValueError(f"need 1 <= start ({start}) <= target ({target})")
    doublings = max(0, math.ceil(math.log2(target / start)))
    lengths = [min(start * 2**i, target) for i in range(doublings)] + [target]
    lengths = [length if length == target else max(multiple_of, length // multiple_of * multiple_of)
               for length in lengths]
    stage_steps = [round(i * ramp_steps / doublings) if doublings else 0 for i in range(len(lengths))]
    schedule: dict[int, int] = {}
    for step, length in zip(stage_steps, lengths):
        schedule[step] = length
    return sorted(schedule.items())
