"""Trying the configurations the cost model cannot tell apart on the training steps themselves
(``FPDTStrategy(plan_trial=True)``).

Every configuration the search may choose computes the same gradients: the memory options change where tensors wait
and what runs twice, never the arithmetic. So where the fastest configurations that fit a new sequence length are
within :data:`TRIAL_MARGIN` of each other by the cost model (:func:`trial_candidates`), the run trains its first
steps of that length on each in turn, :data:`WARMUP_STEPS` untimed and :data:`TIMED_STEPS` timed, and keeps the
fastest by its median for the rest of the run.

:class:`PlanTrial` is the bookkeeping: which candidate a step runs on, the step times as they come (a timing may
arrive a step or two late: the strategy reads each step's CUDA events one step later, so that the timing adds no
synchronisation), the choice once every timed step is in, and the table it is logged as. Until the last timing is in,
the steps after the schedule run on the first candidate, the cost model's fastest (every rank alike: the ranks of a
run must run one configuration at each step, and they share the choice when it is made).

What it costs: with ``n`` candidates, at most ``(WARMUP_STEPS + TIMED_STEPS)·(n - 1)`` steps run on a candidate that
turns out not to be the fastest, and while the last timings come in, at most 2 more steps on the first candidate.
With :data:`MAX_TRIAL_CANDIDATES` = 4 that is at most 11 steps, each slower than the fastest by what the cost
model could not see: within the margin, 10%, by its estimate; were the measured steps even 1.5 times the fastest,
5.5 steps' time, 0.55% of a 1,000-step run (its first step of each candidate also pays that candidate's first
allocations, as the first step of any run does).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from lightning_fpdt.planner.components import MemoryPlan
from lightning_fpdt.planner.plan import prepared
from lightning_fpdt.planner.request import PlanRequest
from lightning_fpdt.planner.search import SEARCHED, changes_between, estimated_step_seconds, fitting_near

TRIAL_MARGIN = 0.10
"""The fitting configurations whose estimated steps are within this share of the fastest's are tried on the training
steps (the cost model's error is of this order: docs/planner.md)."""
MAX_TRIAL_CANDIDATES = 4
"""Configurations tried at most (the fastest estimates first)."""
WARMUP_STEPS = 1
"""Steps each candidate runs untimed first: its first step allocates its buffers (pinned stashes, kernels'
workspaces)."""
TIMED_STEPS = 2
"""Steps each candidate is timed on; the median counts."""


@dataclass(frozen=True)
class TrialCandidate:
    """One configuration tried."""

    label: str
    """What sets it apart from the first candidate (the search's fastest), in words."""
    estimate_s: float
    """The cost model's step."""
    plan: Any
    """What the run switches to (the strategy's: a :class:`~lightning_fpdt.planner.components.MemoryPlan`)."""


def choice_of(plan: MemoryPlan) -> dict[str, Any]:
    """The options a trial chose, as a checkpoint keeps them: every option the search sets, by name."""
    return {name: getattr(plan.options, name) for name in SEARCHED}


def label_of(plan: MemoryPlan, first: MemoryPlan) -> str:
    """``plan``'s options that differ from ``first``'s (``"as planned"`` for ``first`` itself)."""
    changes = changes_between(first.options, plan.options)
    return ", ".join(f"{name}={value}" for name, value in changes.items()) or "as planned"


def trial_candidates(request: PlanRequest, *, margin: float = TRIAL_MARGIN,
                     limit: int = MAX_TRIAL_CANDIDATES) -> list[TrialCandidate]:
    """The fitting configurations of ``request`` whose estimates are within ``margin`` of the fastest's (the fastest
    first), at most ``limit``; fewer than two: nothing to try."""
    run, base, free = prepared(request)
    plans: list[Any] = []
    for plan in fitting_near(run, base, free, margin=margin, limit=limit * SAME_ESTIMATE_SPARE):
        seconds = estimated_step_seconds(plan)
        if all(abs(seconds - estimated_step_seconds(kept)) > SAME_ESTIMATE * seconds for kept in plans):
            plans.append(plan)
    plans = plans[:limit]
    return [TrialCandidate(label_of(plan, plans[0]), estimated_step_seconds(plan), plan) for plan in plans]


SAME_ESTIMATE = 0.002
"""Configurations whose estimates are this close (a share) differ, by the model, in memory only (a block input kept
or regenerated at no cost it sees): the trial takes the first of them and spends its steps on configurations the
model prices differently (a chunk count, offload, the attention's recompute)."""
SAME_ESTIMATE_SPARE = 4
"""How many times :data:`MAX_TRIAL_CANDIDATES` configurations are looked at, so that the ones of equal estimates
left out leave room for others within the margin."""


class PlanTrial:
    """The trial of one sequence length (see the module docstring)."""

    def __init__(self, candidates: Sequence[TrialCandidate], *, warmup_steps: int = WARMUP_STEPS,
                 timed_steps: int = TIMED_STEPS) -> None:
        if len(candidates) < 2:
            raise ValueError(f"a trial needs two candidates or more, got {len(candidates)}")
        if warmup_steps < 0 or timed_steps < 1:
            raise ValueError(f"warmup_steps ({warmup_steps}) must be >= 0 and timed_steps ({timed_steps}) >= 1")
        self.candidates = list(candidates)
        self.warmup_steps, self.timed_steps = warmup_steps, timed_steps
        # (candidate, timed) of each step of the schedule: each candidate's warm-up, then its timed steps
        self._schedule = [(index, position >= warmup_steps) for index in range(len(self.candidates))
                          for position in range(warmup_steps + timed_steps)]
        self._steps: list[int] = []  # the candidate of each step begun
        self._times: dict[int, float] = {}  # step -> seconds, of the timed steps
        self.chosen: Optional[int] = None
        """The index of the fastest candidate, once every candidate has its timed steps."""

    def next_step(self) -> tuple[int, int]:
        """``(step, candidate index)`` of the step about to run: the schedule's, then the chosen one (until the last
        timings are in, the first candidate)."""
        step = len(self._steps)
        index = self._schedule[step][0] if step < len(self._schedule) else (self.chosen or 0)
        self._steps.append(index)
        return step, index

    def measured(self, step: int, seconds: float) -> bool:
        """The time of ``step`` (any order; steps off the schedule's timed ones are ignored). Returns whether this
        timing was the last one needed: the choice (:attr:`chosen`, the fastest median) is then made."""
        if step < len(self._schedule) and self._schedule[step][1]:
            self._times[step] = seconds
        counts = [0] * len(self.candidates)
        for timed in self._times:
            counts[self._schedule[timed][0]] += 1
        if self.chosen is None and min(counts) >= self.timed_steps:
            self.chosen = self.leader()
            return True
        return False

    def lost(self, step: int) -> None:
        """``step``'s time cannot be known (something else ran in it): a timed step of the schedule is run again at
        its end."""
        if step < len(self._schedule) and self._schedule[step][1] and step not in self._times:
            self._schedule.append((self._schedule[step][0], True))

    @property
    def decided(self) -> bool:
        return self.chosen is not None

    @property
    def scheduled_steps(self) -> int:
        return len(self._schedule)

    def medians(self) -> list[Optional[float]]:
        """Each candidate's median timed step so far (``None``: none timed yet)."""
        times: list[list[float]] = [[] for _ in self.candidates]
        for step, seconds in self._times.items():
            times[self._schedule[step][0]].append(seconds)
        return [statistics.median(t) if t else None for t in times]

    def leader(self) -> int:
        """The chosen candidate, else the fastest measured so far (the first candidate before any timing)."""
        if self.chosen is not None:
            return self.chosen
        medians = self.medians()
        timed = [index for index, median in enumerate(medians) if median is not None]
        return min(timed, key=lambda index: medians[index]) if timed else 0

    def table(self) -> str:
        """The trial as a table: each candidate, its estimate, its measured median, which was chosen."""
        medians = self.medians()
        lines = [f"  {'candidate':<60} {'estimate s':>10} {'measured s':>10}  chosen"]
        for index, (candidate, median) in enumerate(zip(self.candidates, medians)):
            lines.append(f"  {candidate.label[:60]:<60} {candidate.estimate_s:>10.3f} "
                         f"{'-' if median is None else f'{median:.3f}':>10}  {'yes' if index == self.chosen else ''}")
        return "\n".join(lines)
