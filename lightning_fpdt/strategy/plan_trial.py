"""The plan trials of a run (``FPDTStrategy(plan_trial=True)``, ``lightning_fpdt.planner.trial``): the training steps
timed, each trial told its steps' times, the choice shared by every rank and kept with the checkpoint.

A step's time is the device's time from the start of its batch to the start of the next training batch: one CUDA
event recorded at each training batch's start, and the interval between two read when the batch after them starts,
by which time the device has long passed the later event: the timing never waits for the device. An evaluation or a
checkpoint's save between two training batches makes that interval no step's (:meth:`TrialSteps.interrupt`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

from lightning_fpdt.planner.measure import Clock, DeviceClock
from lightning_fpdt.planner.trial import PlanTrial, TrialCandidate, choice_of

CHOICES_KEY = "fpdt_plan_choices"
"""The checkpoint key of the trials' choices: ``{"<seq_len>x<batch_size>": {option: value}}``."""

Key = tuple[int, int]


def key_name(key: Key) -> str:
    return f"{key[0]}x{key[1]}"


class TrialSteps:
    """The trials of one run.

    Args:
        candidates: ``(seq_len, batch_size) -> candidates`` (the planner's :func:`~lightning_fpdt.planner.trial.
            trial_candidates` of the length's request); fewer than two: no trial.
        share: rank 0's value on every rank (collective); the identity on one process.
        log: where the choice is said (rank 0's).
        clock: times the steps (CUDA events; a test's fake clock).
    """

    def __init__(self, *, candidates: Callable[[int, int], Sequence[TrialCandidate]],
                 share: Callable[[Any], Any] = lambda value: value, log: Callable[[str], Any] = print,
                 clock: Optional[Clock] = None) -> None:
        self.candidates = candidates
        self.share, self.log = share, log
        self.clock = clock
        self.trials: dict[Key, PlanTrial] = {}
        self.kept: dict[str, dict[str, Any]] = {}
        """The choices made, by :func:`key_name` (kept with the checkpoint: a resumed run does not try again)."""
        self._marks: list[dict[str, Any]] = []  # key, step, mark, lost: the last training batches' starts
        self._kept_plans: dict[Key, Optional[Any]] = {}  # the plan of each choice kept from a checkpoint

    def state(self) -> dict[str, dict[str, Any]]:
        """What a checkpoint keeps: the choices made."""
        return dict(self.kept)

    def load_state(self, choices: dict[str, dict[str, Any]]) -> None:
        self.kept.update(choices)

    def interrupt(self) -> None:
        """Something other than a training step ran since the last training batch started (an evaluation, a save):
        the interval up to the next one is no step's time."""
        if self._marks:
            self._marks[-1]["lost"] = True

    def step(self, key: Key) -> Optional[Any]:
        """A training batch of ``key`` about to run: time it, tell the trials the time of the step before the last
        (its end marked by the last batch's start, long passed by the device: reading it does not wait), and return
        the plan this step runs on (``None``: the length's own plan, where nothing was tried)."""
        trial = self._trial(key)
        if self.clock is not None:
            self._marks.append({"key": key, "step": -1, "mark": self.clock.mark(), "lost": False})
            self._read()
        if trial is None:
            return self.chosen_plan(key)
        step, index = trial.next_step()
        self._marks[-1]["step"] = step
        return trial.candidates[index].plan

    def _trial(self, key: Key) -> Optional[PlanTrial]:
        """The trial of ``key`` while it runs, started at the length's first training batch where no choice is kept
        (a choice kept by the checkpoint is looked up among the candidates instead); ``None`` once chosen, or where
        nothing is tried."""
        trial = self.trials.get(key)
        if trial is not None:
            return trial if not trial.decided else None
        if key in self._kept_plans:
            return None
        candidates = list(self.candidates(*key))
        kept = self.kept.get(key_name(key))
        if kept is not None:
            found = [c.plan for c in candidates if choice_of(c.plan) == kept]
            if candidates and not found:
                self.log(f"fpdt: S = {key[0]:,}: the configuration the checkpoint's run chose ({kept}) is not among "
                         f"those that fit now; the planner's fastest runs")
            self._kept_plans[key] = found[0] if found else None
            return None
        if len(candidates) < 2:
            self._kept_plans[key] = None  # one configuration within the margin: the length's plan
            return None
        if self.clock is None:
            self.clock = DeviceClock()
        self.trials[key] = trial = PlanTrial(candidates)
        self.log(f"fpdt: S = {key[0]:,}: {len(candidates)} configurations fit within the cost model's margin; "
                 f"trying each on {trial.warmup_steps} + {trial.timed_steps} training steps")
        return trial

    def _read(self) -> None:
        """The interval between the two marks before the last: the time of the step the first one began."""
        if len(self._marks) < 3:
            return
        timed, end = self._marks[-3], self._marks[-2]
        del self._marks[:-2]
        trial = self.trials.get(timed["key"])
        if trial is None or trial.decided or timed["step"] < 0:
            return
        if timed["lost"]:
            trial.lost(timed["step"])
        elif trial.measured(timed["step"], self.clock.seconds(timed["mark"], end["mark"])):
            trial.chosen = self.share(trial.chosen)  # every rank runs rank 0's choice
            key = timed["key"]
            self.kept[key_name(key)] = choice_of(trial.candidates[trial.chosen].plan)
            self.log(f"fpdt: S = {key[0]:,}: kept {trial.candidates[trial.chosen].label} for the rest of the run, the "
                     f"fastest of the trial:\n{trial.table()}")

    def chosen_plan(self, key: Key) -> Optional[Any]:
        """The plan chosen for ``key``: by its trial, or kept by the checkpoint (``None``: nothing tried, or not
        decided yet)."""
        trial = self.trials.get(key)
        if trial is not None:
            return trial.candidates[trial.chosen].plan if trial.decided else None
        return self._kept_plans.get(key)
