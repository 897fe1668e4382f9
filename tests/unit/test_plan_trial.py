"""The plan trial (lightning_fpdt/planner/trial.py, strategy/plan_trial.py): which configuration each step runs on,
the step times as they come in late, the choice, its sharing between ranks and its keeping in checkpoints; with fake
step times."""

from __future__ import annotations

import pytest

from lightning_fpdt.planner import plan_memory
from lightning_fpdt.planner.request import PlanRequest
from lightning_fpdt.planner.trial import TRIAL_MARGIN, PlanTrial, TrialCandidate, choice_of, trial_candidates
from lightning_fpdt.strategy.plan_trial import TrialSteps, key_name

TINY = dict(geometry="tiny", seq_len=256, num_gpus=2, activation_offload=True, tiled_mlp=True, tiled_loss=True)


def _candidates(n: int) -> list[TrialCandidate]:
    return [TrialCandidate(f"c{i}", 1.0 + i / 100, f"plan {i}") for i in range(n)]


def test_each_candidate_runs_a_warm_up_and_two_timed_steps_then_the_fastest():
    """Three candidates: steps 0-8 run each in turn (warm-up, then two timed steps), the steps after them the first
    candidate until the last timing is in, then the fastest median; warm-up times do not count."""
    trial = PlanTrial(_candidates(3))
    steps = [trial.next_step() for _ in range(10)]
    assert [index for _, index in steps] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 0]
    times = {0: 99.0, 1: 5.0, 2: 7.0, 3: 0.1, 4: 4.0, 5: 4.2, 6: 0.1, 7: 6.0, 8: 9.0}
    decided = [trial.measured(step, times[step]) for step in (0, 2, 1, 3, 5, 4, 6, 7, 8)]  # in any order
    assert decided == [False] * 8 + [True] and trial.decided and trial.chosen == 1
    assert trial.medians() == [6.0, 4.1, 7.5]
    assert [trial.next_step()[1] for _ in range(2)] == [1, 1]
    table = trial.table()
    assert "c1" in table and table.splitlines()[2].rstrip().endswith("yes") and "4.100" in table


def test_a_trial_needs_two_candidates():
    """One candidate is nothing to try: a ValueError."""
    with pytest.raises(ValueError, match="two candidates"):
        PlanTrial(_candidates(1))


def test_candidates_are_the_fitting_plans_within_the_margin_fastest_first():
    """The candidates fit, start with plan_memory's choice and stay within TRIAL_MARGIN of its estimate."""
    request = PlanRequest.of(**TINY, recompute_attention="auto", keep_inputs="auto")
    candidates = trial_candidates(request)
    chosen = plan_memory(request)
    assert len(candidates) >= 2 and candidates[0].plan.options == chosen.options and candidates[0].label == "as planned"
    assert all(c.plan.fits for c in candidates)
    assert all(c.estimate_s <= candidates[0].estimate_s * (1 + TRIAL_MARGIN) for c in candidates)
    assert [c.estimate_s for c in candidates] == sorted(c.estimate_s for c in candidates)


def test_candidates_the_model_prices_alike_take_one_place(monkeypatch):
    """Configurations of one estimate (they differ in memory only, by the model: a block input kept or regenerated)
    take one place among the candidates, so a configuration priced a few per cent higher (another chunk count) is
    still tried: the first four within the margin of 1.0, 1.0, 1.001, 1.0, 1.03, 1.05 s give 1.0, 1.03 and 1.05."""
    from lightning_fpdt.planner import trial

    plans = [f"plan{i}" for i in range(6)]
    estimates = dict(zip(plans, [1.0, 1.0, 1.001, 1.0, 1.03, 1.05]))
    monkeypatch.setattr(trial, "prepared", lambda request: (None, None, set()))
    monkeypatch.setattr(trial, "fitting_near", lambda run, base, free, margin, limit: plans[:limit])
    monkeypatch.setattr(trial, "estimated_step_seconds", estimates.__getitem__)
    monkeypatch.setattr(trial, "label_of", lambda plan, first: plan)
    assert [c.label for c in trial.trial_candidates(None)] == ["plan0", "plan4", "plan5"]


class CandidateClock:
    """A fake clock whose step takes the seconds of the candidate it ran (``durations[id(plan)]``, ``running``: the
    plan of the step that runs)."""

    def __init__(self, durations: dict) -> None:
        self.durations, self.now, self.running = durations, 0.0, None
        self.reads: list[float] = []

    def mark(self) -> float:
        if self.running is not None:
            self.now += self.durations[id(self.running)]
        return self.now

    def seconds(self, start: float, end: float) -> float:
        self.reads.append(end - start)
        return end - start


