"""The rates a run's plans are timed at: this GPU's calibration (``lightning_fpdt.planner.calibration``), read from the
cache or, where nothing is cached, measured once on the run's first GPU use, and the shapes a new sequence length
needs measured when it is first planned. Rank 0 measures (the sequence-parallel group's all-to-all every rank of it
measures together) and shares what it has with every rank, so that every rank plans a length with the same rates
and so to the same configuration."""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Optional

import torch

from lightning_fpdt.planner.calibration import Calibration, current_key, needed_shapes
from lightning_fpdt.planner.plan import timed_sizes
from lightning_fpdt.planner.rates import StepRates
from lightning_fpdt.planner.request import PlanRequest


class RunRates:
    """The calibration of a run's GPU, kept for the run (one per :class:`~lightning_fpdt.strategy.budget.MemoryBudget`).

    Args:
        log: where the calibration says what it measured (rank 0 only).
    """

    def __init__(self, *, log: Callable[[str], Any]) -> None:
        self.log = log
        self.calibration: Optional[Calibration] = None

    def for_request(self, request: PlanRequest, *, device: torch.device, global_rank: int,
                    share: Callable[[Any], Any], group: Any = None, group_size: int = 1,
                    offload_dir: Optional[str] = None) -> StepRates:
        """The rates to plan ``request`` with, on every rank alike: what is cached for this GPU, with what the request
        needs and is not measured yet measured first on rank 0 (``device``: this rank's; ``share``: rank 0's value
        on every rank, collective; ``group``: the sequence-parallel group of ``group_size`` ranks, whose all-to-all
        every rank of it measures together)."""
        data = None
        if global_rank == 0:
            if self.calibration is None:
                self.calibration = Calibration.load(current_key(device))
            calibration = self.calibration
            shapes = needed_shapes(timed_sizes(request))
            missing = calibration.missing(shapes)
            first = not calibration.measured
            if first or len(missing):
                if first:
                    self.log(f"fpdt: calibrating this GPU ({calibration.key.describe()}) once; cached at "
                             f"{calibration.path}")
                started = time.monotonic()
                left = calibration.measure(device, shapes=missing, offload_dir=offload_dir)
                self._save(calibration)
                self.log(f"fpdt: calibrated in {time.monotonic() - started:.1f} s: {len(missing) - len(left)} of "
                         f"{len(missing)} shapes this plan times"
                         + (f" ({len(left)} left to the nearest measured one)" if len(left) else "")
                         + (", and this GPU's copies and memory-bound ops" if first else ""))
            data = calibration.data
        data = share(data)
        if global_rank != 0:
            self.calibration = Calibration.of_data(data)
        if group is not None and group_size > 1 and share(str(group_size) not in data["all_to_all"]):
            # every rank of the group sends and receives: all measure, rank 0 keeps and shares its figure
            self.calibration.measure(device, group=group)
            if global_rank == 0:
                self._save(self.calibration)
            self.calibration = Calibration.of_data(share(self.calibration.data), self.calibration.path)
        return self.calibration.rates(group_size=group_size)

    def _save(self, calibration: Calibration) -> None:
        try:
            calibration.save()
        except OSError as error:  # a read-only home: the run keeps its measurements, the next run measures again
            warnings.warn(f"fpdt: the calibration of this GPU could not be cached ({error}); it is used for this run "
                          f"and measured again by the next", stacklevel=3)