def _steps(durations: dict, candidates: list[TrialCandidate], shared: list) -> tuple[TrialSteps, CandidateClock]:
    clock = CandidateClock(durations)
    steps = TrialSteps(candidates=lambda seq_len, batch: candidates, clock=clock, log=lambda text: None,
                       share=lambda value: shared.append(value) or value)
    return steps, clock


def test_steps_run_the_trial_and_keep_its_choice():
    """A run of one length: the steps run the candidates in turn, each step's time is read when the step after the
    next begins (never the step just begun), the choice is shared once and kept, and the later steps run on it."""
    plans = [plan_memory(**TINY, recompute_attention=value) for value in (False, True)]
    candidates = [TrialCandidate(f"c{i}", 1.0, plan) for i, plan in enumerate(plans)]
    shared: list = []
    steps, clock = _steps({id(plans[0]): 3.0, id(plans[1]): 2.0}, candidates, shared)
    ran = []
    for _ in range(10):
        plan = steps.step((256, 1))
        clock.running = plan
        ran.append(plans.index(plan))
    assert ran[:6] == [0, 0, 0, 1, 1, 1] and ran[-2:] == [1, 1]
    assert shared == [1] and steps.kept == {key_name((256, 1)): choice_of(plans[1])}
    assert steps.chosen_plan((256, 1)) is plans[1]


def test_an_interval_with_an_evaluation_in_it_is_no_steps_time():
    """Something else between two training batches (an evaluation, a save) makes that interval no step's: its time
    is not counted, and the candidate runs one more timed step at the schedule's end."""
    plans = [plan_memory(**TINY, recompute_attention=value) for value in (False, True)]
    candidates = [TrialCandidate(f"c{i}", 1.0, plan) for i, plan in enumerate(plans)]
    steps, clock = _steps({id(plans[0]): 3.0, id(plans[1]): 2.0}, candidates, [])
    ran = []
    for index in range(10):
        plan = steps.step((256, 1))
        clock.running = plan
        ran.append(plans.index(plan))
        if index == 4:  # a timed step of the second candidate
            steps.interrupt()
            clock.now += 1000.0  # the evaluation's time
    trial = steps.trials[(256, 1)]
    assert ran[:7] == [0, 0, 0, 1, 1, 1, 1] and trial.decided and trial.chosen == 1
    assert trial.medians() == [3.0, 2.0]


def test_a_kept_choice_is_not_tried_again():
    """Choices loaded from a checkpoint: the length runs on the kept configuration without a trial; a kept choice
    that no candidate fits any more leaves the length to its plan."""
    plans = [plan_memory(**TINY, recompute_attention=value) for value in (False, True)]
    candidates = [TrialCandidate(f"c{i}", 1.0, plan) for i, plan in enumerate(plans)]
    steps, _ = _steps({}, candidates, [])
    steps.load_state({key_name((256, 1)): choice_of(plans[1]), key_name((512, 1)): {"chunks": 999}})
    assert steps.step((256, 1)) is plans[1] and not steps.trials
    assert steps.step((512, 1)) is None and not steps.trials
    assert steps.state() == {key_name((256, 1)): choice_of(plans[1]), key_name((512, 1)): {"chunks": 999}}


def test_the_budget_keeps_the_choices_with_a_checkpoint():
    """A run's choices go into the checkpoint under their key and come back out of it into a resumed run's trials
    (the key removed, as Lightning's own restore expects no unknown key); without plan_trial nothing is kept."""
    import torch

    from lightning_fpdt.strategy.budget import MemoryBudget, RunFacts
    from lightning_fpdt.strategy.plan_trial import CHOICES_KEY

    facts = RunFacts(model=None, device=torch.device("cpu"), world_size=1, local_processes=1,
                     sequence_parallel_size=1, ring_size=1, precision="32-true")
    first = MemoryBudget(plan_trial=True)
    first.bind(facts)
    first.trials.kept[key_name((256, 1))] = {"chunks": 2, "offload": True}
    checkpoint: dict = {}
    first.save_choices(checkpoint)
    assert checkpoint[CHOICES_KEY] == {key_name((256, 1)): {"chunks": 2, "offload": True}}
    resumed = MemoryBudget(plan_trial=True)
    resumed.bind(facts)
    resumed.load_choices(checkpoint)
    assert CHOICES_KEY not in checkpoint and resumed.trials.kept == first.trials.kept
    off = MemoryBudget(plan_trial=False)
    off.bind(facts)
    off.save_choices(checkpoint)
    assert off.trials is None and CHOICES_KEY not in checkpoint
